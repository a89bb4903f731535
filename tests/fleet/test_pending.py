"""Pending registrations' rules: the keys of a name, the candidates it takes, the counts
per key, and a record's candidates gone once a heartbeat is accepted."""

from __future__ import annotations

from actors.fleet.aggregator import pending, record_rules
from schemas import signing
from schemas.messages import MAX_CANDIDATES
from tests.support.fleet import heartbeat


def keys(count: int) -> list[str]:
    return [signing.KeyPair.generate().public_key for _ in range(count)]


def test_candidates_are_added_once_up_to_the_cap() -> None:
    """A new key joins the name's candidates; a key it has, or one past the cap, does not."""
    first, *others = keys(MAX_CANDIDATES + 2)
    record = record_rules.pending_record("n1", "c1", first, since=1.0)
    for key in others[:MAX_CANDIDATES]:
        added = pending.with_candidate(record, key, "c1", 2.0)
        assert added is not None
        record = added
    assert pending.keys(record) == [first, *others[:MAX_CANDIDATES]]
    assert pending.with_candidate(record, first, "c1", 3.0) is None
    assert pending.with_candidate(record, others[-1], "c1", 3.0) is None
    assert pending.why_unrecorded(record, others[-1], "", "").startswith(
        f"{MAX_CANDIDATES + 1} keys registered this name already"
    )
    assert pending.why_unrecorded(record, first, "new", "candidate") == ""
    assert pending.why_unrecorded(None, first, "new", "candidate") == "new"


def test_accepting_a_heartbeat_clears_the_candidates() -> None:
    """Once a heartbeat under the approved key is accepted the record is no longer
    pending and lists that key only."""
    first, second = keys(2)
    record = pending.with_candidate(
        record_rules.pending_record("n1", "c1", first, since=1.0), second, "c1", 2.0
    )
    assert record is not None
    accepted = record_rules.accept(record, heartbeat(seq=1), second, now=3.0)
    assert accepted.candidates == [] and pending.keys(accepted) == [second]
    assert pending.with_candidate(accepted, first, "c1", 4.0) is None


def test_counts_per_key_come_from_every_key_of_a_pending_name() -> None:
    """A recount counts pending names once and each of their keys once per name."""
    first, second = keys(2)
    one = record_rules.pending_record("n1", "c1", first, since=1.0)
    both = pending.with_candidate(record_rules.pending_record("n2", "c1", first), second, "c1", 1.0)
    assert both is not None
    counts = pending.PendingCounts()
    counts.recount([one, both])
    assert counts.names == 2 and counts.by_key == {first: 2, second: 1}
    counts.add(second, "", new_name=True)
    assert counts.names == 3 and counts.by_key[second] == 2
