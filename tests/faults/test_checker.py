"""The checker judged on histories made by hand: a clean one passes, and each defect the
harness exists to find (a lost command, one run twice, two owners of a partition at once,
a live node called stale, a stopped one never called stale, an alert never stored) is
reported as what it is; a stop no aggregator could judge (its partition had no owner)
is not. A checker that cannot fail is a defect."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from tests.faults import collect
from tests.faults.checker import Bounds, Report, check, overloaded
from tests.faults.history import (
    Ack,
    CommandSent,
    Execution,
    Fault,
    History,
    Holding,
    Load,
    LogLine,
    RecordWrite,
    Result,
    Settings,
    StoredAlert,
    load,
    save,
)
from tests.faults.net import only_run

T0 = 1_000_000.0
SETTINGS = Settings(heartbeat_interval=1.0, stale_after=5.0, lease_ttl=3.0, sweep_interval=1.0)


def clean() -> History:
    """Two commands run once each, one agent killed for 10 s (stale once, recovered once),
    one server paused (nobody stale), a partition handed from one owner to another."""
    history = History(SETTINGS, T0, T0 + 100, ["g1", "g2"])
    history.commands = [
        CommandSent("c1", "g1", "cordon", T0 + 1, T0 + 1.1),
        CommandSent("c2", "g2", "cordon", T0 + 2, T0 + 2.1),
    ]
    history.executions = [Execution("c1", "g1", T0 + 1.2), Execution("c2", "g2", T0 + 2.2)]
    history.results = [
        Result("c1", "g1", "accepted", T0 + 1.2),
        Result("c1", "g1", "done", T0 + 1.3),
        Result("c2", "g2", "done", T0 + 2.3),
    ]
    history.faults = [
        Fault("agent_kill", "g1", T0 + 10, T0 + 20, stopped=["g1"], converged=3.0),
        Fault("server_pause", "n2", T0 + 40, T0 + 48, converged=2.0),
    ]
    history.alerts = [
        StoredAlert("stale:c1:g1:q10", "stale", "g1", T0 + 15.5),
        StoredAlert("recovered:c1:g1:q11", "recovered", "g1", T0 + 22),
    ]
    history.alert_publishes = [(T0 + 15.5, "stale:c1:g1:q10"), (T0 + 22, "recovered:c1:g1:q11")]
    history.records = [
        RecordWrite(T0 + 5, "g1", "active", 5),
        RecordWrite(T0 + 15.6, "g1", "stale", 10),
        RecordWrite(T0 + 22, "g1", "active", 11),
    ]
    history.acks = [
        Ack(T0 + 1, "aggregator-3", 10, "_INBOX.a"),
        Ack(T0 + 2, "aggregator-3", 12, "_INBOX.a"),
        Ack(T0 + 9, "aggregator-3", 20, "_INBOX.b"),
        Ack(T0 + 10, "aggregator-3", 22, "_INBOX.b"),
    ]
    # g1's and g2's partitions (5 and 4 of 8), acked every 30 s at most.
    history.acks += [
        Ack(T0 + at, f"aggregator-{partition}", at, "_INBOX.c")
        for partition in (4, 5)
        for at in (5, 35, 65, 95)
    ]
    return history


def test_a_clean_history_passes() -> None:
    """A history where everything held has no violation and counts what happened."""
    report = check(clean())
    assert report.violations == []
    assert report.figures["commands"] == {
        "sent": 2,
        "acknowledged": 2,
        "executed": 2,
        "lost": 0,
        "duplicated": 0,
    }
    assert report.figures["false_stale"] == 0
    assert report.figures["double_owners"] == 0
    assert report.figures["convergence_s"] == {"bound": 60.0, "p50": 3.0, "p99": 3.0, "max": 3.0}


def test_a_lost_command_is_reported() -> None:
    """A command FLEET_CMD acknowledged that no node ran nor failed is lost; one never
    acknowledged is not."""
    history = clean()
    history.commands.append(CommandSent("c3", "g2", "uncordon", T0 + 30, T0 + 30.2))
    history.commands.append(CommandSent("c4", "g2", "uncordon", T0 + 31, None, "timeout"))
    report = check(history)
    assert [v.kind for v in report.violations] == ["lost_command"]
    assert "c3" in report.violations[0].detail
    assert report.figures["commands"]["lost"] == 1  # type: ignore[index]


def test_a_failed_command_is_not_lost() -> None:
    """A command the node answered ``failed`` is accounted for."""
    history = clean()
    history.commands.append(CommandSent("c3", "g2", "uncordon", T0 + 30, T0 + 30.2))
    history.results.append(Result("c3", "g2", "failed", T0 + 31))
    assert check(history).violations == []


def test_a_command_run_twice_is_reported() -> None:
    """A node that ran one command twice (its log says so twice) is a duplicated execution."""
    history = clean()
    history.executions.append(Execution("c2", "g2", T0 + 50))
    report = check(history)
    assert [v.kind for v in report.violations] == ["duplicate_execution"]
    assert report.figures["commands"]["duplicated"] == 1  # type: ignore[index]


def test_two_owners_at_once_are_reported() -> None:
    """An owner that acks a partition again after another took it over is a double owner."""
    history = clean()
    history.acks.append(Ack(T0 + 11, "aggregator-3", 21, "_INBOX.a"))
    report = check(history)
    assert [v.kind for v in report.violations] == ["double_owner"]
    assert "_INBOX.a" in report.violations[0].detail
    assert report.figures["double_owners"] == 1


def test_a_record_written_back_to_an_older_heartbeat_is_reported() -> None:
    """A write of a node's record with a lower seq than one written before it (an old
    owner judging after the new one) is a heartbeat judged twice."""
    history = clean()
    history.records.append(RecordWrite(T0 + 23, "g1", "active", 10))
    report = check(history)
    assert [v.kind for v in report.violations] == ["judged_twice"]
    assert "from seq 11" in report.violations[0].detail


def test_a_live_node_called_stale_is_reported() -> None:
    """A stale alert for a node no fault stopped or cut off is false (here g2, alive while
    a server was paused), and its record's stale write is no excuse."""
    history = clean()
    history.alerts.append(StoredAlert("stale:c1:g2:q40", "stale", "g2", T0 + 44))
    history.alerts.append(StoredAlert("recovered:c1:g2:q41", "recovered", "g2", T0 + 46))
    report = check(history)
    assert [v.kind for v in report.violations] == ["false_stale"]
    assert "server_pause of n2" in report.violations[0].detail
    assert report.figures["false_stale"] == 1


