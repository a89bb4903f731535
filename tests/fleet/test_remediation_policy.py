"""The remediation policy's decisions from current node records: cordon, recover, only
what it did, sticky after N, and the breaker's absolute and percentage caps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

from actors.fleet.remediation.config import PolicyConfig, load_policy
from actors.fleet.remediation.findings import classify
from actors.fleet.remediation.policy import decide, dry_run
from actors.runtime.config import ConfigError
from schemas.events import Health, HealthCheck
from schemas.messages import NodeRecord
from schemas.remediation import PolicyRecord
from tests.support.fleet import heartbeat

POLICY = "UPOLICYKEY"
OPERATOR = "UOPERATORKEY"
NOW = 1_800_000_000.0


def config(**settings: Any) -> PolicyConfig:
    values: dict[str, Any] = {"key_file": "/dev/null", "dry_run": False, "recover_after": 60.0}
    return PolicyConfig(**{**values, **settings})


def node(
    name: str,
    sick: str = "",
    schedulability: str = "schedulable",
    by: str = "",
    state: str = "active",
) -> NodeRecord:
    """A node record whose last heartbeat is unhealthy for check ``sick`` (if any)."""
    checks = [HealthCheck(name=sick, status="unhealthy", reason=f"{sick} broke")] if sick else []
    health = Health(ts=NOW, status="unhealthy" if sick else "healthy", score=40, checks=checks)
    beat = heartbeat(name, schedulability=schedulability, schedulability_by=by, health=health)
    return NodeRecord(
        node_id=name, cluster="c1", state=state, last_seq=1, last_seen=NOW, heartbeat=beat
    )


def fleet(count: int, sick: dict[str, str] | None = None, **nodes: NodeRecord) -> list[NodeRecord]:
    sick = sick or {}
    records = [node(f"n{index}", sick.get(f"n{index}", "")) for index in range(count)]
    return [nodes.get(record.node_id, record) for record in records]


def test_unhealthy_node_is_cordoned_and_held() -> None:
    """An XID-unhealthy schedulable node is cordoned, held with its reason and counted."""
    plan = decide(config(), POLICY, PolicyRecord(cluster="c1"), fleet(20, {"n3": "xid"}), NOW, "x")
    assert [(order.node, order.action) for order in plan.orders] == [("n3", "cordon")]
    hold = plan.record.holds["n3"]
    assert (hold.reason_class, hold.command_id, hold.since) == ("xid", "x-0", NOW)
    assert plan.record.history["n3"] == [NOW] and plan.record.limit == 2


def test_classes_not_configured_are_left_alone() -> None:
    """A node unhealthy for a class the policy does not act on is not touched."""
    plan = decide(
        config(classes=["gpu"]),
        POLICY,
        PolicyRecord(cluster="c1"),
        fleet(20, {"n1": "xid"}),
        NOW,
        "x",
    )
    assert plan.orders == [] and plan.record.holds == {}
    found = classify(node("n1", "gpu_nvlink"), ["gpu"])
    assert found is not None
    assert (found.reason_class, found.detail) == ("gpu", "gpu_nvlink: gpu_nvlink broke")


def held(records: list[NodeRecord], current: PolicyRecord, at: float) -> PolicyRecord:
    return decide(config(), POLICY, current, records, at, "y").record


def test_recovered_node_is_uncordoned_after_the_hysteresis() -> None:
    """Cordoned by the policy and healthy again: uncordoned only once healthy for
    recover_after seconds."""
    first = decide(config(), POLICY, PolicyRecord(cluster="c1"), fleet(20, {"n1": "xid"}), NOW, "x")
    mine = node("n1", schedulability="cordoned", by=POLICY, state="cordoned")
    waiting = decide(config(), POLICY, first.record, fleet(20, n1=mine), NOW + 10, "y")
    assert waiting.orders == [] and waiting.record.holds["n1"].healthy_since == NOW + 10
    back = decide(config(), POLICY, waiting.record, fleet(20, n1=mine), NOW + 71, "z")
    assert [(order.node, order.action) for order in back.orders] == [("n1", "uncordon")]
    assert back.record.holds == {}


def test_operator_cordoned_node_is_never_uncordoned() -> None:
    """A node an operator cordoned is neither cordoned nor uncordoned by the policy, and a
    held node an operator re-cordoned is released untouched."""
    operator = node("n1", "xid", schedulability="cordoned", by=OPERATOR, state="cordoned")
    plan = decide(config(), POLICY, PolicyRecord(cluster="c1"), fleet(20, n1=operator), NOW, "x")
    assert plan.orders == [] and plan.record.holds == {}
    first = decide(config(), POLICY, PolicyRecord(cluster="c1"), fleet(20, {"n1": "xid"}), NOW, "x")
    taken = node("n1", schedulability="cordoned", by=OPERATOR, state="cordoned")
    later = decide(config(), POLICY, first.record, fleet(20, n1=taken), NOW + 500, "y")
    assert later.orders == [] and later.record.holds == {}
    slurm = node("n1", schedulability="drained", by="slurm", state="drained")
    assert decide(config(), POLICY, first.record, fleet(20, n1=slurm), NOW + 1, "y").orders == []


def test_sticky_after_n_remediations() -> None:
    """The Nth remediation within the window stays cordoned with needs_attention."""
    current = PolicyRecord(cluster="c1", history={"n1": [NOW - 300, NOW - 200]})
    first = decide(config(max_remediations=3), POLICY, current, fleet(20, {"n1": "xid"}), NOW, "x")
    mine = node("n1", schedulability="cordoned", by=POLICY, state="cordoned")
    healthy = decide(
        config(max_remediations=3), POLICY, first.record, fleet(20, n1=mine), NOW + 1, "y"
    )
    sticky = decide(
        config(max_remediations=3), POLICY, healthy.record, fleet(20, n1=mine), NOW + 100, "z"
    )
    assert sticky.orders == [] and sticky.record.holds["n1"].needs_attention
    assert [kind for kind, _, _ in sticky.notes] == ["needs_attention"]


@pytest.mark.parametrize(
    ("settings", "limit"),
    [({"breaker_max": 2, "breaker_percent": 100.0}, 2), ({"breaker_percent": 10.0}, 2)],
)
def test_breaker_trips_at_the_cap(settings: dict[str, Any], limit: int) -> None:
    """3 of 20 nodes failing at once with a cap of 2 (absolute, or 10 %): the breaker
    trips, nothing is done, one alert lists the would-be actions; it stays tripped."""
    sick = {"n1": "xid", "n2": "xid", "n3": "gpu_memory"}
    plan = decide(config(**settings), POLICY, PolicyRecord(cluster="c1"), fleet(20, sick), NOW, "x")
    assert plan.orders == [] and plan.record.holds == {} and plan.tripped
    assert plan.record.tripped_at == NOW and plan.record.limit == limit
    assert len(plan.record.would) == 3 and plan.record.would[0].startswith("cordon n1")
    assert [kind for kind, _, _ in plan.notes] == ["breaker_tripped"]
    again = decide(config(**settings), POLICY, plan.record, fleet(20, {"n1": "xid"}), NOW + 5, "y")
    assert again.orders == [] and not again.tripped and again.notes == []


def test_reset_breaker_decides_on_current_state_only() -> None:
    """After a reset the policy acts on what the nodes say now, not on the events that
    tripped it: nodes recovered meanwhile are not cordoned."""
    tripped = PolicyRecord(cluster="c1", tripped_at=NOW, would=["cordon n1", "cordon n2"])
    reset = msgspec.structs.replace(tripped, tripped_at=None, would=[])
    plan = decide(config(), POLICY, reset, fleet(20, {"n5": "xid"}), NOW + 3600, "x")
    assert [order.node for order in plan.orders] == ["n5"]


def test_policy_file_is_checked(tmp_path: Path) -> None:
    """A policy file with an unknown setting or a percentage above 100 is refused in one
    line; a good one loads."""
    path = tmp_path / "policy.toml"
    path.write_text('key_file = "k"\nbreaker_percent = 150\n')
    with pytest.raises(ConfigError, match="breaker_percent"):
        load_policy(path)
    path.write_text('key_file = "k"\nclasses = ["xid"]\nrecover_after = "5m"\nbogus = 1\n')
    with pytest.raises(ConfigError, match="bogus"):
        load_policy(path)
    path.write_text('key_file = "k"\nclasses = ["xid"]\nrecover_after = 300\n')
    assert load_policy(path).classes == ["xid"]


def test_a_heartbeat_naming_the_policys_key_does_not_make_the_node_its_own() -> None:
    """A node whose heartbeat claims ``schedulability_by`` = the policy's key, cordoned or
    drained, sick or healthy, while the policy holds nothing of it: no command (no
    uncordon however long it stays healthy), no hold, no hook, no history; the policy's
    own record is what says it cordoned a node."""
    cfg = config(
        classes=["xid"],
        recover_after=1.0,
        hooks={"reset": ["true"]},
        hook_after={"xid": ["reset"]},
    )
    for sick in ("", "xid"):
        for schedulability in ("cordoned", "drained"):
            claimed = node("n1", sick, schedulability, by=POLICY, state=schedulability)
            current = PolicyRecord(cluster="c1")
            for at in (NOW, NOW + 3600, NOW + 86400):
                plan = decide(cfg, POLICY, current, fleet(20, n1=claimed), at, "x")
                assert plan.orders == [] and plan.hooks == [] and plan.notes == []
                assert plan.record.holds == {} and plan.record.history == {}
                current = plan.record


def cordoned(name: str, sick: str = "") -> NodeRecord:
    """``name`` with the policy's cordon in its heartbeat."""
    return node(name, sick, schedulability="cordoned", by=POLICY, state="cordoned")


