"""What a workload a node reported is now, as every view shows it, and whether its endpoint
is shown: a pure function of the node's record, the workload the node listed and, where a
view has them, the placed workloads.

A node's heartbeat says what ran when it was sent; a view says what is true now:

- on a node that does not report (stale, offline, stopped): ``unknown (node stale 2m)``:
  the copy may run or not, nobody knows (the agent was killed, the host hung);
- on a node forgotten or deregistered: ``orphaned (node forgotten)``: the fleet no
  longer speaks to it, whatever still runs there;
- a copy of a placed replica on a node the replica was moved off (a leftover):
  ``replaced (replica 0 moved to n2)`` until its node stops it;
- the new copy of a moved replica while it is not ready and the old one still runs:
  ``moving (replica 0 from n1)``;
- else the state the node reported, with its reason when not ready.

Only a copy shown ``ready`` (or ``moving`` but ready: the new copy serving) has its
endpoint shown; a failed, stopped, unknown, orphaned or replaced copy has none.
"""

from __future__ import annotations

from collections.abc import Sequence

from actors.runtime.spans import span
from schemas.messages import NodeRecord, WorkloadSummary
from schemas.placement import PlacedWorkload

NOT_REPORTING = frozenset({"stale", "offline", "stopped"})
"""Record states of a node whose heartbeats do not arrive: what it ran is not known."""


def status(
    record: NodeRecord,
    workload: WorkloadSummary,
    placed: Sequence[PlacedWorkload] = (),
    now: float = 0.0,
) -> str:
    """The workload as a view shows it (see the module's docstring)."""
    if record.deregistered or record.state == "deregistered":
        how = "forgotten" if record.deregistered_by not in ("", "node") else "deregistered"
        return f"orphaned (node {how})"
    if record.state in NOT_REPORTING:
        since = {
            "stale": record.stale_since,
            "offline": record.offline_since or record.stale_since,
            "stopped": record.stopped_since,
        }[record.state]
        how_long = f" {span(now - since)}" if since is not None else ""
        return f"unknown (node {record.state}{how_long})"
    reported = workload.state + (
        f" ({workload.reason})" if workload.reason and workload.state != "ready" else ""
    )
    mine = next((w for w in placed if w.name == workload.name), None)
    if mine is None:
        return reported
    current = {replica.node: replica for replica in mine.replicas if replica.node}
    old = next((lo for lo in mine.leftovers if lo.node == record.node_id), None)
    if old is not None and record.node_id not in current:
        replica = next((r for r in mine.replicas if r.index == old.index), None)
        where = f" to {replica.node}" if replica is not None and replica.node else ""
        return f"replaced (replica {old.index} moved{where})"
    replica = current.get(record.node_id)
    moving = replica is not None and any(lo.index == replica.index for lo in mine.leftovers)
    if replica is not None and moving and workload.state != "ready":
        origin = next(lo.node for lo in mine.leftovers if lo.index == replica.index)
        return f"moving (replica {replica.index} from {origin}; {reported})"
    return reported


def serving(shown: str) -> bool:
    """Whether a copy shown as ``shown`` (:func:`status`) has its endpoint shown."""
    return shown == "ready"
