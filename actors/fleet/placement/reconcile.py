"""The reconciler's decisions for one placed workload: a pure function of its record, the
nodes' records and the time.

- A replica whose node is stale, offline, stopped, deregistered or gone for ``grace``
  seconds is placed elsewhere; its copy there is stopped (a signed Stop saying the copy
  still ran when the node came back) if the node reports it again, re-admitted after a
  forget included.
- A replica whose node drains (or is in a maintenance window started with ``--drain``)
  is placed elsewhere at once, and its copy on that node stopped once the new one is
  ready (or ``handoff`` seconds passed): the node's drain waits for that stop, so the
  work moves before the drain finishes.
- A replica that crash-loops or failed on its node, or that its node does not report
  ``grace`` seconds after the deploy (refused, or stopped by hand), is stopped there and
  tried on another node, never that one again; the failure is kept in the workload's
  ``failures``, and no replica of it goes to that node within FAILURE_BACKOFF (a drain
  moving another replica included).
- A pending replica (no node fits) is placed as soon as one fits; a node in a
  maintenance window is never chosen.

Every fact a decision reads is current within a heartbeat: the aggregators write a node's
record at once when its state, schedulability or workloads change, so a reporting node's
record says what it runs now, though the heartbeat in it may be a checkpoint old (GPU
readings are written once per checkpoint_interval). No decision waits for a newer one.

Nothing here sends anything: the caller writes the new record by compare-and-set and only
then sends the orders, so of two reconcilers deciding at once only one moves a replica.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import msgspec

from actors.fleet.placement.choose import FAILURE_BACKOFF, Choice, Taken, choose, clip
from actors.fleet.placement.store import Order
from actors.fleet.storage.placed import listed
from schemas.events import WorkloadState
from schemas.messages import NodeRecord
from schemas.placement import (
    MAX_AVOID,
    MAX_FAILURES,
    MAX_LEFTOVERS,
    Failure,
    Leftover,
    PlacedWorkload,
    Replica,
)
from schemas.workloads import Stop

LOST_STATES = frozenset({"stale", "offline", "stopped"})
"""Record states of a node whose agent does not report: stopped is a goodbye (a requested
stop), stale and offline a silence."""
FAILED_STATES: frozenset[WorkloadState] = frozenset({"crashloop", "failed"})
LEFTOVER_KEEP = 86_400.0
"""A copy on a node that never reports again is forgotten after a day."""


@dataclass(frozen=True)
class Timing:
    grace: float = 60.0
    """Seconds a node may be lost (or a deploy unreported) before its replica moves."""
    handoff: float = 120.0
    """Seconds a draining node's copy waits for its replacement to be ready."""
    restop: float = 60.0
    """A copy still listed this long after its Stop gets another."""


@dataclass
class Decision:
    workload: PlacedWorkload
    orders: list[Order] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def trouble(
    workload: PlacedWorkload,
    replica: Replica,
    record: NodeRecord | None,
    now: float,
    t: Timing,
    evacuate: Mapping[str, str] | None = None,
) -> tuple[str, bool, bool] | None:
    """Why ``replica`` must leave its node now: (reason, failed there, draining); None
    while it stays. ``evacuate``: the maintenance window moving the placed replicas off
    each node in one started with ``--drain``."""
    if record is None:
        return "its node's record is gone", False, False
    if record.deregistered:
        since = record.deregistered_at or record.last_seen
        return ("its node deregistered", False, False) if now - since >= t.grace else None
    if record.state in LOST_STATES:
        began = record.stopped_since if record.state == "stopped" else record.stale_since
        since = began or record.last_seen
        if now - since < t.grace:
            return None
        return f"its node is {record.state} since {now - since:.0f}s", False, False
    beat = record.heartbeat
    if beat is None:
        return None
    if beat.schedulability in ("draining", "drained"):
        return f"its node is {beat.schedulability}", False, True
    window = (evacuate or {}).get(record.node_id)
    if window is not None:
        return f"its node is in maintenance (window {window}, --drain)", False, True
    running = listed(record, workload.name)
    if running is not None and running.state in FAILED_STATES:
        return f"{running.state} there: {running.reason}", True, False
    deployed = replica.deployed_at or 0.0
    # A reporting node's record is current in what it runs (the aggregators write a
    # change of its workloads at once), whenever its last checkpoint was.
    if (running is None or running.state == "stopped") and now - deployed >= t.grace:
        return "its node does not run it (deploy refused, or stopped by hand)", True, False
    return None


