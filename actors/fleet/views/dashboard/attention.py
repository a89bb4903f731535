"""What needs a person, node by node, and the counts the overview opens on. Pure.

A node's concern (:func:`concern`) ranks what in its record and the fleet's facts asks
for an operator, most urgent first (:data:`CONCERNS`): the policy gave it up, it is
unhealthy, silent (offline, then stale), degraded, refused, or waits for approval. A
node an operator already deals with (a maintenance window covers it) or one that is
fine has none. The table's default order is by concern, then health, then name:
problems first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from actors.fleet.record_state import KNOWN_NOW
from schemas.messages import MaintenanceWindow, NodeRecord
from schemas.remediation import Hold

CONCERNS = (
    "policy needs a person",
    "unhealthy",
    "offline",
    "stale",
    "degraded",
    "refused",
    "waits for approval",
)
"""What needs a person, by rank (the first is the most urgent)."""


def concern(record: NodeRecord, hold: Hold | None, window: MaintenanceWindow | None) -> int | None:
    """The rank in CONCERNS of what in the node needs a person; None when nothing does
    (or a maintenance window says an operator is on it)."""
    if record.state == "deregistered" or window is not None:
        return None
    known = record.state in KNOWN_NOW
    if hold is not None and hold.needs_attention:
        rank = 0
    elif known and record.health_status == "unhealthy":
        rank = 1
    elif record.state in ("offline", "stale"):
        rank = CONCERNS.index(record.state)
    elif known and record.health_status == "degraded":
        rank = 4
    elif record.refused:
        rank = 5
    elif record.state == "pending":
        rank = 6
    else:
        return None
    return rank


@dataclass
class Tally:
    """The fleet counted once per snapshot: by state (and cluster), by health, what the
    policy holds and what needs a person, and each concerned node's rank."""

    by_state: dict[str, int] = field(default_factory=dict)
    by_cluster: dict[str, dict[str, int]] = field(default_factory=dict)
    unhealthy: int = 0
    degraded: int = 0
    policy_held: int = 0
    policy_needs: int = 0
    maintenance: int = 0
    concerns: dict[str, int] = field(default_factory=dict)
    """Node id to its concern's rank, for the nodes that have one."""
    by_concern: dict[int, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.by_state.values())


def tally(
    records: Iterable[NodeRecord],
    holds: Mapping[tuple[str, str], Hold],
    window: Callable[[NodeRecord], MaintenanceWindow | None] | None = None,
) -> Tally:
    """Count ``records`` (deregistered ones left out); ``holds`` are the policy's by
    (cluster, node), ``window`` the maintenance window covering a node (None: no window
    is in force). Written for 100,000 records a snapshot: one pass, few calls."""
    counted = Tally()
    by_state = counted.by_state
    by_cluster = counted.by_cluster
    concerns = counted.concerns
    for record in records:
        state = record.state
        if state == "deregistered":
            continue
        by_state[state] = by_state.get(state, 0) + 1
        cluster = by_cluster.get(record.cluster)
        if cluster is None:
            cluster = by_cluster[record.cluster] = {}
        cluster[state] = cluster.get(state, 0) + 1
        health = record.health_status
        held = holds.get((record.cluster, record.node_id)) if holds else None
        if (
            state == "active"
            and health != "degraded"
            and health != "unhealthy"
            and held is None
            and window is None
            and not record.refused
        ):
            continue  # the common case: fine, and nothing else to count
        if state in KNOWN_NOW:
            counted.unhealthy += health == "unhealthy"
            counted.degraded += health == "degraded"
        if held is not None:
            counted.policy_held += 1
            counted.policy_needs += held.needs_attention
        covering = window(record) if window is not None else None
        counted.maintenance += covering is not None
        rank = concern(record, held, covering)
        if rank is not None:
            concerns[record.node_id] = rank
            counted.by_concern[rank] = counted.by_concern.get(rank, 0) + 1
    return counted