def test_a_rejected_cordon_is_refused_once_and_never_sent_again() -> None:
    """The node's signed rejection makes the hold refused: one needs_attention note
    naming why, no command again in later rounds, and the breaker does not count it: two
    real failures then fit a breaker of 2."""
    cfg = config(breaker_max=2, breaker_percent=100.0)
    first = decide(cfg, POLICY, PolicyRecord(cluster="c1"), fleet(20, {"n1": "xid"}), NOW, "x")
    why = "the node answered rejected: signed by an untrusted key UPOLICYKEY"
    refused = decide(
        cfg, POLICY, first.record, fleet(20, {"n1": "xid"}), NOW + 1, "y", refusals={"n1": why}
    )
    hold = refused.record.holds["n1"]
    assert hold.refused == why and hold.needs_attention and refused.orders == []
    assert [(kind, node) for kind, node, _ in refused.notes] == [("needs_attention", "n1")]
    assert "fleetctl policy clear n1 --cluster c1" in refused.notes[0][2]
    later = decide(cfg, POLICY, refused.record, fleet(20, {"n1": "xid"}), NOW + 600, "z")
    assert later.orders == [] and later.notes == [] and later.record == refused.record
    sick = {"n1": "xid", "n2": "xid", "n3": "xid"}
    two = decide(cfg, POLICY, refused.record, fleet(20, sick), NOW + 700, "w")
    assert sorted(order.node for order in two.orders) == ["n2", "n3"] and not two.tripped


