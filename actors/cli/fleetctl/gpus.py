"""``fleetctl gpus``: every GPU of the fleet (or of some nodes) as one table, like
nvidia-smi across nodes: readings, ECC, XIDs and the workload that holds each GPU.

The GPUs come from each node's latest accepted heartbeat, read live from FLEET_HB by
:func:`fleet_records` alone (docs/live-reads.md), not from a record's checkpoint.
A node whose heartbeats are not current (stale, offline, pending, deregistered, a state
this version does not know) keeps its GPUs' names and sizes but shows no readings:
they are not known.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterable
from typing import Any

import msgspec

from actors.cli.common import add_server, connected, token
from actors.cli.render import tables
from actors.fleet import labels as fleet_labels
from actors.fleet.live import reader as live
from actors.fleet.live.reader import LiveRecord
from actors.runtime.bus import Bus
from schemas.events import Gpu
from schemas.messages import NodeRecord
from schemas.subjects import Subjects

CURRENT_STATES = frozenset({"active", "degraded", "unhealthy", "cordoned", "draining", "drained"})
"""States of a node that keeps beating: its last heartbeat's readings are current."""
HOLDING_STATES = frozenset({"starting", "ready", "stopping", "crashloop"})
"""Workload states in which a workload holds its GPUs."""
COLUMNS = ("NODE", "GPU", "NAME", "MEMORY", "TEMP", "POWER", "UTIL", "ECC", "XIDS", "WORKLOAD")
GIB = 2**30


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


async def fleet_records(bus: Bus, subjects: Subjects) -> list[LiveRecord]:
    """Every node's record with its latest accepted heartbeat, read live (the live
    reader): the one place ``fleetctl gpus`` reads the fleet from."""
    return await live.read_fleet(bus, subjects)


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


def table(rows: list[GpuRow]) -> str:
    """The rows as aligned columns, a header first."""
    cells = [COLUMNS]
    for row in rows:
        used = "-" if row.memory_used is None else f"{row.memory_used / GIB:.1f}"
        limit = "" if row.power_limit_w is None else f"/{row.power_limit_w:.0f}"
        ecc = f"{_count(row.ecc_corrected)}/{_count(row.ecc_uncorrected)}"
        xids = ",".join(f"{code}x{count}" for code, count in row.xids.items()) or "-"
        if row.state not in CURRENT_STATES:
            holder = f"(node {row.state})"
        else:
            holder = ",".join(row.workloads) or "-"
        cells.append(
            (
                row.node,
                str(row.index),
                row.name + (" LOST" if row.lost else ""),
                f"{used}/{row.memory_total / GIB:.1f} GiB",
                "-" if row.temperature_c is None else f"{row.temperature_c:.0f}C",
                "-" if row.power_w is None else f"{row.power_w:.0f}{limit}W",
                "-" if row.utilization_pct is None else f"{row.utilization_pct:.0f}%",
                ecc,
                xids,
                holder,
            )
        )
    return "\n".join(tables.grid(cells, indent="")) + "\n"


def _count(value: int | None) -> str:
    return "-" if value is None else str(value)


async def cmd_gpus(args: argparse.Namespace) -> int:
    selectors = fleet_labels.parse_selectors(args.label or [])
    async with connected(args, "fleetctl") as bus:
        records = await fleet_records(bus, Subjects(args.prefix))
    chosen = [
        record
        for record in records
        if (not args.cluster or record.cluster == args.cluster)
        and (not args.node or record.node_id in args.node)
        and fleet_labels.matches(record.labels, selectors)
        and record.state != "deregistered"
    ]
    rows = sorted(gpu_rows(chosen), key=SORTS["node"])
    rows.sort(key=SORTS[args.sort])
    if args.output == "json":
        for row in rows:
            sys.stdout.write(msgspec.json.encode(row).decode() + "\n")
    elif rows:
        sys.stdout.write(table(rows))
    else:
        sys.stderr.write("no GPUs reported by the nodes chosen\n")
    return 0


def add_parsers(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    gpus = commands.add_parser(
        "gpus",
        help="every GPU of the fleet in one table, like nvidia-smi across nodes",
        description="Each GPU of each node's last heartbeat: memory used/total, temperature, "
        "power draw/limit, utilisation, ECC errors (corrected/uncorrected), XIDs (code x "
        "count) and the workloads holding it. A node that is not beating (stale, offline, "
        "pending) shows no readings: they are not known. Forgotten nodes are left out.",
    )
    gpus.add_argument("--cluster", type=token("cluster"), help="only nodes of this cluster")
    gpus.add_argument(
        "--node",
        action="append",
        type=token("node id"),
        help="only this node (repeatable: any of them)",
    )
    gpus.add_argument(
        "-l",
        "--label",
        action="append",
        help="only nodes with this label, KEY=VALUE (repeatable: all must match)",
    )
    gpus.add_argument(
        "--sort",
        choices=tuple(SORTS),
        default="node",
        help="node order (default), or the largest first: temp, power, util, memory "
        "(used), ecc (uncorrected, then corrected), xids (their count); unknown last",
    )
    gpus.add_argument(
        "-o",
        "--output",
        choices=("table", "json"),
        default="table",
        help="table (default) or json (one object per GPU, one a line)",
    )
    add_server(gpus)
    gpus.set_defaults(func=cmd_gpus)
