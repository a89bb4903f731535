"""``fleetctl deploy | stop``: signed workload commands to one node (sent and followed like
``cordon``, by :mod:`actors.cli.send`), and ``fleetctl workloads``, which lists the
workloads every node's last heartbeat reported."""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import Callable

import msgspec

from actors.cli import send, views
from actors.cli.common import add_server, connected, token
from actors.fleet import registry
from schemas.messages import Action, NodeRecord
from schemas.subjects import Subjects
from schemas.workloads import Deploy, Stop

ENGINES = ["llamacpp", "vllm", "sglang", "process"]
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$")
COLUMNS = ("NODE", "NAME", "ENGINE", "STATE", "GPUS", "PORT", "RESTARTS", "SINCE", "MODEL")


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
        if args.node:
            records = [await registry.read_record(bus, subjects, args.node)]
        else:
            records = await registry.read_records(bus, subjects)
    sys.stdout.write(workloads_output(records, args.json))
    return 0


def workloads_output(records: list[NodeRecord], as_json: bool) -> str:
    """The workloads of each node's last heartbeat, as a table or one JSON list."""
    rows = [
        (record.node_id, workload)
        for record in sorted(records, key=lambda r: r.node_id)
        if record.heartbeat is not None
        for workload in record.heartbeat.workloads
    ]
    if as_json:
        items = [{"node": node, **msgspec.to_builtins(workload)} for node, workload in rows]
        return msgspec.json.encode(items).decode() + "\n"
    if not rows:
        return "no workloads\n"
    now = time.time()
    table = [COLUMNS] + [
        (
            node,
            w.name,
            w.engine,
            w.state + (f" ({w.reason})" if w.reason and w.state != "ready" else ""),
            ",".join(str(g) for g in w.gpus) or "-",
            str(w.port),
            str(w.restarts),
            views.age(now - w.since),
            w.model or "-",
        )
        for node, w in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(COLUMNS))]
    return "".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        + "\n"
        for row in table
    )


def add_workload_parsers(
    commands: argparse._SubParsersAction[argparse.ArgumentParser],
    duration: Callable[[str], float],
) -> None:
    """Add deploy, stop and workloads to fleetctl's subcommands."""
    deploy = commands.add_parser(
        "deploy",
        help="start an inference engine (or an allowed process) on a node's GPUs",
        description="Start a workload bound to 127.0.0.1 on the node, pinned to its GPUs "
        "with CUDA_VISIBLE_DEVICES. " + send.EXIT_STATUSES,
    )
    deploy.add_argument(
        "node", nargs="?", type=token("node id"), help="the node's id (or -l KEY=VALUE)"
    )
    deploy.add_argument("name", type=workload_name, help="the workload's name on that node")
    deploy.add_argument("--engine", choices=ENGINES, required=True, help="launch template")
    deploy.add_argument(
        "--gpus", type=gpu_list, default=[], help="GPU indices, e.g. 0,1 (default: none)"
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
        "--max-pending", type=int, default=8, help="requests the gateway queues for it (8)"
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
        "workloads", help="the workloads each node's last heartbeat reported"
    )
    listing.add_argument("node", nargs="?", type=token("node id"), help="only this node")
    listing.add_argument("--json", action="store_true", help="one JSON list")
    add_server(listing)
    listing.set_defaults(func=cmd_workloads)