def test_no_cordon_and_no_answer_within_grace_is_refused_until_it_shows() -> None:
    """A node reporting for ``grace`` without showing the policy's cordon or answering is
    refused (not released and cordoned again every round); if the cordon shows after all,
    the hold is applied and no longer needs attention."""
    cfg = config(grace=60.0)
    first = decide(cfg, POLICY, PolicyRecord(cluster="c1"), fleet(20, {"n1": "xid"}), NOW, "x")
    waiting = decide(cfg, POLICY, first.record, fleet(20, {"n1": "xid"}), NOW + 30, "y")
    assert waiting.notes == [] and not waiting.record.holds["n1"].refused
    late = decide(cfg, POLICY, first.record, fleet(20, {"n1": "xid"}), NOW + 61, "y")
    hold = late.record.holds["n1"]
    assert hold.refused == "no cordon shown and no answer within 60s" and hold.needs_attention
    again = decide(cfg, POLICY, late.record, fleet(20, {"n1": "xid"}), NOW + 900, "z")
    assert again.orders == [] and again.notes == []
    shown = decide(cfg, POLICY, late.record, fleet(20, n1=cordoned("n1", "xid")), NOW + 901, "w")
    hold = shown.record.holds["n1"]
    assert hold.applied and not hold.refused and not hold.needs_attention
    assert shown.notes == [("remediation", "n1", "cordon took effect after all")]


def test_the_breaker_counts_reporting_nodes_only_and_says_its_base() -> None:
    """Pending registrations, stale and offline records are not in the breaker's base: 4
    reporting nodes at 50 % allow 2, whatever else is recorded."""
    records = fleet(4, {"n1": "xid", "n2": "xid", "n3": "xid"})
    records += [node(f"p{index}", state="pending") for index in range(8)]
    records += [node("s1", state="stale"), node("o1", state="offline")]
    plan = decide(
        config(breaker_percent=50.0), POLICY, PolicyRecord(cluster="c1"), records, NOW, "x"
    )
    assert plan.record.base == 4 and plan.record.limit == 2 and plan.tripped
    assert "(of 4 reporting nodes)" in plan.notes[0][2]


