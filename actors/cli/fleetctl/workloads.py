"""``fleetctl deploy | stop``: signed workload commands to one node (sent and followed like
``cordon``, by :mod:`actors.cli.fleetctl.send`), and ``fleetctl workloads``, which lists the
workloads every node's latest accepted heartbeat reported, each as it is now
(:mod:`actors.fleet.live.workload_status`: ``unknown`` on a node that does not report,
``orphaned`` on a forgotten one, ``replaced`` and ``moving`` during a move), its endpoint
only while it serves."""

from __future__ import annotations

import argparse
import re
import sys
import time

import msgspec

from actors.cli.common import add_server, connected, token
from actors.cli.fleetctl import placement, send
from actors.cli.node_names import node_selection
from actors.cli.parsing import duration
from actors.cli.render import tables
from actors.fleet.live import reader as live
from actors.fleet.live import workload_status
from actors.fleet.storage.placed import endpoint, read_placed
from actors.runtime import spans
from schemas.messages import Action, NodeRecord
from schemas.placement import PlacedWorkload
from schemas.subjects import Subjects
from schemas.workloads import Deploy, Stop

ENGINES = ["llamacpp", "vllm", "sglang", "process"]
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$")
COLUMNS = (
    "NODE",
    "NAME",
    "ENGINE",
    "STATE",
    "GPUS",
    "PORT",
    "RESTARTS",
    "REPLICA",
    "ENDPOINT*",
    "SINCE",
    "MODEL",
)


def gpu_list(text: str) -> list[int]:
    """An argparse type: ``0,1`` as GPU indices."""
    try:
        gpus = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a list of GPU indices like 0,1"
        ) from None
    if any(gpu < 0 or gpu >= 64 for gpu in gpus) or len(set(gpus)) != len(gpus):
        raise argparse.ArgumentTypeError(f"{text!r}: GPU indices are distinct, from 0 to 63")
    return gpus


