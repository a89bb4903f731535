"""Where a replica may run: a pure function of the nodes' records and what is already
placed, with the reason for every node passed over.

A node fits a :class:`PlacedWorkload` when it is reporting and schedulable (state
``active`` or ``degraded``: never cordoned, draining, unhealthy, stale or offline), in
the workload's cluster, has every label of its selector, runs no replica of it (replicas
are spread, one a node) nor another workload of that name, and has ``gpus`` free GPUs.
A GPU is free when it is not lost, not busy (90 % utilization and above, as the node's
``gpus_available`` counts), held by no workload the node reports (unless that one
failed or stopped) and by no replica placed there whose deploy the node has not reported
yet; with ``gpu_memory`` set, its free memory must be at least that. Among the nodes that
fit, the one with the fewest placed replicas of any workload is chosen (spread), then
the most free GPUs, the best health score, the node id.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from actors.fleet.labels import matches
from schemas.messages import NodeRecord
from schemas.placement import PlacedWorkload

PLACEABLE = frozenset({"active", "degraded"})
"""Record states of a node new work may go to."""
FREE_STATES = frozenset({"failed", "crashloop", "stopped"})
"""Workload states that hold no GPU."""
BUSY_UTILIZATION = 90.0
"""A GPU this busy is not free (the node's own ``gpus_available`` counts it so)."""
MAX_WHY = 1000
GIB = 1024**3


@dataclass
class Taken:
    """What placed workloads hold, across all of them: GPUs per node (placed, the node's
    report perhaps not in yet) and replicas per node (for spreading)."""

    gpus: dict[str, set[int]] = field(default_factory=dict)
    replicas: dict[str, int] = field(default_factory=dict)

    def add(self, node: str, gpus: Iterable[int]) -> None:
        self.gpus.setdefault(node, set()).update(gpus)
        self.replicas[node] = self.replicas.get(node, 0) + 1


def taken_by(workloads: Iterable[PlacedWorkload]) -> Taken:
    taken = Taken()
    for workload in workloads:
        for replica in workload.replicas:
            if replica.node:
                taken.add(replica.node, replica.gpus)
    return taken


@dataclass
class Choice:
    node: str
    cluster: str
    gpus: list[int]
    why: str


def free_gpus(record: NodeRecord, workload: PlacedWorkload, taken: Taken) -> list[int] | str:
    """The node's free GPUs (most free memory first) for ``workload``, or why it has none
    to give."""
    beat = record.heartbeat
    if beat is None or beat.sample is None:
        return "no GPU inventory reported yet"
    held = set(taken.gpus.get(record.node_id, set()))
    for running in beat.workloads:
        if running.state not in FREE_STATES:
            held.update(running.gpus)
    usable = []
    short_memory = 0
    for gpu in beat.sample.gpus:
        if gpu.lost or (gpu.utilization_pct or 0.0) >= BUSY_UTILIZATION or gpu.index in held:
            continue
        free_memory = gpu.memory_total - gpu.memory_used
        if workload.gpu_memory and free_memory < workload.gpu_memory:
            short_memory += 1
            continue
        usable.append((free_memory, gpu.index))
    usable.sort(key=lambda pair: (-pair[0], pair[1]))
    count = min(len(usable), beat.sample.capacity.gpus_available)
    if count < workload.gpus:
        memory = (
            f", {short_memory} more with less than {workload.gpu_memory / GIB:.1f} GiB free"
            if short_memory
            else ""
        )
        return f"{count} of {len(beat.sample.gpus)} GPUs free{memory}, {workload.gpus} needed"
    return [index for _, index in usable]


def refusal(
    record: NodeRecord, workload: PlacedWorkload, taken: Taken, avoid: Iterable[str]
) -> list[int] | str:
    """The free GPUs of a node that fits ``workload``, or why it does not."""
    beat = record.heartbeat
    if record.deregistered:
        return "deregistered"
    if record.state not in PLACEABLE:
        reason = beat.schedulability_reason if beat is not None else ""
        return record.state + (f" ({reason})" if reason else "")
    if beat is None:
        return "no heartbeat yet"
    if beat.schedulability != "schedulable":
        return beat.schedulability
    if workload.cluster and record.cluster != workload.cluster:
        return f"cluster {record.cluster}"
    if not matches(record.labels, workload.selector.items()):
        return "labels do not match"
    if record.node_id in avoid:
        return "this replica failed there before"
    if any(replica.node == record.node_id for replica in workload.replicas):
        return "runs a replica already"
    if any(running.name == workload.name for running in beat.workloads):
        return f"a workload named {workload.name} runs there"
    return free_gpus(record, workload, taken)


def choose(
    workload: PlacedWorkload,
    records: Mapping[str, NodeRecord],
    taken: Taken,
    avoid: Iterable[str] = (),
) -> Choice | str:
    """The best node for one more replica of ``workload``, with why; or why none fits."""
    fits: list[tuple[tuple[int, int, int, str], NodeRecord, list[int]]] = []
    passed: list[str] = []
    avoided = set(avoid)
    for node, record in sorted(records.items()):
        found = refusal(record, workload, taken, avoided)
        if isinstance(found, str):
            passed.append(f"{node}: {found}")
            continue
        rank = (taken.replicas.get(node, 0), -len(found), -(record.health_score or 0), node)
        fits.append((rank, record, found))
    if not fits:
        if not passed:
            return "no nodes in the fleet"
        return clip(f"no node fits: {'; '.join(passed)}")
    fits.sort(key=lambda item: item[0])
    (placed, _, _, _), record, free = fits[0]
    gpus = sorted(free[: workload.gpus])
    offer = f"GPUs {','.join(map(str, gpus))}" if gpus else "no GPU needed"
    why = (
        f"{record.node_id}: {offer} ({len(free)} free), {placed} replicas placed there, "
        f"health {record.health_score if record.health_score is not None else '?'}"
    )
    others = [f"{item[1].node_id} ({len(item[2])} free)" for item in fits[1:4]]
    if len(fits) > 4:
        others.append(f"{len(fits) - 4} more")
    if others:
        why += f"; also fit: {', '.join(others)}"
    if passed:
        why += f"; passed over: {'; '.join(passed)}"
    return Choice(node=record.node_id, cluster=record.cluster, gpus=gpus, why=clip(why))


def clip(text: str) -> str:
    return text if len(text) <= MAX_WHY else text[: MAX_WHY - 3] + "..."
