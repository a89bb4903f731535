"""The verdict on a run's :class:`~tests.faults.history.History`: pure, so its own test
feeds it histories made by hand (``tests/faults/test_checker.py``).

What it holds the fleet to (the bounds are :class:`Bounds`, from the fleet's settings):

- **commands**: every command FLEET_CMD acknowledged ran exactly once on its node (its
  log says ``command accepted`` once) or was answered ``failed`` / ``rejected``; none
  ran twice, acknowledged or not; every command that ran has its ``done`` (or
  ``failed``) result stored;
- **stale**: a node whose agent really stopped (killed, paused) is found stale within
  ``Bounds.detect`` of stopping, by exactly one ``stale`` alert, and recovers with exactly
  one ``recovered``; the detection clock runs only while an aggregator holds the node's
  partition (``History.holdings``; none recorded: always), so a node back before its
  partition had an owner again need not be found stale; a node cut off from every
  server may be found stale (once, then one ``recovered``); any other ``stale`` alert is
  false: the node was alive and a quorum could reach it;
- **ownership**: no partition consumer of FLEET_HB acknowledged by one loop, then another,
  then the first again (two owners' acks interleaved), and no node's record written back
  to an older heartbeat than one written before (a heartbeat judged twice);
- **alerts**: none stored twice under one ``Nats-Msg-Id``; every alert publish seen on the
  wire, and every one a process logged as not published, is stored in the end; every
  record that went ``stale`` has its ``stale`` alert;
- **convergence**: after every heal, within ``Bounds.converge``, every live node is live
  in ``fleet_nodes``, every partition is held and every command has its result; and no
  partition of FLEET_HB goes without an ack of its consumer for longer than
  ``Bounds.converge`` while a node of it beats (a consumer without a leader: held, yet
  read by nobody);
- **logs**: a timeout during a fault is not logged as an actor crash with a traceback.
"""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from schemas.subjects import partition_of
from tests.faults.history import Ack, History, RecordWrite, Settings, StoredAlert

HEARTBEAT_CONSUMER = "aggregator"
"""The durable base name of FLEET_HB's partition consumers (``aggregator-<P>``)."""
FINAL_FAILURES = frozenset({"failed", "rejected"})
TIMEOUT_WORDS = ("timeout", "timed out", "TimeoutError")


@dataclass(frozen=True)
class Bounds:
    """Seconds: ``detect``, from a node's stop to its ``stale`` alert; ``cut_grace``, how
    long after a cut node's heal a ``stale`` alert still belongs to the cut (it was raised
    from heartbeats that expired during it); ``recover``, from a stopped node's return
    (or its stale alert, if later) to its ``recovered`` alert; ``converge``, from a heal
    to the converged fleet; ``stale_write``, between a record's stale write and its
    alert."""

    detect: float
    cut_grace: float
    recover: float
    converge: float
    stale_write: float = 10.0

    @classmethod
    def of(cls, settings: Settings, converge: float = 60.0) -> Bounds:
        # The TTL runs out stale_after after the last beat, which is at most an interval
        # before the stop; the marker is read within a linger, judged at once, and the
        # sweep catches what a marker does not. 2 s for a loaded machine.
        detect = settings.stale_after + settings.heartbeat_interval + settings.sweep_interval + 2.0
        return cls(
            detect=detect,
            cut_grace=detect,
            recover=converge,
            converge=converge,
        )


@dataclass(frozen=True)
class Violation:
    kind: str
    detail: str


@dataclass
class Report:
    violations: list[Violation] = field(default_factory=list)
    figures: dict[str, object] = field(default_factory=dict)

    def add(self, kind: str, detail: str) -> None:
        self.violations.append(Violation(kind, detail))

    def count(self, kind: str) -> int:
        return sum(1 for violation in self.violations if violation.kind == kind)


def check(history: History, bounds: Bounds | None = None) -> Report:
    bounds = bounds or Bounds.of(history.settings)
    report = Report()
    _commands(history, report)
    _stale(history, bounds, report)
    _owners(history, report)
    _alerts(history, bounds, report)
    _convergence(history, bounds, report)
    _logs(history, report)
    _figures(history, report)
    return report


