"""What a node record's state is: derived from its facts (deregistered, offline, stale,
stopped, held by an operator, health, beating), never set on its own. Pure, and shared by
every wing that writes or shows a record: the aggregator's rules, the registry's
operator writes, the views."""

from __future__ import annotations

import msgspec

from schemas.base import RecordState
from schemas.messages import NodeRecord

HELD_STATES: dict[str, RecordState] = {
    "drained": "drained",
    "draining": "draining",
    "cordoned": "cordoned",
}
"""The schedulabilities that are also record states. A record's schedulability is read as
an open string (a newer agent may report one this version does not know): an unknown one
holds no state of its own, so the node's other facts decide."""
KNOWN_NOW = frozenset({"active", "degraded", "unhealthy", "cordoned", "draining", "drained"})
"""States in which a record's health (its last heartbeat's) is how the node is now."""


def derive_state(record: NodeRecord) -> RecordState:
    """deregistered > offline > stale > stopped > drained > draining > cordoned >
    unhealthy > degraded > active > pending, each from its own fact in the record. What
    an operator did to the node (cordon, drain) outranks its health: it says the node is
    being dealt with."""
    return state_of(
        record.deregistered,
        record.offline_since,
        record.stale_since,
        record.schedulability,
        record.health_status,
        record.last_seq,
        record.stopped_since is not None,
    )


def last_stored_at(record: NodeRecord) -> float:
    """When the stream stored the node's last accepted heartbeat (its ``last_seen``, for
    a record written before ``last_stored`` was): what its TTL runs from."""
    return record.last_stored if record.last_stored is not None else record.last_seen


def with_state(record: NodeRecord, **changes: object) -> NodeRecord:
    """``record`` with ``changes`` applied and ``state`` derived again."""
    updated = msgspec.structs.replace(record, **changes)
    return msgspec.structs.replace(updated, state=derive_state(updated))


def state_of(
    deregistered: bool,
    offline_since: float | None,
    stale_since: float | None,
    schedulability: str,
    health_status: str | None,
    last_seq: int,
    stopped: bool = False,
) -> RecordState:
    """:func:`derive_state` from the facts themselves (no record built first)."""
    if deregistered:
        return "deregistered"
    if offline_since is not None:
        return "offline"
    if stale_since is not None:
        return "stale"
    if stopped:
        return "stopped"
    held = HELD_STATES.get(schedulability)
    if held is not None:
        return held
    if health_status == "unhealthy":
        return "unhealthy"
    if health_status == "degraded":
        return "degraded"
    if last_seq > 0:
        return "active"
    return "pending"
