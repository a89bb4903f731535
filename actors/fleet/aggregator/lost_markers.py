"""TTL markers lost while ``FLEET_HB`` changed leader, made up for. Pure: the times are
given.

FLEET_HB's leader stores a node's TTL marker when the node's last heartbeat expires. One
that expires while the stream changes leader may get none (nats-server's maintainers
list that gap for replicated subject delete markers: nats-server#6741), and the dead
node was then called stale only by the full sweep's net, twice its ``stale_after`` plus
``full_sweep_interval`` later: a fault round saw it (docs/failure-detection.md, item 14).

So every aggregator hears FLEET_HB's leader elections (JetStream's advisory), and for
:data:`WINDOW` seconds after one, its sweeps look for the nodes whose marker fell due
within :data:`WINDOW` of an election and has not come :data:`MARKER_GRACE` after. Such a
node is stale only if ``FLEET_HB_IN`` no longer holds its heartbeat: the intake's copy,
stored with the same TTL, expired there, which says the node sent nothing for its
``stale_after`` (the sweep asks; see ``Sweeps.sweep_lost_markers``). An election only
starts a look, so a forged advisory makes nobody stale.
"""

from __future__ import annotations

from actors.fleet import record_state
from schemas.messages import NodeRecord

WINDOW = 15.0
"""Seconds on either side of a leader election within which a marker may have been lost
(the elections of a fault round settle within a few seconds; item 14's marker fell due
7 s after one)."""
MARKER_GRACE = 1.0
"""Seconds past its due time a marker is waited for before it is taken as lost."""
CHECKS_PER_SWEEP = 256
"""Nodes a sweep asks the intake about at most: an owner behind its stream (a backlog
after the election) sees many live nodes overdue, and each costs a read; the rest wait
for the next sweep."""
KEPT = 16
"""Elections remembered (a flapping cluster elects often; older ones are past looking)."""


class LeaderChanges:
    """When FLEET_HB's leader elections were heard (epoch seconds, this process's clock)."""

    def __init__(self) -> None:
        self.elected_at: list[float] = []

    def elected(self, at: float) -> None:
        self.elected_at = [*self.elected_at[-(KEPT - 1) :], at]

    def looking(self, now: float, slack: float) -> bool:
        """Whether a sweep at ``now`` may still find a lost marker (one due within the
        window of an election, waited for): ``slack`` is the time between two sweeps."""
        return any(now <= at + WINDOW + MARKER_GRACE + slack for at in self.elected_at)

    def lost(self, record: NodeRecord, now: float, bound: float) -> bool:
        """Whether ``record``'s node, live, should have had its marker by ``now`` (its
        last heartbeat's ``stale_after``, at most ``bound``, ran out :data:`MARKER_GRACE`
        ago or more) and it fell due within :data:`WINDOW` of an election."""
        beat = record.heartbeat
        if beat is None or record.stale_since is not None or record.deregistered:
            return False
        if record.stopped_since is not None:
            return False  # it said goodbye: its marker changes nothing
        due = record_state.last_stored_at(record) + min(beat.stale_after, bound)
        if now < due + MARKER_GRACE:
            return False
        return any(abs(due - at) <= WINDOW for at in self.elected_at)
