"""The names of the nodes changed between two rounds of a fleet-wide job, bounded
(``actors/fleet/changed_nodes.py``), and the jobs that look at every node once they
were too many."""

from __future__ import annotations

import gc
import sys
import tracemalloc

import pytest

from actors.fleet import record_state
from actors.fleet.aggregator import hot_state, record_rules
from actors.fleet.aggregator.hot_state import NodeState
from actors.fleet.aggregator.sweep_queue import SweepQueue
from actors.fleet.changed_nodes import BEATS, FLOOR, WRITES, ChangedNodes


@pytest.mark.parametrize("share", [BEATS, WRITES])
def test_names_are_kept_up_to_a_share_of_the_nodes_then_every_node_is_looked_at(
    share: int,
) -> None:
    """Up to one node in ``share`` is kept by name (a node noted twice, once); one more
    and the round is told to look at every node; the next round starts afresh."""
    nodes = 100_000
    changed = ChangedNodes(lambda: nodes, share)
    assert changed.take() == set()  # the limit follows the fleet from the first take on
    kept = nodes // share
    for i in range(kept):
        changed.note(f"n{i}")
    changed.note("n0")
    assert changed.take() == {f"n{i}" for i in range(kept)}
    for i in range(kept + 1):
        changed.note(f"n{i}")
    assert changed.take() is None
    changed.note("n7")
    assert changed.take() == {"n7"}


def test_the_writes_of_a_policy_round_at_100000_nodes_are_kept_by_name() -> None:
    """A checkpoint a minute per node is 25,000 writes in the policy's 15 s round: kept
    by name (looking at every node would decode every record), a burst of every node
    not."""
    changed = ChangedNodes(lambda: 100_000, WRITES)
    changed.take()
    for i in range(25_000):
        changed.note(f"n{i}")
    assert len(changed.take() or ()) == 25_000
    for i in range(100_000):
        changed.note(f"n{i}")
    assert changed.take() is None


def test_a_small_fleet_keeps_its_names_up_to_the_floor() -> None:
    changed = ChangedNodes(lambda: 10, BEATS)
    changed.take()
    for i in range(FLOOR):
        changed.note(f"n{i}")
    assert len(changed.take() or ()) == FLOOR
    for i in range(FLOOR + 1):
        changed.note(f"n{i}")
    assert changed.take() is None


def test_every_node_changed_costs_a_share_of_a_set_of_every_node() -> None:
    """100,000 nodes each noted between two rounds, as a running fleet's beats are: the
    names held stay under 1 MB at their peak, where a set of every node was a 4 MB table."""
    nodes = [sys.intern(f"node-{i:06d}") for i in range(100_000)]
    changed = ChangedNodes(lambda: len(nodes), BEATS)
    changed.take()
    gc.collect()
    tracemalloc.start()
    try:
        for node in nodes:
            changed.note(node)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000, f"{peak:,} bytes held for the names"
    assert changed.take() is None
    everyone = set(nodes)
    assert sys.getsizeof(everyone) > 4_000_000  # what each job held before


def test_a_full_sweep_after_most_nodes_changed_looks_at_every_node() -> None:
    """The sweep queue told of more than a share of the nodes looks at every node, the
    unchanged ones too; told of a few, only those."""
    table = hot_state.NodeTable()
    record = record_state.with_state(record_rules.pending_record("n", "c1"), last_seen=1.0)
    names = [f"n{i}" for i in range(FLOOR * 2)]
    for name in names:
        table[name] = NodeState(record, written=0.0)
    queue = SweepQueue(table, lambda record: None)
    assert len(queue.take(0.0)) == len(names)  # the first sweep: every node
    table.changed("n1")
    table.changed("n2")
    assert sorted(queue.take(1.0)) == ["n1", "n2"]
    for name in names[: FLOOR + 1]:
        table.changed(name)
    assert sorted(queue.take(2.0)) == sorted(names)
    assert queue.take(3.0) == []