def _commands(history: History, report: Report) -> None:
    runs = Counter(execution.command_id for execution in history.executions)
    statuses: dict[str, set[str]] = defaultdict(set)
    for result in history.results:
        statuses[result.command_id].add(result.status)
    executed = lost = 0
    for command in history.commands:
        ran, answered = runs[command.id], statuses[command.id]
        if ran > 1:
            report.add(
                "duplicate_execution",
                f"{command.action} {command.id} ran {ran} times on {command.node}",
            )
        if ran == 1 and command.acked is not None:
            executed += 1
        if command.acked is not None and ran == 0 and not answered & FINAL_FAILURES:
            lost += 1
            report.add(
                "lost_command",
                f"{command.action} {command.id} to {command.node}, acknowledged at "
                f"{_at(history, command.acked)}, never ran nor failed "
                f"(results: {sorted(answered) or 'none'})",
            )
        if ran and not answered & (FINAL_FAILURES | {"done"}):
            report.add(
                "result_missing",
                f"{command.action} {command.id} ran on {command.node}; no final result stored "
                f"(results: {sorted(answered) or 'none'})",
            )
    report.figures["commands"] = {
        "sent": len(history.commands),
        "acknowledged": sum(1 for c in history.commands if c.acked is not None),
        "executed": executed,
        "lost": lost,
        "duplicated": sum(1 for c in history.commands if runs[c.id] > 1),
    }


def _of_kind(alerts: list[StoredAlert], kind: str) -> dict[str, list[StoredAlert]]:
    found: dict[str, list[StoredAlert]] = defaultdict(list)
    for alert in sorted(alerts, key=lambda alert: alert.ts):
        if alert.kind == kind:
            found[alert.node].append(alert)
    return found


def _stale(history: History, bounds: Bounds, report: Report) -> None:
    stale = _of_kind(_unique(history.alerts), "stale")
    recovered = _of_kind(_unique(history.alerts), "recovered")
    windows = _windows(history, bounds)
    gaps = _ownership_gaps(history)
    allowed: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for (node, _), window in windows.items():
        allowed[node].append(window)
    false = missed = 0
    for node, alerts in stale.items():
        for alert in alerts:
            if not any(start <= alert.ts <= end for start, end in allowed[node]):
                false += 1
                report.add(
                    "false_stale",
                    f"{node} called stale at {_at(history, alert.ts)} "
                    f"({_during(history, alert.ts)})",
                )
    for index, fault in enumerate(history.faults):
        for node in fault.stopped + fault.cut:
            window = windows[node, index]
            found = [a for a in stale.get(node, []) if window[0] <= a.ts <= window[1]]
            what = (
                f"{node} ({fault.kind} at {_at(history, fault.started)}, "
                f"healed {fault.healed - fault.started:.1f}s later)"
            )
            if len(found) > 1:
                report.add("duplicate_stale", f"{what}: {len(found)} stale alerts")
            partition = partition_of(node, history.settings.partitions)
            deadline = _owned_for(gaps.get(partition, []), fault.started, bounds.detect)
            if node in fault.stopped and fault.healed >= deadline:
                unowned = deadline - fault.started - bounds.detect
                bound = f"{bounds.detect:g}s" + (
                    f" + {unowned:.1f}s its partition {partition} had no owner"
                    if unowned >= 0.05
                    else ""
                )
                if not found:
                    missed += 1
                    report.add("missed_stale", f"{what}: no stale alert within {bound}")
                elif found[0].ts > deadline:
                    missed += 1
                    report.add(
                        "missed_stale",
                        f"{what}: stale after {found[0].ts - fault.started:.1f}s, over {bound}",
                    )
            if found:
                # Its recovery: after its stale alert, before its next one (a later fault's).
                later = [a.ts for a in stale[node] if a.ts > found[-1].ts]
                until = min([max(found[0].ts, fault.healed) + bounds.recover, *later])
                back = [a for a in recovered.get(node, []) if found[0].ts <= a.ts < until]
                if len(back) != 1:
                    report.add(
                        "recovered", f"{what}: {len(back)} recovered alerts after its stale one"
                    )
    report.figures["false_stale"] = false
    report.figures["missed_stale"] = missed


def _ownership_gaps(history: History) -> dict[int, list[tuple[float, float]]]:
    """Per partition, the stretches of the run (in time order) in which no aggregator
    held it (``History.holdings``); none when holdings were not recorded."""
    if history.holdings is None:
        return {}
    held: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for holding in history.holdings:
        until = history.ended if holding.until is None else holding.until
        held[holding.partition].append((holding.since, until))
    gaps: dict[int, list[tuple[float, float]]] = {}
    for partition in range(history.settings.partitions):
        free, since = [], history.started
        for start, end in sorted(held[partition]):
            if start > since:
                free.append((since, start))
            since = max(since, end)
        if since < history.ended:
            free.append((since, history.ended))
        gaps[partition] = free
    return gaps


