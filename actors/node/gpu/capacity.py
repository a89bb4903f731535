"""How many GPUs a node can give, counted one way for the inventory's samples and the
heartbeat: a GPU is taken when it is lost, busy (utilisation at or above BUSY_PCT) or
pinned by one of the node's workloads that has not ended."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

import msgspec

from schemas.events import Gpu, Sample

BUSY_PCT = 90.0
"""A GPU this busy is counted as taken even with no workload of ours on it."""
PINNING = ("starting", "ready", "stopping")
"""Workload states that hold their GPUs (failed, crashloop and stopped ones have let go)."""


class Pinning(Protocol):
    """A workload as far as its GPUs go: the heartbeat's summary, or the event's own."""

    @property
    def state(self) -> str: ...

    @property
    def gpus(self) -> list[int]: ...


def pinned(workloads: Iterable[Pinning]) -> set[int]:
    """The GPU indices the node's live workloads were deployed on."""
    return {gpu for workload in workloads if workload.state in PINNING for gpu in workload.gpus}


def free_gpus(gpus: Sequence[Gpu], taken: set[int]) -> int:
    """GPUs neither lost, busy nor in ``taken``."""
    return sum(
        1
        for gpu in gpus
        if not gpu.lost and (gpu.utilization_pct or 0) < BUSY_PCT and gpu.index not in taken
    )


def with_workloads(sample: Sample, workloads: Sequence[Pinning]) -> Sample:
    """``sample`` with ``gpus_available`` counting the GPUs ``workloads`` pin as taken."""
    taken = pinned(workloads)
    if not taken:
        return sample
    capacity = msgspec.structs.replace(
        sample.capacity, gpus_available=free_gpus(sample.gpus, taken)
    )
    return msgspec.structs.replace(sample, capacity=capacity)
