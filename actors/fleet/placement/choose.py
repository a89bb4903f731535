"""Where a replica may run: a pure function of the nodes' records, what is already
placed, the maintenance windows and the time, with the reason for every node passed over.

A node fits a :class:`PlacedWorkload` when it is reporting and schedulable (state
``active`` or ``degraded``: never cordoned, draining, unhealthy, stale or offline), not
in a maintenance window, in the workload's cluster, has every label of its selector, can
run the workload (its heartbeat's ``capabilities`` name the engine, or
``container:<engine>`` for a deploy with an image; a node that says nothing, an agent
older than that field, is not refused for it), no replica of the workload failed there
within FAILURE_BACKOFF, runs no replica of it (replicas are spread, one a node) nor
another workload of that name, and has ``gpus`` free GPUs. A GPU is free when it is not
lost, not busy (90 % utilization and above, as the node's ``gpus_available`` counts),
held by no workload the node reports (unless that one failed or stopped) and by no
replica placed there whose deploy the node has not reported yet; with ``gpu_memory``
set, its free memory must be at least that. Among the nodes that fit, healthy ones come
before degraded ones before any other (health not reported yet), then the most free
GPUs, then the fewest placed replicas of any workload (spread), the best health score,
the node id.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from actors.fleet.labels import matches
from actors.runtime.spans import span
from schemas.messages import NodeRecord
from schemas.placement import Failure, PlacedWorkload

PLACEABLE = frozenset({"active", "degraded"})
"""Record states of a node new work may go to."""
FREE_STATES = frozenset({"failed", "crashloop", "stopped"})
"""Workload states that hold no GPU."""
BUSY_UTILIZATION = 90.0
"""A GPU this busy is not free (the node's own ``gpus_available`` counts it so)."""
MAX_WHY = 1000
GIB = 1024**3
FAILURE_BACKOFF = 600.0
"""Seconds after a replica failed on a node (crash loop, failed to start, refused, never
reported) before any replica of that workload is placed there again."""
HEALTH_RANK = {"healthy": 0, "degraded": 1}
"""Health statuses in the order placement prefers them; any other (not reported) after."""


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


def needs(workload: PlacedWorkload) -> str:
    """The capability a node must name to run ``workload``: its engine, or
    ``container:<engine>`` for a deploy with an image."""
    engine = workload.deploy.engine
    return f"container:{engine}" if workload.deploy.image else engine


def cannot_run(record: NodeRecord, workload: PlacedWorkload) -> str:
    """Why the node cannot run ``workload`` by what its heartbeat says it can (""
    when it can, or says nothing: an agent older than ``capabilities``)."""
    beat = record.heartbeat
    said = beat.capabilities if beat is not None else None
    wanted = needs(workload)
    if said is None or wanted in said:
        return ""
    return f"cannot run {wanted} (it can run: {', '.join(said) or 'nothing'})"


def recent_failure(
    failures: Iterable[Failure], node: str, now: float, backoff: float = FAILURE_BACKOFF
) -> str:
    """Why ``node`` is not tried again yet: the newest failure of a replica there within
    ``backoff`` seconds of ``now`` ("" when none)."""
    last = None
    for failure in failures:
        if failure.node == node and now - failure.at < backoff:
            last = failure
    if last is None:
        return ""
    wait = span(last.at + backoff - now)
    detail = f" ({last.reason})" if last.reason else ""
    return (
        f"replica {last.index} failed there {span(now - last.at)} ago{detail}; "
        f"not tried again for {wait} (backoff {span(backoff)})"
    )


def refusal(
    record: NodeRecord,
    workload: PlacedWorkload,
    taken: Taken,
    avoid: Iterable[str],
    now: float,
    maintenance: str = "",
) -> list[int] | str:
    """The free GPUs of a node that fits ``workload``, or why it does not; ``maintenance``
    names the window covering the node now ("" when none)."""
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
    if maintenance:
        return f"in maintenance (window {maintenance})"
    if workload.cluster and record.cluster != workload.cluster:
        return f"cluster {record.cluster}"
    if not matches(record.labels, workload.selector.items()):
        return "labels do not match"
    unable = cannot_run(record, workload)
    if unable:
        return unable
    if record.node_id in avoid:
        return "this replica failed there before"
    failed = recent_failure(workload.failures, record.node_id, now)
    if failed:
        return failed
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
    now: float = 0.0,
    maintenance: Mapping[str, str] | None = None,
) -> Choice | str:
    """The best node for one more replica of ``workload`` at ``now``, with why; or why
    none fits. ``maintenance``: the window covering each node in one (by node)."""
    fits: list[tuple[tuple[int, int, int, int, str], NodeRecord, list[int]]] = []
    passed: list[str] = []
    avoided = set(avoid)
    windows = maintenance or {}
    for node, record in sorted(records.items()):
        found = refusal(record, workload, taken, avoided, now, windows.get(node, ""))
        if isinstance(found, str):
            passed.append(f"{node}: {found}")
            continue
        rank = (
            HEALTH_RANK.get(record.health_status or "", len(HEALTH_RANK)),
            -len(found),
            taken.replicas.get(node, 0),
            -(record.health_score or 0),
            node,
        )
        fits.append((rank, record, found))
    if not fits:
        if not passed:
            return "no nodes in the fleet"
        return clip(f"no node fits: {'; '.join(passed)}")
    fits.sort(key=lambda item: item[0])
    (_, _, placed, _, _), record, free = fits[0]
    gpus = sorted(free[: workload.gpus])
    offer = f"GPUs {','.join(map(str, gpus))}" if gpus else "no GPU needed"
    score = record.health_score if record.health_score is not None else "?"
    health = record.health_status or "health not reported"
    why = (
        f"{record.node_id}: {offer} ({len(free)} free), {health} (score {score})"
        f"{_can(record, workload)}, {placed} replicas placed there"
    )
    others = [f"{item[1].node_id} ({len(item[2])} free)" for item in fits[1:4]]
    if len(fits) > 4:
        others.append(f"{len(fits) - 4} more")
    if others:
        why += f"; also fit: {', '.join(others)}"
    if passed:
        why += f"; passed over: {'; '.join(passed)}"
    return Choice(node=record.node_id, cluster=record.cluster, gpus=gpus, why=clip(why))


def _can(record: NodeRecord, workload: PlacedWorkload) -> str:
    """The capability the chosen node said it has, for ``why``."""
    beat = record.heartbeat
    if beat is None or beat.capabilities is None:
        return ", capabilities not said (an older agent)"
    return f", can run {needs(workload)}"


def clip(text: str) -> str:
    return text if len(text) <= MAX_WHY else text[: MAX_WHY - 3] + "..."