def _owned_for(gaps: list[tuple[float, float]], start: float, seconds: float) -> float:
    """The moment ``seconds`` of owned time (outside ``gaps``) have passed since
    ``start``: a node's stop is only judged while its partition has an owner."""
    at = start
    for gap_start, gap_end in gaps:
        if gap_end <= at:
            continue
        if gap_start >= at + seconds:
            break
        seconds -= max(0.0, gap_start - at)
        at = gap_end
    return at + seconds


def _at(history: History, at: float) -> str:
    """A time as seconds from the run's start (the timeline's)."""
    return f"+{at - history.started:.1f}s"


def _windows(history: History, bounds: Bounds) -> dict[tuple[str, int], tuple[float, float]]:
    """Per (node, fault index) of a fault that stopped or cut the node off: when a stale
    alert of the node belongs to it, from its start to its heal plus the grace, or to the
    start of the node's next such fault if that comes first."""
    windows: dict[tuple[str, int], tuple[float, float]] = {}
    for index, fault in enumerate(history.faults):
        for node in fault.stopped + fault.cut:
            later = [
                other.started
                for other in history.faults[index + 1 :]
                if node in other.stopped + other.cut
            ]
            windows[node, index] = (
                fault.started,
                min([fault.healed + bounds.cut_grace, *later[:1]]),
            )
    return windows


def _during(history: History, at: float) -> str:
    """The fault in force at ``at`` (or the last one before it), for a violation's detail."""
    before = [fault for fault in history.faults if fault.started <= at]
    if not before:
        return "before any fault"
    fault = max(before, key=lambda fault: fault.started)
    when = "during" if at <= fault.healed else f"{at - fault.healed:.1f}s after"
    return f"{when} {fault.kind} of {fault.target}, +{at - fault.started:.1f}s from its start"


def _owners(history: History, report: Report) -> None:
    """Per consumer, the owners (delivery inboxes) in the order their acks came: one that
    acks again after another has acked is a second owner at once."""
    by_consumer: dict[str, list[Ack]] = defaultdict(list)
    for ack in sorted(history.acks, key=lambda ack: ack.at):
        if ack.owner:
            by_consumer[ack.consumer].append(ack)
    doubles = 0
    for consumer, series in by_consumer.items():
        finished: set[str] = set()
        current = ""
        for ack in series:
            if ack.owner == current:
                continue
            if ack.owner in finished:
                doubles += 1
                report.add(
                    "double_owner",
                    f"{consumer}: {ack.owner} acked seq {ack.stream_seq} at "
                    f"{_at(history, ack.at)} after {current} had taken over",
                )
            if current:
                finished.add(current)
            current = ack.owner
    report.figures["double_owners"] = doubles
    _regressions(history, report)


def _regressions(history: History, report: Report) -> None:
    """A node's record written with a lower ``last_seq`` than an earlier write of it: a
    heartbeat judged again after a newer one (two judges, or one judging backwards).
    Sequence numbers only grow, across restarts too."""
    newest: dict[str, RecordWrite] = {}
    for write in sorted(history.records, key=lambda write: write.at):
        before = newest.get(write.node)
        if before is not None and write.last_seq < before.last_seq:
            report.add(
                "judged_twice",
                f"{write.node}'s record went back from seq {before.last_seq} "
                f"({_at(history, before.at)}) to {write.last_seq} ({_at(history, write.at)})",
            )
        if before is None or write.last_seq > before.last_seq:
            newest[write.node] = write


def _unique(alerts: list[StoredAlert]) -> list[StoredAlert]:
    seen: dict[str, StoredAlert] = {}
    for alert in alerts:
        seen.setdefault(alert.msg_id, alert)
    return list(seen.values())


def _alerts(history: History, bounds: Bounds, report: Report) -> None:
    ids = Counter(alert.msg_id for alert in history.alerts)
    doubled = [msg_id for msg_id, n in ids.items() if n > 1]
    for msg_id in doubled:
        report.add("duplicate_alert", f"{msg_id} stored {ids[msg_id]} times")
    lost = {msg_id for _, msg_id in history.alert_publishes if msg_id and msg_id not in ids}
    lost |= {
        line.ref
        for line in history.not_published
        if line.ref.count(":") >= 3 and line.ref not in ids
    }
    stale = _of_kind(_unique(history.alerts), "stale")
    for write in _into_stale(history.records):
        near = [a for a in stale.get(write.node, []) if abs(a.ts - write.at) <= bounds.stale_write]
        if not near:
            lost.add(f"stale:?:{write.node}:record-at-{write.at:.1f}")
    for msg_id in sorted(lost):
        report.add("lost_alert", f"{msg_id} never stored")
    report.figures["alerts"] = {"stored": len(ids), "lost": len(lost), "doubled": len(doubled)}


