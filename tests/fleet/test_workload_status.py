"""What a listed workload is now, as every view shows it: never ``ready`` on a node that
does not report or was forgotten, the two copies of a moving replica told apart, and an
endpoint only for a copy that serves."""

from __future__ import annotations

import msgspec

from actors.fleet.live.workload_status import serving, status
from schemas.events import WorkloadState
from schemas.messages import NodeRecord, WorkloadSummary
from schemas.placement import Leftover, PlacedWorkload, Replica
from schemas.workloads import Deploy

NOW = 10_000.0


def node(name: str, state: str = "active", **changes: object) -> NodeRecord:
    record = NodeRecord(node_id=name, cluster="c1", state=state, last_seq=1, last_seen=NOW)
    return msgspec.structs.replace(record, **changes)


def listed(state: WorkloadState = "ready", reason: str = "") -> WorkloadSummary:
    return WorkloadSummary(
        name="chat", engine="llamacpp", state=state, since=NOW, port=8000, reason=reason
    )


def moved() -> PlacedWorkload:
    """Replica 0 moved from n1 to n2 (n1's copy still to stop)."""
    return PlacedWorkload(
        name="chat",
        deploy=Deploy(name="chat", engine="llamacpp"),
        created_at=1.0,
        replicas=[Replica(index=0, node="n2", cluster="c1")],
        leftovers=[Leftover(node="n1", cluster="c1", index=0, since=NOW, stop_by=NOW + 60)],
    )


def test_a_copy_on_a_node_that_does_not_report_is_unknown_never_ready() -> None:
    """Stale, offline and stopped nodes' copies are unknown, with how long; none serves."""
    for state, since in (
        ("stale", {"stale_since": NOW - 120}),
        ("offline", {"offline_since": NOW - 600, "stale_since": NOW - 700}),
        ("stopped", {"stopped_since": NOW - 5}),
    ):
        shown = status(node("n1", state, **since), listed(), (), NOW)
        assert shown.startswith(f"unknown (node {state} "), shown
        assert not serving(shown)
    assert status(node("n1", "stale", stale_since=NOW - 120), listed(), (), NOW) == (
        "unknown (node stale 2m)"
    )


def test_a_copy_on_a_forgotten_or_deregistered_node_is_orphaned() -> None:
    """An operator's forget and the node's own deregistration both orphan its copies."""
    forgotten = node("n1", "deregistered", deregistered=True, deregistered_by="UOPERATOR")
    assert status(forgotten, listed(), (), NOW) == "orphaned (node forgotten)"
    left = node("n1", "deregistered", deregistered=True, deregistered_by="node")
    assert status(left, listed(), (), NOW) == "orphaned (node deregistered)"
    assert not serving(status(forgotten, listed(), (), NOW))


def test_the_two_copies_of_a_move_are_told_apart_and_a_failed_one_has_no_endpoint() -> None:
    """The old copy is replaced (naming where it went); the new one moving until ready,
    then ready; a failed copy shows its reason and serves nothing."""
    placed = [moved()]
    old = status(node("n1"), listed(), placed, NOW)
    assert old == "replaced (replica 0 moved to n2)" and not serving(old)
    starting = status(node("n2"), listed("starting"), placed, NOW)
    assert starting == "moving (replica 0 from n1; starting)" and not serving(starting)
    assert status(node("n2"), listed(), placed, NOW) == "ready"
    assert serving("ready")
    failed = status(node("n3"), listed("failed", "cannot start: no llama-server"), (), NOW)
    assert failed == "failed (cannot start: no llama-server)" and not serving(failed)
