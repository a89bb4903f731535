"""``fleetctl nodes``, ``aggregators``, ``node``, ``watch`` and ``describe`` (``events``:
:mod:`actors.cli.fleetctl.events`): the fleet read from the provider side (records,
heartbeat partitions, alerts, node events and history), each printed for operators or as
JSON."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from typing import get_args

import msgspec
import nats.errors
from nats.aio.msg import Msg

from actors.cli.common import add_server, connected, stop_event, token
from actors.cli.fleetctl import indexed, policy
from actors.cli.fleetctl.storms import GROUP_WINDOW, AlertGroups
from actors.cli.node_names import did_you_mean, expand_nodes, node_selection
from actors.cli.parsing import closest_hint, duration
from actors.cli.render import columns, describe, tables
from actors.cli.render import settings as render_settings
from actors.fleet import labels as fleet_labels
from actors.fleet.live import reader as live
from actors.fleet.storage import leases, policy_holds, registry
from actors.fleet.storage import settings as settings_store
from actors.fleet.views import history
from actors.runtime import heap
from actors.runtime.bus import Bus, Handler
from actors.runtime.signature_helpers import default_helpers
from actors.runtime.subscriptions import listening
from schemas import codec, signing
from schemas.base import RecordState
from schemas.errors import DecodeError, FleetError, SignatureError
from schemas.messages import Alert, NodeRecord
from schemas.remediation import PolicyRecord
from schemas.subjects import Subjects

WATCH_INTERVAL = 2.0
"""Seconds between two reads of ``fleetctl nodes --watch``."""
JSON_CHUNK = 256
"""Records of a JSON listing encoded and written at once (about 1.4 MB at 8 GPUs a node)."""


def summarised(records: list[NodeRecord], output: str, rows: bool) -> bool:
    """Whether ``fleetctl nodes`` prints the summary by cluster and state (no heartbeat
    parts, so nothing to read live)."""
    return output in ("table", "wide") and not rows and len(records) > tables.SUMMARY_ABOVE


def write_nodes(
    records: list[NodeRecord],
    output: str,
    colour: bool,
    rows: bool,
    of: int | None = None,
    pending: bool = False,
    extra: list[columns.Column] | None = None,
) -> None:
    """A fleet above a screenful is summarised by cluster and state unless ``rows``; JSON
    is written JSON_CHUNK records at a time as encoded (the same bytes as one array) to
    stdout's byte stream, so a 100,000-node listing is never one string in memory, nor
    decoded to text and encoded again, nor written in 100,000 small writes. ``of``: how
    many there were before filters; ``pending``: only pending nodes were asked for, shown
    with what their registrations said of their machines."""
    if output == "json":
        sys.stdout.flush()  # what was written as text goes first
        out = sys.stdout.buffer
        out.write(b"[")
        for start in range(0, len(records), JSON_CHUNK):
            chunk = records[start : start + JSON_CHUNK]
            if start:
                out.write(b",")
            out.write(b",".join(map(codec.encode, chunk)))
        out.write(b"]\n")
        out.flush()
    elif summarised(records, output, rows):
        sys.stdout.write(tables.fleet_summary(records))
    elif pending and output in ("table", "wide"):
        sys.stdout.write(tables.pending_table(records))
    else:
        sys.stdout.write(tables.nodes_output(records, output, colour, of, extra or []))


def sorts_live(sort_by: str) -> bool:
    """Whether ``--sort-by sort_by`` orders by a part of a record the live read sets
    (:data:`live.SHOWN_LIVE`)."""
    return columns.path_of(sort_by)[0] in live.SHOWN_LIVE


def by_rows(records: list[NodeRecord], output: str, rows: bool, states: set[str]) -> bool:
    """Whether ``--watch`` prints changed rows (:func:`tables.watch_table`): a table or
    wide table of rows; JSON, YAML, custom columns, a summary or the pending listing is
    printed again whole on a change."""
    plain = output in ("table", "wide") and states != {"pending"}
    return plain and not summarised(records, output, rows)


async def cmd_nodes(args: argparse.Namespace) -> int:
    """The fleet as a table (``-o wide`` adds SEQ and REASON) or JSON; with ``--watch``,
    read again every WATCH_INTERVAL until Ctrl-C (exit 0): a table is printed with a TIME
    column, then only the rows whose node's state, schedulability, health, GPUs or version
    changed (:func:`by_rows`); other outputs again whole on such a change. Deregistered
    nodes are hidden and a fleet above a screenful is summarised, unless ``--all``
    (everything, as rows). The summary, and a listing of nodes in states other than
    active, come from the state index when it can answer (:mod:`.indexed`)."""
    output = "json" if args.json else args.output
    colour = sys.stdout.isatty() and not os.environ.get("NO_COLOR")
    subjects = Subjects(args.prefix)
    selectors = fleet_labels.parse_selectors(args.label or [])
    extra = columns.label_columns(columns.label_keys(args.label_columns or []), args.show_labels)
    if output.startswith(columns.CUSTOM_PREFIX):
        columns.custom_columns(output)  # a wrong spec is refused before any read
    if args.sort_by:
        columns.path_of(args.sort_by)
    async with connected(args, "fleetctl") as bus:
        stop = stop_event() if args.watch else None
        shown: list[tuple[object, ...]] | None = None
        rows_shown: dict[str, tuple[object, ...]] | None = None
        states = set(args.state or ())
        found = None
        if indexed.usable(args, output, states):
            rows = args.all or args.limit is not None
            found = await indexed.from_index(
                bus, subjects, args.cluster, states, rows or output == "json", args.limit
            )
        if found is not None:
            if found.records is None:
                sys.stdout.write(found.summary)
            else:
                listed: list[NodeRecord] = list(found.records)
                pending = states == {"pending"}
                write_nodes(listed, output, colour, rows, found.total, pending, extra)
            return 0

        async def show_once() -> None:
            """One read of the fleet, printed (as a whole, or the rows changed)."""
            nonlocal shown, rows_shown
            # Read shelved: a record's own heartbeat is decoded only if it is the one
            # shown, so nothing below reads a heartbeat before the overlay.
            shelved = await live.stored_records_shelved(bus, subjects)
            every = [
                r
                for r in shelved.records
                if args.all or "deregistered" in states or r.state != "deregistered"
            ]
            records = [
                r
                for r in every
                if (not args.cluster or r.cluster == args.cluster)
                and (not states or r.state in states)
                and fleet_labels.matches(r.labels, selectors)
            ]
            rows = args.all or args.limit is not None
            if not summarised(records, output, rows):
                # Heartbeat parts as of each node's latest accepted heartbeat, sorted by
                # what is shown: by a part the live read sets (a checkpoint's seq, health
                # or last-seen may be a minute old) after it, every node matching read
                # live first; by any other before it, only the nodes kept read live.
                after = bool(args.sort_by) and sorts_live(args.sort_by)
                if args.sort_by and not after:
                    records = columns.sort_records(records, args.sort_by)
                ahead = records if after else records[: args.limit]
                records = list(
                    await live.overlay(
                        bus, subjects, ahead, shelf=shelved.heartbeats, helpers=default_helpers()
                    )
                )
                if after:
                    records = columns.sort_records(records, args.sort_by)[: args.limit]
            if stop is not None and by_rows(records, output, rows, states):
                text = tables.watch_table(
                    records, rows_shown, time.time(), output == "wide", colour, extra
                )
                rows_shown = {record.node_id: tables.change_key(record) for record in records}
                sys.stdout.write(text)
                sys.stdout.flush()
            elif (key := [tables.change_key(r) for r in records]) != shown:
                if shown is not None:
                    sys.stdout.write("\n")
                shown = key
                write_nodes(
                    records,
                    output,
                    colour,
                    rows,
                    of=len(every),
                    pending=states == {"pending"},
                    extra=extra,
                )
                sys.stdout.flush()

        while True:
            # The collector is paused through a round, and the round's fleet let go of
            # (show_once's own) before it resumes: a collection after the pause walked
            # every record and heartbeat still held (100,000 nodes of 8 GPUs: about 1.5 s
            # of the listing).
            with heap.collector_paused():
                await show_once()
            if stop is None:
                return 0
            try:
                async with asyncio.timeout(WATCH_INTERVAL):
                    await stop.wait()
                return 0
            except TimeoutError:
                continue


def partition_rates(
    first: list[leases.PartitionStatus], second: list[leases.PartitionStatus], seconds: float
) -> list[float]:
    """Heartbeats a second into each partition between two reads ``seconds`` apart: those
    delivered to its consumer plus the change in those waiting for it."""
    before = {status.partition: status for status in first}
    rates = []
    for status in second:
        old = before.get(status.partition, status)
        arrived = status.delivered - old.delivered + status.pending - old.pending
        rates.append(max(0.0, arrived / seconds))
    return rates


async def cmd_aggregators(args: argparse.Namespace) -> int:
    """Every partition of FLEET_HB: who consumes it (its lease), its heartbeat rate over
    about a second, and how far behind it is (pending and unacknowledged heartbeats)."""
    subjects = Subjects(args.prefix)
    async with connected(args, "fleetctl") as bus:
        first = await leases.partition_status(bus, subjects, args.durable)
        started = time.monotonic()
        await asyncio.sleep(1.0)
        statuses = await leases.partition_status(bus, subjects, args.durable)
        rates = partition_rates(first, statuses, time.monotonic() - started)
    if args.json:
        for status, rate in zip(statuses, rates, strict=True):
            body = msgspec.to_builtins(status) | {"rate": round(rate, 1)}
            sys.stdout.write(msgspec.json.encode(body).decode() + "\n")
        return 0
    rows = [("PARTITION", "HOLDER", "RENEWED", "RATE", "PENDING", "UNACKED")]
    by_holder: dict[str, tuple[int, float, int]] = {}
    for status, rate in zip(statuses, rates, strict=True):
        holder = status.holder or "(nobody)"
        renewed = f"{status.renewed_ago:.1f}s ago" if status.holder else "-"
        rows.append(
            (
                status.partition,
                holder,
                renewed,
                f"{rate:.1f}/s",
                str(status.pending),
                str(status.unacked),
            )
        )
        held, total, pending = by_holder.get(holder, (0, 0.0, 0))
        by_holder[holder] = (held + 1, total + rate, pending + status.pending)
    # Then one line per aggregator: how many partitions it holds, its rate and backlog.
    totals = [("AGGREGATOR", "PARTITIONS", "RATE", "PENDING")]
    totals += [(h, str(n), f"{r:.1f}/s", str(p)) for h, (n, r, p) in sorted(by_holder.items())]
    lines = [*tables.grid(rows, indent=""), "", *tables.grid(totals, indent="")]
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


async def cmd_node(args: argparse.Namespace) -> int:
    async with connected(args, "fleetctl") as bus:
        record = await node_record(bus, Subjects(args.prefix), args.node)
    if args.json:
        sys.stdout.write(msgspec.json.encode(record).decode() + "\n")
    else:
        sys.stdout.write(msgspec.json.format(msgspec.json.encode(record), indent=2).decode() + "\n")
    return 0


class EventSigners:
    """Says how each node event watched was signed, checking the signer against the node's
    approved key in ``fleet_trust`` (cached; read again when a signer does not match)."""

    def __init__(self, bus: Bus, subjects: Subjects) -> None:
        self.bus = bus
        self.subjects = subjects
        self.approved: dict[str, str | None] = {}

    async def verdict(self, msg: Msg) -> str:
        """``node-claim`` (signed with the node's approved key: what the node says, which a
        stolen node key can say too), ``signed-by=<key>`` (another valid key, e.g. an
        operator's inject), ``unsigned`` or ``bad-signature``."""
        headers = msg.headers or {}
        if signing.HEADER_KEY not in headers or signing.HEADER_SIG not in headers:
            return "unsigned"
        try:
            signer = signing.verify(headers, msg.data)
        except SignatureError:
            return "bad-signature"
        node = msg.subject.split(".")[-2]
        if self.approved.get(node) != signer:
            self.approved[node] = await self._read_approved(node)
        return "node-claim" if self.approved[node] == signer else f"signed-by={signer}"

    async def _read_approved(self, node: str) -> str | None:
        try:
            return registry.approved_key(await registry.trust_entry(self.bus, self.subjects, node))
        except (FleetError, nats.errors.Error):
            return None


async def cmd_watch(args: argparse.Namespace) -> int:
    """Print alerts (and with --events, node events) as they arrive, one line each. An
    alert is time, severity, node, kind and message (``--json``: the stored JSON); alerts
    of one kind, severity and cluster within ``--group-window`` are one line with a count
    (:mod:`actors.cli.fleetctl.storms`) unless ``--json`` or ``--no-group``; with
    ``--since`` the alerts stored in that window come first, from FLEET_ALERTS. A node
    event is its subject, who signed it (:meth:`EventSigners.verdict`), then its JSON
    body. Anything that could drive the terminal is escaped."""
    subjects = Subjects(args.prefix)
    want_alerts = args.alerts or not args.events

    async with connected(args, "fleetctl") as bus:
        signers = EventSigners(bus, subjects)

        def write(line: str) -> None:
            sys.stdout.write(line + "\n")
            sys.stdout.flush()

        groups = None if args.json or args.no_group else AlertGroups(args.group_window, write)

        async def show_alert(entry: history.Entry) -> None:
            if args.node and tables.event_fields(entry)[1] != args.node:
                return
            if groups is not None:
                groups.add(entry)
            else:
                write(tables.event_json(entry) if args.json else tables.event_line(entry))

        async def alert_now(msg: Msg) -> None:
            await show_alert(history.live_entry(msg, Alert))

        async def show_event(msg: Msg) -> None:
            if args.node and msg.subject.split(".")[-2] != args.node:
                return
            verdict = await signers.verdict(msg)
            body = msg.data.decode(errors="replace")
            if args.json:
                line = json.dumps(
                    {"subject": msg.subject, "signature": verdict, "message": body},
                    ensure_ascii=True,
                )
            else:
                line = tables.printable(f"{msg.subject} {verdict} {body}")
            sys.stdout.write(line + "\n")
            sys.stdout.flush()

        routes: dict[str, Handler] = {}
        watched = (["alerts"] if want_alerts else []) + (["events"] if args.events else [])
        if args.events:
            routes[subjects.events(args.node or "*")] = show_event
        async with contextlib.AsyncExitStack() as stack:
            if want_alerts and args.since is not None:
                await stack.enter_async_context(
                    history.following_alerts(bus, subjects, time.time() - args.since, show_alert)
                )
            elif want_alerts:
                routes[subjects.alerts()] = alert_now
            await stack.enter_async_context(listening(bus, routes))
            stop = stop_event()
            # On stderr, so the lines on stdout stay alerts: what follows is live.
            sys.stderr.write(f"watching {' and '.join(watched)} live; Ctrl-C stops\n")
            sys.stderr.flush()
            try:
                await stop.wait()
            finally:
                if groups is not None:
                    groups.close()
    return 0


async def cmd_describe(args: argparse.Namespace) -> int:
    """The human view of a node (or of each node of a list or range, a blank line between):
    its record explained, then its recent history. A listed name the fleet has no record
    of is an error before anything is printed."""
    subjects = Subjects(args.prefix)
    names = expand_nodes(args.node)
    async with connected(args, "fleetctl") as bus:
        if len(names) > 1:
            known = {record.node_id for record in await live.stored_records(bus, subjects)}
            unknown = [name for name in names if name not in known]
            if unknown:
                hint = did_you_mean(unknown[0], known)
                raise FleetError(f"no such node: {', '.join(unknown)}{hint}")
        policies = await policy_holds.read_policies(bus, subjects)
        try:
            current = await settings_store.current(bus, subjects)
        except settings_store.NoSettingsBucket:
            current = []
        texts = [await described(bus, subjects, name, policies, current) for name in names]
    sys.stdout.write("\n\n".join(texts) + "\n")
    return 0


async def described(
    bus: Bus,
    subjects: Subjects,
    node: str,
    policies: list[PolicyRecord],
    current: list[settings_store.StoredEntry],
) -> str:
    """One node's ``describe`` text, read now."""
    record = await node_record(bus, subjects, node)
    alerts, results = await history.recent_history(bus, subjects, node, limit=describe.RECENT)
    try:
        enrolled = describe.identity_lines(await registry.trust_entry(bus, subjects, node), record)
    except DecodeError as exc:
        enrolled = [f"Identity:        unknown: {exc}"]
    settings = render_settings.settings_lines(record, current)
    now = time.time()
    remediation = policy.node_lines(policies, record.cluster, record.node_id, now)
    return describe.describe(
        record,
        alerts,
        results,
        now,
        remediation,
        enrolled,
        policy_holds.policy_keys(policies),
        settings,
    )


async def node_record(bus: Bus, subjects: Subjects, node: str) -> live.LiveRecord:
    """The node's record, read live; an unknown node is one line naming the known ones
    closest to it (did you mean ...?)."""
    try:
        return await live.read_node(bus, subjects, node)
    except registry.NotFound as exc:
        known = [record.node_id for record in await live.stored_records(bus, subjects)]
        raise FleetError(f"{exc}{did_you_mean(node, known)}") from None


def node_output(text: str) -> str:
    """An argparse type: one of tables.NODE_OUTPUTS or ``custom-columns=...``."""
    if text in tables.NODE_OUTPUTS or text.startswith(columns.CUSTOM_PREFIX):
        return text
    hint = closest_hint(text, list(tables.NODE_OUTPUTS))
    raise argparse.ArgumentTypeError(
        f"{text!r}: use {', '.join(tables.NODE_OUTPUTS)} or custom-columns=NAME:.path,...{hint}"
    )


def add_parsers(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``nodes``, ``aggregators``, ``node``, ``watch`` and ``describe``."""
    nodes = commands.add_parser("nodes", help="list the fleet")
    nodes.add_argument("--cluster", help="only nodes of this cluster")
    nodes.add_argument(
        "--state",
        action="append",
        choices=get_args(RecordState),
        help="only nodes in this state (repeatable: any of them); pending alone lists each "
        "registration's key and the machine it says it is (host, GPUs, cloud, instance type)",
    )
    nodes.add_argument(
        "-l",
        "--label",
        action="append",
        help="only nodes with this label, KEY=VALUE (repeatable: all must match)",
    )
    nodes.add_argument("--json", action="store_true", help="same as -o json")
    nodes.add_argument(
        "--limit", type=int, default=None, help="list at most this many nodes (as rows)"
    )
    nodes.add_argument(
        "--all",
        action="store_true",
        help="every node, in full: deregistered (forgotten) ones included, and as rows "
        f"even above {tables.SUMMARY_ABOVE} (else a summary)",
    )
    nodes.add_argument(
        "-o",
        "--output",
        type=node_output,
        default="table",
        help="table (default), wide (adds SEQ and REASON), json, yaml, or "
        "custom-columns=NAME:.path,... (JSON paths into each record, as -o json shows it: "
        "custom-columns=NODE:.node_id,HOST:.heartbeat.sample.hostname)",
    )
    nodes.add_argument(
        "--sort-by",
        metavar="FIELD",
        help=f"order by a column ({', '.join(columns.SORT_FIELDS)}) or a JSON path "
        "(.heartbeat.sample.hostname), ascending, by the values shown (each node's "
        "latest accepted heartbeat); nodes without it last",
    )
    nodes.add_argument(
        "-L",
        "--label-columns",
        action="append",
        metavar="KEY[,KEY]",
        help="a column for each of these labels (repeatable)",
    )
    nodes.add_argument(
        "--show-labels", action="store_true", help="a LABELS column with every label"
    )
    nodes.add_argument(
        "--watch",
        action="store_true",
        help=f"read again every {WATCH_INTERVAL:g}s and print, after a TIME column, only the "
        "rows that changed (state, schedulability, health, GPUs, version; a node gone: "
        "(gone)); -o json, yaml, custom-columns or a summary is printed again whole; "
        "Ctrl-C stops",
    )
    add_server(nodes)
    nodes.set_defaults(func=cmd_nodes)

    aggregators = commands.add_parser(
        "aggregators", help="every heartbeat partition: who consumes it, its rate and lag"
    )
    aggregators.add_argument(
        "--json", action="store_true", help="one JSON object per partition, one a line"
    )
    aggregators.add_argument(
        "--durable",
        default="aggregator",
        help="base name of the partition consumers, <durable>-<P> (default aggregator)",
    )
    add_server(aggregators)
    aggregators.set_defaults(func=cmd_aggregators)

    node = commands.add_parser("node", help="one node's full record")
    node.add_argument("node", type=token("node id"), help="the node's id")
    node.add_argument("--json", action="store_true", help="compact JSON on one line")
    add_server(node)
    node.set_defaults(func=cmd_node)

    watch = commands.add_parser("watch", help="follow alerts and events")
    watch.add_argument("--alerts", action="store_true", help="alerts (the default)")
    watch.add_argument(
        "--events",
        action="store_true",
        help="node events (core NATS, live), with who signed each (node-claim: the node's own key)",
    )
    watch.add_argument("--node", help="only this node")
    watch.add_argument(
        "--since", type=duration, help="replay the alerts of this window first (30s, 10m, 1h)"
    )
    watch.add_argument(
        "--json", action="store_true", help="one JSON object per line (each alert: no grouping)"
    )
    watch.add_argument(
        "--group-window",
        type=duration,
        default=GROUP_WINDOW,
        metavar="DURATION",
        help="alerts of one kind, severity and cluster raised within this of the first are "
        "one line with a count, printed when it ends "
        f"('80 nodes stale in cluster local (sim-001 ... sim-080)'; default {GROUP_WINDOW:g}s)",
    )
    watch.add_argument(
        "--no-group", action="store_true", help="print every alert on its own line, at once"
    )
    add_server(watch)
    watch.set_defaults(func=cmd_watch)

    describe_parser = commands.add_parser(
        "describe", help="one node explained: state, checks, GPUs, recent alerts and results"
    )
    describe_parser.add_argument(
        "node",
        type=node_selection,
        help="the node's id, or a list or range (node[1-4],gpu-a): each described in turn",
    )
    add_server(describe_parser)
    describe_parser.set_defaults(func=cmd_describe)
