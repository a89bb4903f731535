"""Values many nodes hold alike are kept once, and the store of them stays bounded."""

from __future__ import annotations

from actors.fleet.aggregator import record_rules
from actors.fleet.live import state_index
from actors.fleet.shared_values import SharedValues


def test_an_equal_value_is_answered_with_the_object_kept_and_the_store_bounded() -> None:
    """The first of equal values is kept and answered for the later ones; past the
    bound a new value is answered as itself and not kept."""
    shared: SharedValues[str] = SharedValues(2)
    first = "".join(["clu", "ster"])
    assert shared.one(first) is first
    assert shared.one("".join(["clus", "ter"])) is first
    shared.one("other")
    late = "".join(["la", "te"])
    assert shared.one(late) is late and len(shared) == 2
    assert shared.one("".join(["la", "te"])) is not late


def test_nodes_of_one_cluster_state_and_health_count_under_one_key_object() -> None:
    """The state index keeps one (cluster, state, health) tuple for all the nodes that
    share it, not one per node."""
    one = record_rules.pending_record("n1", "c1")
    two = record_rules.pending_record("n2", "".join(["c", "1"]))
    assert state_index.key_of(one) is state_index.key_of(two)
