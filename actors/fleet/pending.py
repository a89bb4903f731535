"""Pending registrations: every key that registered a node name, and what one key may hold.

A registration costs nothing to make (any key signs its own), so the first one for a name
must not decide which key an operator approves, nor may one key take the room others
need. A pending record keeps each key that registered its name (the first in
``public_key``, the others in ``candidates``, at most ``MAX_CANDIDATES``); ``fleetctl
approve NODE`` lists them all and approves without a named key only when there is one.
Each key's pending names are counted (as of the last full sweep, plus what this
aggregator registered since, like the global count) and capped at
``max_pending_per_key``, so one key cannot fill ``max_pending``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import msgspec

from schemas.messages import MAX_CANDIDATES, Candidate, NodeRecord


def keys(record: NodeRecord) -> list[str]:
    """The keys that registered ``record``'s name, first one first (none but its key when
    the record is not pending)."""
    found = [record.public_key] if record.public_key else []
    if record.state == "pending":
        found += [c.public_key for c in record.candidates if c.public_key not in found]
    return found


def _open_to(record: NodeRecord, public_key: str) -> bool:
    """Whether ``public_key`` is new to ``record``, a name no heartbeat was accepted for."""
    return record.state == "pending" and record.last_seq == 0 and public_key not in keys(record)


def with_candidate(
    record: NodeRecord, public_key: str, cluster: str, now: float
) -> NodeRecord | None:
    """``record`` with ``public_key`` added as a candidate; None when it is one already,
    the record is not an unapproved pending one, or it holds MAX_CANDIDATES."""
    if not _open_to(record, public_key) or len(record.candidates) >= MAX_CANDIDATES:
        return None
    added = Candidate(public_key=public_key, cluster=cluster, since=now)
    return msgspec.structs.replace(record, candidates=[*record.candidates, added])


def refusal(
    before: NodeRecord | None, public_key: str, new_name_refusal: str, candidate_refusal: str
) -> str:
    """Why a registration of ``public_key`` that wrote nothing is refused: the record's
    name was new (``new_name_refusal``) or open to another key (``candidate_refusal``,
    or the name's candidates are full); "" when nothing was to be written (a key the name
    has, a node no longer pending)."""
    if before is None:
        return new_name_refusal
    if not _open_to(before, public_key):
        return ""
    if len(before.candidates) >= MAX_CANDIDATES:
        return (
            f"{len(keys(before))} keys registered this name already; an operator approves "
            "yours by key (fleetctl approve NODE KEY)"
        )
    return candidate_refusal


class PendingCounts:
    """Pending names in all, and per key (a name counts once for each of its keys)."""

    def __init__(self) -> None:
        self.names = 0
        self.by_key: Counter[str] = Counter()

    def recount(self, records: Iterable[NodeRecord]) -> None:
        """Start again from the pending records the full sweep read."""
        self.names = 0
        self.by_key = Counter()
        for record in records:
            if record.state == "pending":
                self.names += 1
                self.by_key.update(keys(record))

    def add(self, public_key: str, new_name: bool) -> None:
        """A registration just recorded ``public_key`` (on a name it made, or a candidate)."""
        self.names += int(new_name)
        self.by_key[public_key] += 1