def needs_choice(
    workload: PlacedWorkload,
    records: dict[str, NodeRecord],
    now: float,
    t: Timing,
    evacuate: Mapping[str, str] | None = None,
) -> bool:
    """Whether a replica of ``workload`` needs a node chosen now (pending, or in trouble):
    only then must the reconciler read every node's record."""
    return any(
        not replica.node or trouble(workload, replica, records.get(replica.node), now, t, evacuate)
        for replica in workload.replicas
    )


def deploy_order(workload: PlacedWorkload, choice: Choice, command_id: str, why: str) -> Order:
    action = msgspec.structs.replace(workload.deploy, gpus=choice.gpus, placed=True)
    return Order(choice.node, choice.cluster, action, command_id, why)


def decide(
    workload: PlacedWorkload,
    records: dict[str, NodeRecord],
    taken: Taken,
    now: float,
    t: Timing,
    by: str,
    maintenance: Mapping[str, str] | None = None,
    evacuate: Mapping[str, str] | None = None,
) -> Decision:
    """The next record of ``workload`` and the commands to send once it is written.
    ``taken`` (every placed workload's GPUs) is updated with what this decision places;
    ``maintenance`` names the window covering each node in one, ``evacuate`` those of
    windows started with ``--drain`` (their replicas move as off a draining node)."""
    batch = uuid.uuid4().hex[:16]
    decision = Decision(workload)
    replicas = list(workload.replicas)
    leftovers = list(workload.leftovers)
    failures = [f for f in workload.failures if now - f.at < FAILURE_BACKOFF]
    hopeless: list[tuple[frozenset[str], str]] = []
    """Why no node fit a replica of this decision, with the nodes it avoided."""

    def choice(current: PlacedWorkload, avoid: Sequence[str]) -> Choice | str:
        """:func:`choose`, unless no node fit a replica before that avoided only nodes this
        one avoids too: every step since only took GPUs and added replicas and failures,
        so none fits this one either, and its every node is not weighed again (0.25 s at
        100,000 nodes, 64 times for a workload of 64 replicas that fits nowhere)."""
        avoided = frozenset(avoid)
        for before, why in hopeless:
            if before <= avoided:
                return why
        found = choose(current, records, taken, avoid, now, maintenance)
        if isinstance(found, str):
            hopeless.append((avoided, found))
        return found

    for position, replica in enumerate(replicas):
        current = msgspec.structs.replace(workload, replicas=replicas, failures=failures)
        command_id = f"{workload.name}-{replica.index}-{batch}"
        if not replica.node:
            found = choice(current, replica.avoid)
            if isinstance(found, str):
                replicas[position] = msgspec.structs.replace(replica, why=found)
                continue
            taken.add(found.node, found.gpus)
            replicas[position] = msgspec.structs.replace(
                replica,
                node=found.node,
                cluster=found.cluster,
                gpus=found.gpus,
                deployed_at=now,
                command_id=command_id,
                why=found.why,
            )
            decision.orders.append(deploy_order(workload, found, command_id, "placed"))
            decision.notes.append(f"replica {replica.index} placed on {found.node}")
            continue
        problem = trouble(workload, replica, records.get(replica.node), now, t, evacuate)
        if problem is None:
            continue
        reason, failed_here, draining = problem
        avoid = list(replica.avoid)
        if failed_here:
            if replica.node not in avoid:
                avoid = [*avoid, replica.node][-MAX_AVOID:]
            failure = Failure(node=replica.node, index=replica.index, at=now, reason=clip(reason))
            failures = [*failures, failure][-MAX_FAILURES:]
            current = msgspec.structs.replace(current, failures=failures)
        found = choice(current, avoid)
        if isinstance(found, str) and draining:
            why = clip(f"cannot leave {replica.node} ({reason}): {found}")
            replicas[position] = msgspec.structs.replace(replica, why=why)
            continue
        leftovers = [lo for lo in leftovers if lo.node != replica.node][-(MAX_LEFTOVERS - 1) :]
        leftovers.append(
            Leftover(
                node=replica.node,
                cluster=replica.cluster,
                index=replica.index,
                since=now,
                stop_by=now + t.handoff if draining and not isinstance(found, str) else now,
                reason=clip(reason),
                node_lost=not failed_here and not draining,
            )
        )
        moved = f"moved off {replica.node}: {reason}"
        if isinstance(found, str):
            replicas[position] = Replica(
                index=replica.index,
                moves=replica.moves + 1,
                avoid=avoid,
                why=clip(f"{moved}; {found}"),
            )
            decision.notes.append(f"replica {replica.index} left {replica.node}; no node fits")
            continue
        taken.add(found.node, found.gpus)
        replicas[position] = Replica(
            index=replica.index,
            node=found.node,
            cluster=found.cluster,
            gpus=found.gpus,
            deployed_at=now,
            command_id=command_id,
            why=clip(f"{moved}; {found.why}"),
            moves=replica.moves + 1,
            avoid=avoid,
        )
        decision.orders.append(deploy_order(workload, found, command_id, moved))
        decision.notes.append(f"replica {replica.index} moved from {replica.node} to {found.node}")
    leftovers = stops(workload, replicas, leftovers, records, now, t, batch, decision)
    decision.workload = msgspec.structs.replace(
        workload, replicas=replicas, leftovers=leftovers, failures=failures
    )
    if decision.workload != workload:
        decision.workload = msgspec.structs.replace(
            decision.workload, updated_at=now, updated_by=by
        )
    return decision


