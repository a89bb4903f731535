"""``fleetctl events``: alerts and command results from the streams, oldest first: of one
node, of a list or range of nodes, or of the whole fleet, filtered by kind, severity,
cluster, labels and time."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from typing import get_args

from actors.cli.common import add_server, connected, token
from actors.cli.fleetctl.views import node_record
from actors.cli.node_names import did_you_mean, expand_nodes, node_selection
from actors.cli.parsing import duration
from actors.cli.render import tables
from actors.fleet import labels as fleet_labels
from actors.fleet.live import reader as live
from actors.fleet.views import history
from actors.runtime.bus import Bus
from schemas.errors import FleetError
from schemas.messages import Alert, AlertKind, CommandResult, Severity
from schemas.subjects import STREAM_ALERTS, STREAM_EVENTS, Subjects

RESULT_KIND = "result"
"""The kind ``--kind`` and the output give command results (alerts have their own)."""
KINDS = (*get_args(AlertKind), RESULT_KIND)
DEFAULT_LIMIT = 1000
"""Entries of each stream a fleet-wide query keeps (the newest)."""


def wanted(entry: history.Entry, args: argparse.Namespace, nodes: set[str] | None) -> bool:
    """Whether ``entry`` passes ``--kind``, ``--severity`` and the node set (None: any)."""
    severity, node, kind, _ = tables.event_fields(entry)
    return (
        (not args.kind or kind in args.kind)
        and (not args.severity or severity in args.severity)
        and (nodes is None or node in nodes)
    )


def subjects_read(args: argparse.Namespace, subjects: Subjects) -> tuple[str | None, str | None]:
    """(alert subject, result subject) to read, narrowed by ``--kind`` and ``--cluster``
    as far as a subject can say; None where ``--kind`` leaves nothing of that stream."""
    cluster = args.cluster or "*"
    kinds = set(args.kind or ())
    alert_kinds = kinds - {RESULT_KIND}
    alert_kind = next(iter(alert_kinds)) if len(alert_kinds) == 1 else "*"
    alerts = f"{subjects.prefix}.alert.{alert_kind}.{cluster}.*"
    results = f"{subjects.prefix}.result.{cluster}.*"
    return (
        alerts if not kinds or alert_kinds else None,
        results if not kinds or RESULT_KIND in kinds else None,
    )


async def fleet_history(
    bus: Bus, subjects: Subjects, args: argparse.Namespace, since: float | None
) -> list[history.Entry]:
    """Alerts and results of the whole fleet (as narrowed by :func:`subjects_read`), each
    stream's newest ``--limit``, oldest first."""
    alerts, results = subjects_read(args, subjects)
    reads = []
    if alerts is not None:
        stream = subjects.stream_name(STREAM_ALERTS)
        reads.append(history.read(bus, stream, alerts, Alert, since, args.limit))
    if results is not None:
        stream = subjects.stream_name(STREAM_EVENTS)
        reads.append(history.read(bus, stream, results, CommandResult, since, args.limit))
    return history.merged(*await asyncio.gather(*reads))


async def chosen_nodes(bus: Bus, subjects: Subjects, args: argparse.Namespace) -> set[str] | None:
    """The nodes ``NODE`` (a list or range) and ``-l`` name, None when neither is given;
    a listed node the fleet has no record of is an error naming the closest known."""
    if not args.node and not args.label:
        return None
    records = await live.stored_records(bus, subjects)
    known = {record.node_id for record in records}
    listed = expand_nodes(args.node) if args.node else sorted(known)
    unknown = [node for node in listed if node not in known]
    if unknown and len(listed) > 1:
        raise FleetError(f"no such node: {', '.join(unknown)}{did_you_mean(unknown[0], known)}")
    selectors = fleet_labels.parse_selectors(args.label or [])
    labelled = {r.node_id for r in records if fleet_labels.matches(r.labels, selectors)}
    return {node for node in listed if not args.label or node in labelled}


async def cmd_events(args: argparse.Namespace) -> int:
    """Alerts and command results, oldest first. One node is read by its subjects; a list,
    a range, ``-l`` or nothing reads the fleet's streams and filters. One unknown node
    with no history is an error (exit 1), with a did-you-mean."""
    subjects = Subjects(args.prefix)
    since = None if args.since is None else time.time() - args.since
    listed = expand_nodes(args.node) if args.node else []
    nodes: set[str] | None = None
    async with connected(args, "fleetctl") as bus:
        if len(listed) == 1 and not args.label:
            alerts, results = await history.node_history(bus, subjects, listed[0], since)
            entries = history.merged(alerts, results)
            if not entries:
                # Nothing to show: an unknown node (a typo) is an error, a known one is quiet.
                await node_record(bus, subjects, listed[0])
        else:
            nodes = await chosen_nodes(bus, subjects, args)
            entries = await fleet_history(bus, subjects, args, since)
    for entry in entries:
        if wanted(entry, args, nodes) and (not args.cluster or in_cluster(entry, args.cluster)):
            line = tables.event_json(entry) if args.json else tables.event_line(entry)
            sys.stdout.write(line + "\n")
    return 0


def in_cluster(entry: history.Entry, cluster: str) -> bool:
    """Whether the entry is of ``cluster`` (alerts and results carry it in their subject)."""
    parts = entry.subject.split(".")
    return len(parts) >= 3 and parts[-2] == cluster


def limit(text: str) -> int:
    """An argparse type: entries kept, 1 to 100,000."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not 1 <= value <= 100_000:
        raise argparse.ArgumentTypeError(f"{text}: must be 1 to 100000")
    return value


def add_parsers(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``events``."""
    events = commands.add_parser(
        "events",
        help="alerts and command results from the streams, oldest first: of a node, of "
        "nodes, or of the whole fleet",
    )
    events.add_argument(
        "node",
        nargs="?",
        type=node_selection,
        help="a node's id, or a list or range (node[1-4],gpu-a); default: the whole fleet",
    )
    events.add_argument(
        "--kind",
        action="append",
        choices=KINDS,
        metavar="KIND",
        help=f"only this kind (repeatable: any of them): an alert's kind, or {RESULT_KIND} "
        "for command results",
    )
    events.add_argument(
        "--severity",
        action="append",
        choices=get_args(Severity),
        help="only this severity (repeatable: any of them); a failed or rejected command "
        "result is a warning, others info",
    )
    events.add_argument("--cluster", type=token("cluster"), help="only this cluster")
    events.add_argument(
        "-l",
        "--label",
        action="append",
        metavar="KEY=VALUE",
        help="only nodes with this label (repeatable: all must match)",
    )
    events.add_argument("--since", type=duration, help="only this recent window (30s, 10m, 1h)")
    events.add_argument(
        "--limit",
        type=limit,
        default=DEFAULT_LIMIT,
        help="without a single node: the newest this many of each stream "
        f"(default {DEFAULT_LIMIT})",
    )
    events.add_argument("--json", action="store_true", help="one JSON object per line")
    add_server(events)
    events.set_defaults(func=cmd_events)