def test_a_cut_off_node_may_be_stale_once() -> None:
    """A node cut off from every server may be called stale, once, and recover once; a
    second stale alert within the same cut is reported."""
    history = clean()
    history.faults.append(Fault("agent_isolate", "g2", T0 + 60, T0 + 70, cut=["g2"], converged=2))
    history.alerts.append(StoredAlert("stale:c1:g2:q60", "stale", "g2", T0 + 66))
    history.alerts.append(StoredAlert("recovered:c1:g2:q70", "recovered", "g2", T0 + 71))
    assert check(history).violations == []
    history.alerts.append(StoredAlert("stale:c1:g2:q61", "stale", "g2", T0 + 67))
    assert [v.kind for v in check(history).violations] == ["duplicate_stale"]


def test_a_stopped_node_never_called_stale_is_reported() -> None:
    """A node killed for longer than the detection bound with no stale alert is missed."""
    history = clean()
    history.faults.append(Fault("agent_pause", "g2", T0 + 60, T0 + 72, stopped=["g2"], converged=2))
    report = check(history)
    assert [v.kind for v in report.violations] == ["missed_stale"]
    assert report.figures["missed_stale"] == 1


def test_a_late_stale_alert_is_missed() -> None:
    """A stale alert later than the bound after the stop counts as missed."""
    history = clean()
    history.alerts[0] = StoredAlert("stale:c1:g1:q10", "stale", "g1", T0 + 10 + 12)
    bound = Bounds.of(SETTINGS).detect
    assert bound < 12
    assert [v.kind for v in check(history).violations] == ["missed_stale"]


def test_alerts_lost_or_doubled_are_reported() -> None:
    """An alert published but never stored, a record gone stale without its alert, and an
    id stored twice are each reported."""
    history = clean()
    history.alert_publishes.append((T0 + 30, "health:c1:g2:s40"))
    history.records.append(RecordWrite(T0 + 80, "g2", "stale", 60))
    history.alerts.append(StoredAlert("recovered:c1:g1:q11", "recovered", "g1", T0 + 22))
    history.not_published.append(
        LogLine("a1", T0 + 31, "alert not published", "timeout", ref="offline:c1:g2:q1")
    )
    report = check(history)
    kinds = sorted(v.kind for v in report.violations)
    assert kinds == ["duplicate_alert", "lost_alert", "lost_alert", "lost_alert"]
    assert report.figures["alerts"] == {"stored": 2, "lost": 3, "doubled": 1}