def test_a_tripped_breaker_records_a_release_once() -> None:
    """While tripped, a held node an operator took over is let go once (one note, kept in
    the record), not noted again every round; no command goes out."""
    hold = decide(config(), POLICY, PolicyRecord(cluster="c1"), fleet(20, {"n1": "xid"}), NOW, "x")
    applied = decide(config(), POLICY, hold.record, fleet(20, n1=cordoned("n1", "xid")), NOW, "y")
    tripped = msgspec.structs.replace(applied.record, tripped_at=NOW, would=["cordon n9"])
    taken = node("n1", "xid", schedulability="cordoned", by=OPERATOR, state="cordoned")
    once = decide(config(), POLICY, tripped, fleet(20, n1=taken), NOW + 5, "z")
    assert once.orders == [] and once.record.holds == {} and once.record.tripped_at == NOW
    assert once.notes == [("remediation", "n1", f"released: set by {OPERATOR}")]
    twice = decide(config(), POLICY, once.record, fleet(20, n1=taken), NOW + 10, "w")
    assert twice.notes == [] and twice.record == once.record


def test_maintenance_is_skipped_unless_the_policy_acts_on_it() -> None:
    """With maintenance = skip a sick node in a window is neither cordoned nor counted and
    a held one is left as it is, both listed as skipped; with act the node is cordoned."""
    held = decide(config(), POLICY, PolicyRecord(cluster="c1"), fleet(20, {"n2": "xid"}), NOW, "x")
    records = fleet(20, {"n1": "xid"}, n2=cordoned("n2"))
    windows = {"n1": "r12", "n2": "r12"}
    skipped = decide(
        config(recover_after=1.0), POLICY, held.record, records, NOW + 600, "y", maintenance=windows
    )
    assert skipped.orders == [] and "n2" in skipped.record.holds
    assert skipped.record.skipped == {
        "n1": "would cordon (xid): in maintenance window r12",
        "n2": "held; in maintenance window r12: left as it is",
    }
    acting = decide(
        config(maintenance="act"), POLICY, PolicyRecord(cluster="c1"), records, NOW, "z",
        maintenance=windows,
    )  # fmt: skip
    assert [order.node for order in acting.orders] == ["n1"] and acting.record.skipped == {}


def silent(
    name: str, boot: str = "b1", state: str = "stale", seen: float = NOW - 700
) -> NodeRecord:
    """``name`` silent since ``seen`` (schedulable and healthy when it last beat)."""
    record = node(name, state=state)
    return msgspec.structs.replace(record, boot_id=boot, last_seen=seen, stale_since=seen + 2)


def test_a_hung_node_runs_its_hook_once_and_returns_only_after_a_new_boot_id() -> None:
    """Silent past hung_after: cordoned (in its queue) and held as ``hung``; its hung hook
    runs while it stays silent; back with its old boot id it stays held; with a new one
    the hold goes on (cordon shown, healthy) to an uncordon."""
    cfg = config(
        classes=["xid", "hung"],
        hooks={"bmc": ["true"]},
        hook_after={"hung": ["bmc"]},
        reboot_hooks=["bmc"],
        recover_after=60.0,
    )
    first = decide(cfg, POLICY, PolicyRecord(cluster="c1"), fleet(20, n1=silent("n1")), NOW, "x")
    assert [(order.node, order.action) for order in first.orders] == [("n1", "cordon")]
    hold = first.record.holds["n1"]
    assert (hold.reason_class, hold.reboot_from) == ("hung", "b1")
    assert hold.reason.startswith("no heartbeat for 700s")
    hook = decide(cfg, POLICY, first.record, fleet(20, n1=silent("n1")), NOW + 5, "y")
    assert [(h.node, h.hook) for h in hook.hooks] == [("n1", "bmc")] and hook.orders == []
    # What the aggregator that ran it records: a reboot hook waits for the new boot id.
    rebooting = msgspec.structs.replace(
        first.record,
        holds={"n1": msgspec.structs.replace(hold, rebooting="bmc", hook_started=NOW + 10)},
    )
    still = decide(cfg, POLICY, rebooting, fleet(20, n1=silent("n1")), NOW + 20, "z")
    assert still.hooks == [] and still.orders == []
    same_boot = msgspec.structs.replace(node("n1"), boot_id="b1")
    old = decide(cfg, POLICY, rebooting, fleet(20, n1=same_boot), NOW + 30, "z")
    assert old.record.holds["n1"].back_at is None and old.orders == [] and old.hooks == []
    new_boot = msgspec.structs.replace(cordoned("n1"), boot_id="b2")
    back = decide(cfg, POLICY, rebooting, fleet(20, n1=new_boot), NOW + 40, "w")
    assert back.record.holds["n1"].back_at == NOW + 40 and back.record.holds["n1"].hooks_done
    assert back.notes == [("remediation", "n1", "hung: back with a new boot id (b1 -> b2)")]
    healthy = decide(cfg, POLICY, back.record, fleet(20, n1=new_boot), NOW + 41, "v")
    assert healthy.hooks == [] and healthy.record.holds["n1"].applied
    returned = decide(cfg, POLICY, healthy.record, fleet(20, n1=new_boot), NOW + 102, "u")
    assert [(order.node, order.action) for order in returned.orders] == [("n1", "uncordon")]
    late = decide(cfg, POLICY, rebooting, fleet(20, n1=same_boot), NOW + 10 + 901, "t")
    assert late.record.holds["n1"].needs_attention
    assert late.notes[0][0] == "needs_attention" and "no new boot id" in late.notes[0][2]


