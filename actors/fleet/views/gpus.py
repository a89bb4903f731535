"""Every GPU of the fleet as rows (``fleetctl gpus`` and the dashboard's GPU page): one
row per GPU of each node's last accepted heartbeat, with the workloads holding it, and
the orders they can be listed in.

A node whose heartbeats are not current (stale, offline, pending, deregistered, a state
this version does not know) keeps its GPUs' names and sizes but shows no readings: they
are not known.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import msgspec

from schemas.events import Gpu
from schemas.messages import NodeRecord

CURRENT_STATES = frozenset({"active", "degraded", "unhealthy", "cordoned", "draining", "drained"})
"""States of a node that keeps beating: its last heartbeat's readings are current."""
HOLDING_STATES = frozenset({"starting", "ready", "stopping", "crashloop"})
"""Workload states in which a workload holds its GPUs."""


class GpuRow(msgspec.Struct, frozen=True, kw_only=True):
    """One GPU of the fleet, as ``-o json`` writes it (one object a line)."""

    node: str
    cluster: str
    state: str
    """The node's state: readings are null unless it is one that keeps beating."""
    index: int
    name: str
    uuid: str
    memory_total: int
    memory_used: int | None
    temperature_c: float | None
    power_w: float | None
    power_limit_w: float | None
    utilization_pct: float | None
    ecc_corrected: int | None
    ecc_uncorrected: int | None
    xids: dict[str, int]
    """XID code to count since the agent started."""
    lost: bool
    workloads: list[str]
    """Workloads holding this GPU (starting, ready, stopping or crash-looping)."""


def gpu_rows(records: Iterable[NodeRecord]) -> list[GpuRow]:
    """Each GPU of each record's last heartbeat, in node then index order."""
    rows = []
    for record in records:
        beat = record.heartbeat
        if beat is None or beat.sample is None:
            continue
        current = record.state in CURRENT_STATES
        holders: dict[int, list[str]] = {}
        for workload in beat.workloads:
            if workload.state in HOLDING_STATES:
                for index in workload.gpus:
                    holders.setdefault(index, []).append(workload.name)
        for gpu in beat.sample.gpus:
            rows.append(_row(record, gpu, current, holders.get(gpu.index, [])))
    return rows


def _row(record: NodeRecord, gpu: Gpu, current: bool, workloads: list[str]) -> GpuRow:
    def known(value: Any) -> Any:
        return value if current and not gpu.lost else None

    return GpuRow(
        node=record.node_id,
        cluster=record.cluster,
        state=record.state,
        index=gpu.index,
        name=gpu.name,
        uuid=gpu.uuid,
        memory_total=gpu.memory_total,
        memory_used=known(gpu.memory_used),
        temperature_c=known(gpu.temperature_c),
        power_w=known(gpu.power_w),
        power_limit_w=gpu.power_limit_w,
        utilization_pct=known(gpu.utilization_pct),
        ecc_corrected=gpu.ecc_corrected,
        ecc_uncorrected=gpu.ecc_uncorrected,
        xids={str(xid.code): xid.count for xid in gpu.xids},
        lost=gpu.lost,
        workloads=workloads if current else [],
    )


def _descending(value: float | None) -> tuple[bool, float]:
    """Largest first, unknown last."""
    return (value is None, -(value or 0.0))


SORTS: dict[str, Callable[[GpuRow], Any]] = {
    "node": lambda row: (row.node, row.index),
    "temp": lambda row: _descending(row.temperature_c),
    "power": lambda row: _descending(row.power_w),
    "util": lambda row: _descending(row.utilization_pct),
    "memory": lambda row: _descending(row.memory_used),
    "ecc": lambda row: (
        _descending(row.ecc_uncorrected),
        _descending(row.ecc_corrected),
    ),
    "xids": lambda row: _descending(sum(row.xids.values())),
}
"""``--sort`` keys: node order, or the largest reading first (unknown readings last);
ties keep node order."""