def _into_stale(records: list[RecordWrite]) -> list[RecordWrite]:
    """The writes that turned a node's record stale."""
    last: dict[str, str] = {}
    found = []
    for write in sorted(records, key=lambda write: write.at):
        if write.state == "stale" and last.get(write.node) != "stale":
            found.append(write)
        last[write.node] = write.state
    return found


def _convergence(history: History, bounds: Bounds, report: Report) -> None:
    _silent_partitions(history, bounds, report)
    times = sorted(fault.converged for fault in history.faults if fault.converged is not None)
    for fault in history.faults:
        if fault.converged is None:
            report.add(
                "not_converged",
                f"{fault.kind} of {fault.target} at {_at(history, fault.started)}: "
                f"not converged {bounds.converge:g}s after its heal",
            )
    report.figures["convergence_s"] = {
        "bound": bounds.converge,
        "p50": _percentile(times, 0.5),
        "p99": _percentile(times, 0.99),
        "max": times[-1] if times else None,
    }


def _silent_partitions(history: History, bounds: Bounds, report: Report) -> None:
    """A partition whose consumer acked nothing for longer than ``bounds.converge`` while
    one of its nodes beat throughout (not stopped nor cut off by a fault) has not
    converged: its heartbeats were stored and nobody judged them."""
    acked: dict[int, list[float]] = defaultdict(list)
    for ack in history.acks:
        base, _, number = ack.consumer.rpartition("-")
        if base == HEARTBEAT_CONSUMER and number.isdigit():
            acked[int(number)].append(ack.at)
    silent = 0
    count = history.settings.partitions
    for partition in range(count):
        times = [history.started, *sorted(acked[partition]), history.ended]
        nodes = [n for n in history.nodes if partition_of(n, count) == partition]
        for start, end in itertools.pairwise(times):
            if end - start <= bounds.converge:
                continue
            beat = max((_longest_beat(history, n, start, end) for n in nodes), default=(0.0, ""))
            if beat[0] > bounds.converge:
                silent += 1
                report.add(
                    "not_converged",
                    f"partition {partition}: no ack from {_at(history, start)} to "
                    f"{_at(history, end)} ({end - start:.1f}s) while {beat[1]} beat for "
                    f"{beat[0]:.1f}s of it (bound {bounds.converge:g}s)",
                )
    report.figures["silent_partitions"] = silent


def _longest_beat(history: History, node: str, start: float, end: float) -> tuple[float, str]:
    """The longest stretch of ``start``..``end`` through which no fault stopped ``node`` or
    cut it off, and the node."""
    down = sorted(
        (fault.started, fault.healed)
        for fault in history.faults
        if node in fault.stopped or node in fault.cut
    )
    longest, since = 0.0, start
    for stopped, healed in down:
        if healed <= since or stopped >= end:
            continue
        longest = max(longest, stopped - since)
        since = max(since, healed)
    return max(longest, end - since), node


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return round(values[min(len(values) - 1, int(q * len(values)))], 2)


def _logs(history: History, report: Report) -> None:
    for crash in history.crashes:
        if crash.traceback and any(word in crash.reason for word in TIMEOUT_WORDS):
            report.add(
                "timeout_as_crash",
                f"{crash.source} at {_at(history, crash.at)}: {crash.msg} ({crash.reason})",
            )
    report.figures["crashes"] = {
        "logged": len(history.crashes),
        "with_traceback": sum(1 for crash in history.crashes if crash.traceback),
    }


def _figures(history: History, report: Report) -> None:
    report.figures["faults"] = dict(sorted(Counter(fault.kind for fault in history.faults).items()))
    report.figures["minutes"] = round((history.ended - history.started) / 60.0, 1)
    load = history.load
    report.figures["load"] = {
        "cores": load.cores,
        "busy_percent": load.busy_percent,
        "steal_percent": load.steal_percent,
        "load_max": load.load_max,
        "loop_lag_p99_s": load.lag_p99,
        "loop_lag_max_s": load.lag_max,
    }


def overloaded(history: History) -> str:
    """Why this run's timings may be the machine's, not the fleet's ("" when not)."""
    load = history.load
    reasons = []
    if load.busy_percent >= 90.0:
        reasons.append(f"CPU {load.busy_percent:g}% busy")
    if load.steal_percent >= 5.0:
        reasons.append(f"{load.steal_percent:g}% stolen")
    if load.cores and load.load_max > 2 * load.cores:
        reasons.append(f"load average up to {load.load_max:g} on {load.cores} cores")
    if load.lag_max >= 1.0:
        reasons.append(f"the harness's own timers up to {load.lag_max:g}s late")
    return ", ".join(reasons)
