"""The remediation policy's decisions from current node records: cordon, recover, only
what it did, sticky after N, and the breaker's absolute and percentage caps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

from actors.fleet.remediation.config import PolicyConfig, load_policy
from actors.fleet.remediation.findings import classify
from actors.fleet.remediation.policy import decide
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