def port_number(text: str) -> int:
    """An argparse type: a TCP port, 0 for one the node picks."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port (0-65535)")
    return port


def env_pair(text: str) -> tuple[str, str]:
    """An argparse type: ``K=V``."""
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=VALUE")
    return name, value


def deploy_action(args: argparse.Namespace) -> Action:
    # cmd_send waits for the deploy's ready timeout plus a minute unless --timeout says.
    args.deadline = args.ready_timeout
    return Deploy(
        name=args.name,
        engine=args.engine,
        gpus=args.gpus,
        model=args.model,
        port=args.port,
        args=list(args.arg),
        env=dict(args.env),
        ready_timeout=args.ready_timeout,
        max_pending=args.max_pending,
        share=args.share,
        image=args.image,
    )


def stop_action(args: argparse.Namespace) -> Action:
    return Stop(name=args.name)


def workload_name(text: str) -> str:
    """An argparse type: what a node accepts as a workload name (it names a log file)."""
    if not NAME.fullmatch(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a workload name (a letter or digit, then up to 62 of "
            "letters, digits, _ and -)"
        )
    return text


async def cmd_workloads(args: argparse.Namespace) -> int:
    subjects = Subjects(args.prefix)
    async with connected(args, "fleetctl") as bus:
        records: list[NodeRecord] = []
        if args.node:
            records.append(await live.read_node(bus, subjects, args.node))
        else:
            records.extend(await live.read_fleet(bus, subjects))
        placed = await read_placed(bus, subjects)
    if args.node:
        placed = [
            msgspec.structs.replace(w, replicas=[r for r in w.replicas if r.node == args.node])
            for w in placed
        ]
    sys.stdout.write(workloads_output(records, args.json, placed, args.why))
    return 0


ENDPOINT_NOTE = (
    "* ENDPOINT: where the node says the workload serves (its heartbeat's claim, not "
    "checked by the fleet); none unless it is ready\n"
)


def workloads_output(
    records: list[NodeRecord],
    as_json: bool,
    placed: list[PlacedWorkload] | None = None,
    why: bool = False,
) -> str:
    """The workloads of each node's last heartbeat, and the placed replicas no node
    reports yet (pending or deploying), as a table or one JSON list."""
    placed = placed or []
    now = time.time()
    rows = [
        (
            record,
            workload,
            placement.placement_of(placed, record.node_id, workload.name),
            workload_status.status(record, workload, placed, now),
        )
        for record in sorted(records, key=lambda r: r.node_id)
        if record.heartbeat is not None
        for workload in record.heartbeat.workloads
    ]
    waiting = placement.unplaced(placed, records)
    if as_json:
        items = [
            {
                "node": record.node_id,
                **msgspec.to_builtins(workload),
                "status": shown,
                "endpoint": endpoint(record, workload.port)
                if workload_status.serving(shown)
                else "",
                **({"replica": msgspec.to_builtins(replica)} if replica is not None else {}),
            }
            for record, workload, replica, shown in rows
        ]
        items += [
            {
                "node": replica.node,
                "name": name,
                "state": "deploying" if replica.node else "pending",
                "gpus": replica.gpus,
                "replica": msgspec.to_builtins(replica),
            }
            for name, replica in waiting
        ]
        return msgspec.json.encode(items).decode() + "\n"
    if not rows and not waiting:
        return "no workloads\n"
    table: list[tuple[str, ...]] = [COLUMNS]
    notes: list[str | None] = [None]
    for record, w, replica, shown in rows:
        table.append(
            (
                record.node_id,
                w.name,
                w.engine,
                shown,
                ",".join(str(g) for g in w.gpus) or "-",
                str(w.port),
                str(w.restarts),
                str(replica.index) if replica is not None else "-",
                endpoint(record, w.port) if workload_status.serving(shown) else "-",
                spans.age(now - w.since),
                w.model or "-",
            )
        )
        notes.append(replica.why if why and replica is not None else None)
    for name, replica in waiting:
        state = "deploying" if replica.node else "pending"
        gpus = ",".join(str(g) for g in replica.gpus) or "-"
        since = spans.age(now - replica.deployed_at) if replica.deployed_at else "-"
        node = replica.node or "-"
        table.append((node, name, "-", state, gpus, "-", "-", str(replica.index), "-", since, "-"))
        notes.append(replica.why if why or not replica.node else None)
    widths = [max(len(row[i]) for row in table) for i in range(len(COLUMNS))]
    lines = []
    for row, note in zip(table, notes, strict=True):
        cells = "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))
        lines.append(tables.printable(cells.rstrip()) + "\n")
        if note:
            lines.append(tables.printable(f"    why: {note}") + "\n")
    if any(row[8] != "-" for row in table[1:]):
        lines.append(ENDPOINT_NOTE)
    return "".join(lines)


def add_parsers(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add deploy, stop and workloads to fleetctl's subcommands."""
    deploy = commands.add_parser(
        "deploy",
        help="start an inference engine (or an allowed process) on a node's GPUs",
        description="Start a workload bound to 127.0.0.1 on the node, pinned to its GPUs "
        "with CUDA_VISIBLE_DEVICES. Without a node (and without -l, or with --replicas) the "
        "fleet places it: it chooses --replicas schedulable, healthy nodes with --gpus free "
        "GPUs (and -l labels, --cluster), records the workload in fleet_workloads and sends "
        "the deploys; aggregators run with --workloads-key-file keep it running "
        "(fleetctl workloads --why, fleetctl undeploy). " + send.EXIT_STATUSES,
    )
    deploy.add_argument(
        "node",
        nargs="?",
        type=node_selection,
        help="the node's id, or a list or range of them (node[1-4],gpu-a); or -l KEY=VALUE",
    )
    deploy.add_argument("name", type=workload_name, help="the workload's name on that node")
    deploy.add_argument(
        "--engine",
        choices=ENGINES,
        required=True,
        help="the engine it starts (its launch template; required)",
    )
    deploy.add_argument(
        "--gpus",
        type=gpu_list,
        default=[],
        help="GPU indices, e.g. 0,1 (default: none); without a node: how many GPUs each "
        "replica needs, e.g. 2",
    )
    deploy.add_argument("--model", default="", help="model path or name the engine serves")
    deploy.add_argument(
        "--port", type=port_number, default=0, help="127.0.0.1 port (default 0: the node picks one)"
    )
    deploy.add_argument(
        "--arg",
        action="append",
        default=[],
        help="repeatable: extra engine argument (write --arg=--flag for one that starts "
        "with -), or for --engine process the argv ({port}, {gpus}, {model} substituted)",
    )
    deploy.add_argument(
        "--env", action="append", type=env_pair, default=[], help="repeatable K=V for it"
    )
    deploy.add_argument(
        "--ready-timeout",
        type=duration,
        default=600.0,
        help="how long it may take to be ready (30s, 10m; default 10m)",
    )
    deploy.add_argument(
        "--max-pending", type=int, default=8, help="requests the gateway queues for it (default 8)"
    )
    deploy.add_argument(
        "--share", action="store_true", help="allow GPUs another workload already uses"
    )
    deploy.add_argument(
        "--image",
        default="",
        help="run it in this container image through podman (the node's workload_images "
        "must allow it): the engine's server inside it, or for --engine process the --arg "
        "argv (none: the image's own command)",
    )
    stop = commands.add_parser(
        "stop",
        help="stop a workload: SIGTERM its process group, SIGKILL after a grace period",
        description="Stop a workload on a node. " + send.EXIT_STATUSES,
    )
    stop.add_argument("node", type=token("node id"), help="the node's id")
    stop.add_argument("name", type=workload_name, help="the workload's name")
    for sub, build in ((deploy, deploy_action), (stop, stop_action)):
        sub.add_argument("--reason", default="", help="recorded with the command")
        sub.add_argument("--wait", action="store_true", help="follow the node's results live")
        sub.add_argument(
            "--timeout",
            type=send.POSITIVE,
            default=None,
            help="--wait limit (default: ready timeout + 60 s)",
        )
        send.add_signed_command_options(sub)
        sub.set_defaults(func=send.cmd_send, build_action=build)

    listing = commands.add_parser(
        "workloads",
        help="the workloads each node's last heartbeat reported, and the placed replicas",
        description="Every workload the nodes report (REPLICA: the replica of a workload the "
        "fleet placed), then the placed replicas no node reports yet (pending: no node "
        "fits; deploying: sent, not reported yet).",
    )
    listing.add_argument("node", nargs="?", type=token("node id"), help="only this node")
    listing.add_argument("--json", action="store_true", help="one JSON list")
    add_server(listing)
    listing.set_defaults(func=cmd_workloads)