def test_hung_is_opt_in_and_never_for_goodbyes_maintenance_or_operators() -> None:
    """Not a hung case: hung not in classes, silent under hung_after, a node that said
    goodbye (stopped), one in maintenance (even with maintenance = act), one an operator
    had cordoned."""
    cfg = config(classes=["hung"])
    cases = {
        "off": (config(), silent("n1"), {}),
        "recent": (cfg, silent("n1", seen=NOW - 100), {}),
        "stopped": (cfg, msgspec.structs.replace(silent("n1"), stopped_since=NOW - 700), {}),
        "maintenance": (config(classes=["hung"], maintenance="act"), silent("n1"), {"n1": "w"}),
    }
    for name, (settings, record, windows) in cases.items():
        plan = decide(
            settings, POLICY, PolicyRecord(cluster="c1"), fleet(20, n1=record), NOW, "x",
            maintenance=windows,
        )  # fmt: skip
        assert plan.orders == [], name
    beat = node("n1", schedulability="cordoned", by=OPERATOR).heartbeat
    theirs = msgspec.structs.replace(silent("n1"), heartbeat=beat)
    plan = decide(cfg, POLICY, PolicyRecord(cluster="c1"), fleet(20, n1=theirs), NOW, "x")
    assert plan.orders == []


def test_a_dry_run_notes_each_would_be_action_once_per_change() -> None:
    """A dry run records its would-be actions and notes a node again only when what it
    would do changes (another class), not when the detail does (an XID count)."""
    cfg = config(dry_run=True)
    current = PolicyRecord(cluster="c1")
    first = dry_run(current, decide(cfg, POLICY, current, fleet(20, {"n1": "xid"}), NOW, "x"))
    assert first.orders == [] and first.record.holds == {}
    assert first.notes == [("remediation", "n1", "cordon: policy: xid: xid broke")]
    counted = node("n1")
    assert counted.heartbeat is not None and counted.heartbeat.health is not None
    check = HealthCheck(name="xid", status="unhealthy", reason="XID 79 x2 on GPU 0")
    health = msgspec.structs.replace(counted.heartbeat.health, checks=[check])
    counted = msgspec.structs.replace(
        counted, heartbeat=msgspec.structs.replace(counted.heartbeat, health=health)
    )
    same = dry_run(first.record, decide(cfg, POLICY, first.record, fleet(20, n1=counted), NOW, "y"))
    assert same.notes == [] and same.record.dry == {"n1": "cordon: policy: xid: XID 79 x2 on GPU 0"}
    other = fleet(20, {"n1": "gpu_memory"})
    changed = dry_run(same.record, decide(cfg, POLICY, same.record, other, NOW, "z"))
    assert [note[2] for note in changed.notes] == [
        "cordon: policy: gpu: gpu_memory: gpu_memory broke"
    ]
    gone = dry_run(changed.record, decide(cfg, POLICY, changed.record, fleet(20), NOW, "w"))
    assert gone.notes == [] and gone.record.dry == {}