def test_no_convergence_and_timeouts_logged_as_crashes_are_reported() -> None:
    """A heal the fleet did not converge from, and a timeout logged as a crash with a
    traceback, are violations; a bus fault logged as one is not."""
    history = clean()
    history.faults[1].converged = None
    history.crashes = [
        LogLine("a1", T0 + 42, "actor crashed; restarting", "nats: timeout", traceback=True),
        LogLine("a2", T0 + 42, "actor stopped by a bus fault; restarting", "TimeoutError"),
    ]
    kinds = sorted(v.kind for v in check(history).violations)
    assert kinds == ["not_converged", "timeout_as_crash"]


def test_an_overloaded_machine_is_named() -> None:
    """The report says when the machine, not the fleet, may explain the timings."""
    history = clean()
    assert overloaded(history) == ""
    history.load = Load(cores=2, busy_percent=97.0, steal_percent=0.0, load_max=6.0, lag_max=1.5)
    assert overloaded(history) == (
        "CPU 97% busy, load average up to 6 on 2 cores, the harness's own timers up to 1.5s late"
    )


def test_each_stop_is_judged_with_its_own_recovery() -> None:
    """A node stopped twice has one stale and one recovered alert per stop: the second
    stop's recovery is not counted against the first; a stop with two is reported."""
    history = clean()
    history.faults.append(Fault("agent_pause", "g1", T0 + 30, T0 + 40, stopped=["g1"], converged=1))
    history.alerts += [
        StoredAlert("stale:c1:g1:q30", "stale", "g1", T0 + 35.5),
        StoredAlert("recovered:c1:g1:q31", "recovered", "g1", T0 + 41),
    ]
    assert check(history).violations == []
    history.alerts.append(StoredAlert("recovered:c1:g1:q32", "recovered", "g1", T0 + 42))
    assert [v.kind for v in check(history).violations] == ["recovered"]


def test_a_stale_alert_belongs_to_the_node_s_latest_fault() -> None:
    """A node paused, then killed soon after its heal: each fault has its own stale and
    recovered alerts, none counted twice."""
    history = clean()
    history.faults += [
        Fault("agent_pause", "g2", T0 + 50, T0 + 60, stopped=["g2"], converged=0.3),
        Fault("agent_kill", "g2", T0 + 64, T0 + 74, stopped=["g2"], converged=2),
    ]
    history.alerts += [
        StoredAlert("stale:c1:g2:q50", "stale", "g2", T0 + 55),
        StoredAlert("recovered:c1:g2:q51", "recovered", "g2", T0 + 60.2),
        StoredAlert("stale:c1:g2:q54", "stale", "g2", T0 + 69),
        StoredAlert("recovered:c1:g2:q1001", "recovered", "g2", T0 + 76),
    ]
    assert check(history).violations == []


def test_one_fault_run_at_a_time(tmp_path: Path) -> None:
    """A second run on the machine does not get the lock while the first holds it (its
    clean-up would kill the first's namespaces), and gets it once the first is done. The
    lock is the test's own file, so a real run holding the machine's does not fail it."""
    lock = tmp_path / "faults.lock"
    first = only_run(lock)
    assert first is not None
    try:
        assert only_run(lock) is None
    finally:
        first.close()
    second = only_run(lock)
    assert second is not None
    second.close()


def test_a_partition_silent_while_its_node_beats_is_not_converged() -> None:
    """g2's partition acked nothing for 70 s (over the 60 s bound) while g2 beat: not
    converged, though every heal converged (a consumer without a leader); the same gap
    while g2 was cut off from the cluster is no violation."""
    history = clean()
    history.acks = [a for a in history.acks if not (a.consumer == "aggregator-4" and a.at > T0 + 5)]
    history.acks.append(Ack(T0 + 75, "aggregator-4", 75, "_INBOX.c"))
    history.acks.append(Ack(T0 + 95, "aggregator-4", 95, "_INBOX.c"))
    report = check(history)
    assert [v.kind for v in report.violations] == ["not_converged"]
    assert "partition 4" in report.violations[0].detail
    assert "g2" in report.violations[0].detail
    assert report.figures["silent_partitions"] == 1
    history.faults.append(Fault("agent_isolate", "g2", T0 + 10, T0 + 70, cut=["g2"]))
    history.faults[-1].converged = 1.0
    assert check(history).violations == []


def killed_g1(healed: float, partition_5: list[Holding]) -> History:
    """The clean history with g1 (partition 5 of 8) SIGKILLed at +47.5 s until ``healed``,
    every other partition held by a1 throughout and partition 5 as ``partition_5`` says."""
    history = clean()
    history.faults.append(
        Fault("agent_kill", "g1", T0 + 47.5, T0 + healed, stopped=["g1"], converged=2.8)
    )
    history.holdings = [Holding("a1", p, T0) for p in range(8) if p != 5] + partition_5
    return history


