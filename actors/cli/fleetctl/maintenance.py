"""``fleetctl maintenance start|end|list``: operator-signed maintenance windows (what a
window does: :mod:`actors.fleet.storage.windows`)."""

from __future__ import annotations

import argparse
import json
import secrets
import sys
import time

import msgspec
import nats.errors

from actors.cli.common import add_server, connected, default_operator_key, token
from actors.cli.fleetctl.signer import add_request_signing, check_signer
from actors.cli.parsing import duration, fail
from actors.cli.render import tables
from actors.fleet import labels as fleet_labels
from actors.fleet.storage.windows import MAX_WINDOW, read_windows
from actors.runtime.bus import NotProvisioned
from actors.runtime.spans import clock
from schemas import codec, signing
from schemas.errors import FleetError
from schemas.messages import Maintenance, MaintenanceReply, MaintenanceWindow
from schemas.subjects import Subjects


def window_length(text: str) -> float:
    """An argparse type: a window's length, above 0 and at most 30 days."""
    seconds = duration(text)
    if not 0 < seconds <= MAX_WINDOW:
        raise argparse.ArgumentTypeError(f"{text!r}: must be above 0 and at most 30 days")
    return seconds


async def _ask(args: argparse.Namespace, request: Maintenance) -> MaintenanceReply:
    key = signing.load_key_file(args.key_file or default_operator_key())
    body = codec.encode(request)
    async with connected(args, "fleetctl") as bus:
        await check_signer(bus, Subjects(args.prefix), key, args)
        try:
            msg = await bus.request(
                Subjects(args.prefix).maintenance(), body, args.timeout, key.headers(body)
            )
        except nats.errors.TimeoutError:
            raise FleetError(f"no aggregator answered within {args.timeout:g}s") from None
        except nats.errors.NoRespondersError:
            raise FleetError("no aggregator is running to take the request") from None
    return codec.decode(msg.data, MaintenanceReply, msg.subject)


async def cmd_start(args: argparse.Namespace) -> int:
    selector = dict(fleet_labels.parse_selectors(args.label or []))
    if not selector and not args.node:
        return fail("name the nodes: -l KEY=VALUE (repeatable) and/or --node NODE")
    now = time.time()
    request = Maintenance(
        action="start",
        id=args.id or secrets.token_hex(4),
        ts=now,
        selector=selector,
        cluster=args.cluster or "",
        nodes=args.node or [],
        until=now + args.duration,
        reason=args.reason,
        drain=args.drain,
    )
    reply = await _ask(args, request)
    if reply.status == "rejected":
        return fail(f"maintenance {request.id} refused: {reply.reason}")
    moves = "; placed replicas move off its nodes" if request.drain else ""
    sys.stdout.write(
        f"maintenance {reply.id} started: until {clock(request.until)} "
        f"({describe_scope(request.selector, request.cluster, request.nodes)}){moves}\n"
    )
    return 0


async def cmd_end(args: argparse.Namespace) -> int:
    reply = await _ask(args, Maintenance(action="end", id=args.id, ts=time.time()))
    if reply.status == "rejected":
        return fail(f"maintenance {args.id}: {reply.reason}")
    sys.stdout.write(f"maintenance {reply.id} ended\n")
    return 0


def describe_scope(selector: dict[str, str], cluster: str, nodes: list[str]) -> str:
    parts = (
        [",".join(f"{key}={value}" for key, value in sorted(selector.items()))] if selector else []
    )
    if cluster:
        parts.append(f"cluster {cluster}")
    if nodes:
        shown = ", ".join(nodes[:5]) + (f" and {len(nodes) - 5} more" if len(nodes) > 5 else "")
        parts.append(f"nodes {shown}")
    return "; ".join(parts)


def _row(window: MaintenanceWindow, now: float) -> tuple[str, ...]:
    status = "in force" if window.since <= now < window.until else "ended"
    return (
        window.id,
        describe_scope(window.selector, window.cluster, window.nodes),
        clock(window.until),
        status,
        signing.fingerprint(window.by) if window.by else "-",
        tables.printable(window.reason) or "-",
    )


async def cmd_list(args: argparse.Namespace) -> int:
    async with connected(args, "fleetctl") as bus:
        try:
            windows = await read_windows(bus, Subjects(args.prefix))
        except NotProvisioned:
            raise FleetError(
                "no maintenance bucket: start an aggregator (of this version) on this prefix first"
            ) from None
    now = time.time()
    if not args.all:
        windows = [window for window in windows if window.until > now]
    windows.sort(key=lambda window: window.since)
    if args.json:
        sys.stdout.write(json.dumps(msgspec.to_builtins(windows)) + "\n")
        return 0
    if not windows:
        sys.stdout.write("no maintenance windows in force\n")
        return 0
    rows = [("ID", "NODES", "UNTIL", "STATUS", "BY", "REASON"), *(_row(w, now) for w in windows)]
    sys.stdout.write("\n".join(tables.grid(rows, indent="")) + "\n")
    return 0


def add_parsers(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``maintenance`` and its three subcommands."""
    parser = commands.add_parser(
        "maintenance",
        help="maintenance windows: nodes whose alerts are recorded but not forwarded",
        description="A window covers the nodes matching every -l selector (in --cluster when "
        "given) and the nodes named with --node. While it is in force, their alerts stay in "
        "FLEET_ALERTS but are not sent to Alertmanager, fleetctl shows them as in "
        "maintenance and placement chooses none of them (--drain moves the placed replicas "
        "already there). Requests are signed by the operator key and carried out by an "
        "aggregator that trusts it (its trust_operators).",
    )
    subs = parser.add_subparsers(dest="maintenance_command", required=True)
    start = subs.add_parser("start", help="start a window; prints its id")
    start.add_argument(
        "-l",
        "--label",
        action="append",
        help="cover nodes with this label, KEY=VALUE (repeatable: all must match)",
    )
    start.add_argument(
        "--cluster", type=token("cluster"), help="only nodes of this cluster (with -l)"
    )
    start.add_argument(
        "--node", action="append", type=token("node id"), help="cover this node (repeatable)"
    )
    start.add_argument(
        "--for",
        dest="duration",
        type=window_length,
        required=True,
        help="how long, e.g. 90m, 2h, 1d (at most 30 days); the window then ends by itself",
    )
    start.add_argument("--reason", default="", help="why, shown by 'maintenance list'")
    start.add_argument(
        "--drain",
        action="store_true",
        help="also move the placed replicas (fleetctl deploy without a node) off the nodes "
        "it covers, as a drain does: each is placed elsewhere and its copy stopped once the "
        "new one is ready (placement never chooses a node in maintenance either way)",
    )
    start.add_argument(
        "--id", type=token("window id"), help="the window's id (default: a random one)"
    )
    add_request_signing(start)
    start.set_defaults(func=cmd_start)
    end = subs.add_parser("end", help="end a window now")
    end.add_argument("id", type=token("window id"), help="the window's id (maintenance list)")
    add_request_signing(end)
    end.set_defaults(func=cmd_end)
    listing = subs.add_parser("list", help="the windows in force")
    listing.add_argument("--all", action="store_true", help="ended windows too")
    listing.add_argument("--json", action="store_true", help="the windows as JSON")
    add_server(listing)
    listing.set_defaults(func=cmd_list)