def stops(
    workload: PlacedWorkload,
    replicas: list[Replica],
    leftovers: list[Leftover],
    records: dict[str, NodeRecord],
    now: float,
    t: Timing,
    batch: str,
    decision: Decision,
) -> list[Leftover]:
    """The leftovers still to watch; a Stop ordered for each that is due."""
    kept = []
    placed_on = {replica.node for replica in replicas if replica.node}
    for leftover in leftovers:
        record = records.get(leftover.node)
        if now - leftover.since > LEFTOVER_KEEP:
            continue
        if leftover.node in placed_on:
            continue  # a replica runs there again: never stop it
        # A forgotten, deregistered or vanished node may come back (re-admitted) with the
        # copy still running: watched until it reports. What a reporting node runs is
        # current in its record (written at once when it changes), however old the
        # heartbeat in it: no need to wait for a newer one.
        if (
            record is None
            or record.deregistered
            or record.state in LOST_STATES
            or record.heartbeat is None
        ):
            kept.append(leftover)
            continue
        running = listed(record, workload.name)
        if running is None or not running.placed:
            continue  # gone from the node (or what runs there now is not the fleet's): done
        replacement = next((r for r in replicas if r.index == leftover.index), None)
        ready = replacement is not None and replacement.node != ""
        if ready and replacement is not None:
            there = listed(records.get(replacement.node), workload.name)
            ready = there is not None and there.state == "ready"
        due = now >= leftover.stop_by or ready or running.state in FAILED_STATES
        resend = leftover.stopped_at is None or now - leftover.stopped_at >= t.restop
        if due and resend:
            decision.orders.append(
                Order(
                    leftover.node,
                    leftover.cluster,
                    Stop(name=workload.name),
                    f"{workload.name}-{leftover.index}-stop-{batch}",
                    stop_reason(leftover),
                )
            )
            decision.notes.append(f"stop replica {leftover.index}'s old copy on {leftover.node}")
            leftover = msgspec.structs.replace(leftover, stopped_at=now)
        kept.append(leftover)
    return kept


def stop_reason(leftover: Leftover) -> str:
    """What the Stop of a leftover copy says (the node's result repeats it): a copy left on
    a node that was lost is one found still running when that node came back."""
    if not leftover.node_lost:
        return f"replica {leftover.index} moved: {leftover.reason}"
    return (
        f"replica {leftover.index} was moved off this node ({leftover.reason}): "
        "its copy still ran when the node came back"
    )