def stale_at(history: History, stale: float, recovered: float) -> Report:
    """``check`` of ``history`` with g1's stale alert at +``stale`` s and its recovered
    alert at +``recovered`` s added."""
    alerts = [
        StoredAlert("stale:c1:g1:q47", "stale", "g1", T0 + stale),
        StoredAlert("recovered:c1:g1:q48", "recovered", "g1", T0 + recovered),
    ]
    return check(dataclasses.replace(history, alerts=history.alerts + alerts))


def test_a_death_while_its_partition_had_no_owner_is_not_missed() -> None:
    """The busy run of issue 44: g1 killed at +47.5 s and back at +57.6 s while partition 5
    had no owner (+41.06 to +60.15 s): nobody could judge it, so no stale alert is owed;
    the same history without holdings keeps the strict rule."""
    history = killed_g1(57.6, [Holding("a2", 5, T0, T0 + 41.06), Holding("a1", 5, T0 + 60.15)])
    assert check(history).violations == []
    history.holdings = None
    assert [v.kind for v in check(history).violations] == ["missed_stale"]


def test_a_death_while_its_partition_was_owned_is_still_missed() -> None:
    """The same death with partition 5 owned throughout (handed from a2 to a1 with no
    gap) and no stale alert is missed."""
    history = killed_g1(57.6, [Holding("a2", 5, T0, T0 + 50), Holding("a1", 5, T0 + 50)])
    report = check(history)
    assert [v.kind for v in report.violations] == ["missed_stale"]
    assert "no stale alert within 9s" in report.violations[0].detail


def test_detection_is_timed_from_when_the_partition_is_owned_again() -> None:
    """g1's partition owned again at +52 s, 4.5 s into its death: a stale alert at +60 s
    (12.5 s after the stop, 8 s after the owner came) is in time, one at +62 s is not."""
    history = killed_g1(70, [Holding("a2", 5, T0, T0 + 41.06), Holding("a1", 5, T0 + 52)])
    assert stale_at(history, 60, 71).violations == []
    report = stale_at(history, 62, 71)
    assert [v.kind for v in report.violations] == ["missed_stale"]
    assert "9s + 4.5s its partition 5 had no owner" in report.violations[0].detail


def test_an_ownership_gap_during_a_death_stops_its_clock() -> None:
    """Partition 5 owned at g1's stop, then without an owner from +50 s to +60 s: the
    2.5 s owned before the gap count, the 6.5 s left run from +60 s (deadline +66.5 s)."""
    history = killed_g1(75, [Holding("a2", 5, T0, T0 + 50), Holding("a1", 5, T0 + 60)])
    assert stale_at(history, 66, 76).violations == []
    assert [v.kind for v in stale_at(history, 67, 76).violations] == ["missed_stale"]


def test_holdings_are_read_from_an_aggregator_log(tmp_path: Path) -> None:
    """A partition is held from its first ``heartbeats resumed`` (a consumer opened again
    does not restart it) to the first line losing, releasing or stopping it; one its log
    never ends is held to the end; another process's lines are ignored."""
    log = tmp_path / "a1.log"
    lines: list[tuple[str, dict[str, object]]] = [
        ("10:00:00.000", {"msg": "partitions claimed", "partitions": [4, 5]}),
        ("10:00:01.000", {"msg": "heartbeats resumed", "partition": 4, "from_seq": 1}),
        ("10:00:02.000", {"msg": "heartbeats resumed", "partition": 5, "from_seq": 1}),
        ("10:00:03.000", {"msg": "heartbeats resumed", "partition": 5, "from_seq": 9}),
        ("10:00:04.000", {"msg": "partitions lost", "partitions": [5]}),
        ("10:00:04.500", {"msg": "partitions stopped", "partitions": [5]}),
        ("10:00:05.000", {"msg": "heart beat", "partition": 6}),
    ]
    log.write_text(
        "nats-server text\n"
        + "".join(json.dumps({"time": f"2026-01-02T{t}Z", **e}) + "\n" for t, e in lines)
    )
    base = collect.when({"time": "2026-01-02T10:00:00.000Z"})
    held = collect.holdings("a1", log)
    assert held == [Holding("a1", 5, base + 2, base + 4), Holding("a1", 4, base + 1)]


def test_a_history_kept_before_holdings_loads_without_them(tmp_path: Path) -> None:
    """A history.json written before holdings were recorded loads with none (the checker
    then counts every partition as owned)."""
    path = tmp_path / "history.json"
    save(clean(), path)
    kept = json.loads(path.read_text())
    del kept["holdings"]
    path.write_text(json.dumps(kept))
    assert load(path).holdings is None
