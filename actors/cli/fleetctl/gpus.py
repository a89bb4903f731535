"""``fleetctl gpus``: every GPU of the fleet (or of some nodes) as one table, like
nvidia-smi across nodes: readings, ECC, XIDs and the workload that holds each GPU (the
rows: :mod:`actors.fleet.views.gpus`, which the dashboard's GPU page lists too).

The GPUs come from each node's latest accepted heartbeat, read live from FLEET_HB by
:func:`fleet_records` alone (docs/live-reads.md), not from a record's checkpoint.
"""

from __future__ import annotations

import argparse
import sys

import msgspec

from actors.cli.common import add_server, connected, token
from actors.cli.render import tables
from actors.fleet import labels as fleet_labels
from actors.fleet.live import reader as live
from actors.fleet.views.gpus import CURRENT_STATES, SORTS, GpuRow, gpu_rows
from actors.runtime.bus import Bus
from schemas.messages import NodeRecord
from schemas.subjects import Subjects

COLUMNS = ("NODE", "GPU", "NAME", "MEMORY", "TEMP", "POWER", "UTIL", "ECC", "XIDS", "WORKLOAD")
GIB = 2**30


async def fleet_records(bus: Bus, subjects: Subjects) -> list[NodeRecord]:
    """Every node's record with its last accepted heartbeat: the one place ``fleetctl
    gpus`` reads the fleet from."""
    return list(await live.read_fleet(bus, subjects))


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
