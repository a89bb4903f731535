"""``fleetctl``: the operator's command line (up, aggregator, keys, approve, nodes, describe,
events, watch)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, get_args

import argcomplete
import msgspec
import nats.errors
from nats.aio.msg import Msg

from actors.cli import (
    completion,
    contexts,
    dashboard_cli,
    enroll_cli,
    gpus,
    maintenance_cli,
    placement_cli,
    policy_cli,
    rolling,
    send,
    views,
    workloads,
)
from actors.cli.common import (
    CLIENT_ENV_PREFIX,
    KEY_FILE_ENV,
    ClientConfig,
    add_config_flags,
    add_context_flag,
    add_server,
    add_version,
    connected,
    default_operator_key,
    duration,
    fail,
    operator_key,
    parse,
    run_main,
    settings_from,
    stop_event,
    strict,
    token,
)
from actors.cli.provider import ProviderActors
from actors.cli.simulate import SimOptions, simulate
from actors.cli.up import UpOptions, default_store, gpus_per_node, run_up
from actors.fleet import history, lease, live, nats_config, pending, registry
from actors.fleet import labels as fleet_labels
from actors.fleet.config import ENV_PREFIX as AGGREGATOR_ENV_PREFIX
from actors.fleet.config import AggregatorConfig
from actors.fleet.metrics import AggregatorMetrics
from actors.fleet.remediation.policy import load_policy
from actors.runtime import logs
from actors.runtime.bus import Bus, Handler, NatsBus, listening
from actors.runtime.config import build
from actors.runtime.tls import client_context
from schemas import codec, signing
from schemas.base import RecordState
from schemas.errors import FleetError, SignatureError
from schemas.messages import Alert, Forget, ForgetReply, NodeRecord
from schemas.subjects import Subjects, check_token

Command = Callable[[argparse.Namespace], Coroutine[Any, Any, int]]


async def cmd_up(args: argparse.Namespace) -> int:
    options = UpOptions(
        nodes=args.nodes,
        port=args.port,
        store=args.store or default_store(),
        heartbeat_interval=args.heartbeat_interval,
        stale_after=args.stale_after or 3 * args.heartbeat_interval,
        gpus_per_node=args.gpus_per_node,
    )
    return await run_up(options)


def aggregator_settings(args: argparse.Namespace) -> AggregatorConfig:
    """The aggregator's settings; FLEETCTL_SERVER gives the server when
    FLEET_AGGREGATOR_SERVER does not, as for every fleetctl command."""
    env = dict(os.environ)
    if "FLEETCTL_SERVER" in env:
        env.setdefault(f"{AGGREGATOR_ENV_PREFIX}SERVER", env["FLEETCTL_SERVER"])
    names = {field.name for field in msgspec.structs.fields(AggregatorConfig)}
    flags = {name: getattr(args, name) for name in names}
    return build(AggregatorConfig, AGGREGATOR_ENV_PREFIX, args.config, env, flags)


async def cmd_aggregator(args: argparse.Namespace) -> int:
    config = aggregator_settings(args)
    logs.setup(config.log_level, config.log_format)
    policy = load_policy(Path(config.policy_file)) if config.policy_file else None
    seed = signing.load_key_file(Path(config.nkey_file)).seed if config.nkey_file else None
    bus = await NatsBus.connect(
        config.server,
        "fleetctl-aggregator",
        nkey_seed=seed,
        connect_timeout=config.connect_timeout,
        retry_forever=True,
        tls=client_context(config.tls_ca, config.tls_cert, config.tls_key),
    )
    supervisor = ProviderActors(config, bus, AggregatorMetrics(), policy).supervisor
    supervisor.start()
    stop = stop_event()
    waits = [asyncio.create_task(stop.wait()), asyncio.create_task(supervisor.finished.wait())]
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for wait in waits:
        wait.cancel()
    await supervisor.stop()
    await bus.close()
    return fail(supervisor.fatal) if supervisor.fatal else 0


async def cmd_keys_init(args: argparse.Namespace) -> int:
    path = args.key_file or default_operator_key()
    pair = signing.create_key_file(path)
    sys.stdout.write(f"{pair.public_key}\n")
    sys.stderr.write(
        f"operator seed written to {path} (mode 0600); trust it on agents with\n"
        f"  node-agent start --trust-operator {pair.public_key}\n"
    )
    return 0


async def cmd_keys_show(args: argparse.Namespace) -> int:
    """The operator's public key on stdout (for scripts, and for agents'
    --trust-operator), its fingerprint on stderr, as 'node-agent key show' does; the key
    found as every signing command finds it (:func:`operator_key`)."""
    pair = operator_key(args)
    sys.stdout.write(f"{pair.public_key}\n")
    sys.stderr.write(f"fingerprint {signing.fingerprint(pair.public_key)}\n")
    return 0


async def cmd_approve(args: argparse.Namespace) -> int:
    """Approve the key given, or the one the node's pending registration carries, after
    showing its fingerprint and asking (unless --yes): that key came over the network.
    A name that several keys registered is approved only with the key named."""
    if args.public_key is not None:
        registry.check_public_key(args.public_key)
    async with connected(args, "fleetctl") as bus:
        subjects = Subjects(args.prefix)
        key = args.public_key
        if key is None:
            keys = await pending_keys(bus, subjects, args.node)
            for candidate in keys:
                sys.stderr.write(
                    f"{args.node} registered key {candidate}\n"
                    f"  fingerprint {signing.fingerprint(candidate)}\n"
                )
            if len(keys) > 1:
                return fail(
                    f"{len(keys)} keys registered {args.node}: compare each with 'node-agent "
                    f"key show' on the node and approve one by key (fleetctl approve "
                    f"{args.node} KEY); --yes does not choose"
                )
            key = keys[0]
            sys.stderr.write("  compare with 'node-agent key show' on the node\n")
            if not args.yes and not confirm(f"approve this key for {args.node}?"):
                return fail(f"{args.node} not approved")
        await registry.approve(bus, subjects, args.node, key, by="fleetctl")
        readmitted = await registry.readmit(bus, subjects, args.node)
    sys.stdout.write(f"approved {args.node}\n")
    if readmitted:
        sys.stdout.write(
            f"{args.node} re-admitted: its heartbeats are accepted again (on the node, "
            "'node-agent start --rejoin' once, if it deregistered itself)\n"
        )
    return 0


async def pending_keys(bus: Bus, subjects: Subjects, node: str) -> list[str]:
    """Every public key that registered ``node`` while pending (first one first), or the
    key of its deregistered record."""
    try:
        record = await registry.read_record(bus, subjects, node)
    except registry.NotFound:
        raise FleetError(
            f"node {node} has not registered: give its key (fleetctl approve {node} KEY; "
            "'node-agent key show' on the node prints it) or run 'node-agent register' there"
        ) from None
    if record.state not in ("pending", "deregistered") or not record.public_key:
        raise FleetError(
            f"node {node} has no pending registration (state {record.state}): give the key "
            f"to approve explicitly (fleetctl approve {node} KEY)"
        )
    keys = pending.keys(record)
    for key in keys:
        registry.check_public_key(key)
    return keys


def confirm(question: str) -> bool:
    """A yes from the terminal; without one (stdin not a terminal) the answer is no."""
    if not sys.stdin.isatty():
        sys.stderr.write(f"{question} no terminal to ask on; pass --yes to approve\n")
        return False
    sys.stderr.write(f"{question} [y/N] ")
    sys.stderr.flush()
    return sys.stdin.readline().strip().lower() in ("y", "yes")


async def cmd_revoke(args: argparse.Namespace) -> int:
    async with connected(args, "fleetctl") as bus:
        await registry.revoke(bus, Subjects(args.prefix), args.node)
    sys.stdout.write(f"revoked {args.node}\n")
    return 0


async def cmd_forget(args: argparse.Namespace) -> int:
    """Remove a node from the fleet from the provider side (it may be dead): the record
    names the operator key that forgot it. Needs the operator key file: whoever forgets a
    node is named by it."""
    key = operator_key(args)
    body = codec.encode(Forget(node_id=args.node, ts=time.time(), reason=args.reason))
    async with connected(args, "fleetctl") as bus:
        try:
            msg = await bus.request(
                Subjects(args.prefix).forget(), body, args.timeout, key.headers(body)
            )
        except nats.errors.TimeoutError:
            return fail(f"no aggregator answered within {args.timeout:g}s")
        except nats.errors.NoRespondersError:
            return fail("no aggregator is running to take the request")
    reply = codec.decode(msg.data, ForgetReply, msg.subject)
    if reply.status == "rejected":
        return fail(f"forget {args.node} refused: {reply.reason}")
    what = (
        "was already forgotten" if reply.status == "already" else "forgotten (state deregistered)"
    )
    parts = [f"{args.node} {what}"]
    parts.append("key revoked" if reply.revoked else "no approved key left")
    parts.append("pending commands purged" if reply.purged else "commands not purged")
    sys.stdout.write("; ".join(parts) + "\n")
    return 0


async def cmd_reset_seq(args: argparse.Namespace) -> int:
    async with connected(args, "fleetctl") as bus:
        await registry.reset_seq(bus, Subjects(args.prefix), args.node)
    sys.stdout.write(f"{args.node}: its next valid heartbeat is accepted whatever its seq\n")
    return 0


WATCH_INTERVAL = 2.0
"""Seconds between two reads of ``fleetctl nodes --watch``."""


def summarised(records: list[NodeRecord], output: str, rows: bool) -> bool:
    """Whether ``fleetctl nodes`` prints the summary by cluster and state (no heartbeat
    parts, so nothing to read live)."""
    return output in ("table", "wide") and not rows and len(records) > views.SUMMARY_ABOVE


def write_nodes(
    records: list[NodeRecord], output: str, colour: bool, rows: bool, of: int | None = None
) -> None:
    """A fleet above a screenful is summarised by cluster and state unless ``rows``; JSON
    is written record by record (the same bytes as one array), so a 100,000-node
    listing is never one string in memory. ``of``: how many there were before filters."""
    if output == "json":
        sys.stdout.write("[")
        for index, record in enumerate(records):
            sys.stdout.write(("," if index else "") + codec.encode(record).decode())
        sys.stdout.write("]\n")
    elif summarised(records, output, rows):
        sys.stdout.write(views.fleet_summary(records))
    else:
        sys.stdout.write(views.nodes_output(records, output, colour, of))


async def cmd_nodes(args: argparse.Namespace) -> int:
    """The fleet as a table (``-o wide`` adds SEQ and REASON) or JSON; with ``--watch``,
    read again every WATCH_INTERVAL and printed again when a node's state, schedulability,
    health, GPUs or version changed, until Ctrl-C (exit 0). Deregistered nodes are hidden
    and a fleet above a screenful is summarised, unless ``--all`` (everything, as rows)."""
    output = "json" if args.json else args.output
    colour = sys.stdout.isatty() and not os.environ.get("NO_COLOR")
    subjects = Subjects(args.prefix)
    selectors = fleet_labels.parse_selectors(args.label or [])
    async with connected(args, "fleetctl") as bus:
        stop = stop_event() if args.watch else None
        shown: list[tuple[object, ...]] | None = None
        states = set(args.state or ())
        while True:
            every = [
                r
                for r in await registry.read_records(bus, subjects)
                if args.all or "deregistered" in states or r.state != "deregistered"
            ]
            records = [
                r
                for r in every
                if (not args.cluster or r.cluster == args.cluster)
                and (not states or r.state in states)
                and fleet_labels.matches(r.labels, selectors)
            ]
            if args.limit is not None:
                records = records[: args.limit]
            rows = args.all or args.limit is not None
            if not summarised(records, output, rows):
                # Heartbeat parts as of each node's latest accepted heartbeat (issue 33).
                records = list(await live.overlay(bus, subjects, records))
            key = [views.change_key(r) for r in records]
            if key != shown:
                if shown is not None:
                    sys.stdout.write("\n")
                shown = key
                write_nodes(records, output, colour, rows, of=len(every))
                sys.stdout.flush()
            if stop is None:
                return 0
            try:
                async with asyncio.timeout(WATCH_INTERVAL):
                    await stop.wait()
                return 0
            except TimeoutError:
                continue


def partition_rates(
    first: list[lease.PartitionStatus], second: list[lease.PartitionStatus], seconds: float
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
        first = await lease.partition_status(bus, subjects, args.durable)
        started = time.monotonic()
        await asyncio.sleep(1.0)
        statuses = await lease.partition_status(bus, subjects, args.durable)
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
    lines = [*views.grid(rows, indent=""), "", *views.grid(totals, indent="")]
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


async def cmd_node(args: argparse.Namespace) -> int:
    async with connected(args, "fleetctl") as bus:
        record = await live.read_node(bus, Subjects(args.prefix), args.node)
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
        """``verified`` (the node's approved key), ``signed-by=<key>`` (another valid key,
        e.g. an operator's inject), ``unsigned`` or ``bad-signature``."""
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
        return "verified" if self.approved[node] == signer else f"signed-by={signer}"

    async def _read_approved(self, node: str) -> str | None:
        try:
            return registry.approved_key(await registry.trust_entry(self.bus, self.subjects, node))
        except (FleetError, nats.errors.Error):
            return None


async def cmd_watch(args: argparse.Namespace) -> int:
    """Print alerts (and with --events, node events) as they arrive, one line each. An
    alert is time, severity, node, kind and message (``--json``: the stored JSON); with
    ``--since`` the alerts stored in that window come first, from FLEET_ALERTS. A node
    event is its subject, whether it verified, then its JSON body. Anything that could
    drive the terminal is escaped."""
    subjects = Subjects(args.prefix)
    want_alerts = args.alerts or not args.events

    async with connected(args, "fleetctl") as bus:
        signers = EventSigners(bus, subjects)

        async def show_alert(entry: history.Entry) -> None:
            if args.node and views.event_fields(entry)[1] != args.node:
                return
            line = views.event_json(entry) if args.json else views.event_line(entry)
            sys.stdout.write(line + "\n")
            sys.stdout.flush()

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
                line = views.printable(f"{msg.subject} {verdict} {body}")
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
            await stop.wait()
    return 0


async def cmd_describe(args: argparse.Namespace) -> int:
    """The human view of one node: its record explained, then its recent history."""
    subjects = Subjects(args.prefix)
    async with connected(args, "fleetctl") as bus:
        record = await live.read_node(bus, subjects, args.node)
        alerts, results = await history.node_history(bus, subjects, args.node, limit=views.RECENT)
        policies = await policy_cli.read_policies(bus, subjects)
    now = time.time()
    remediation = policy_cli.node_lines(policies, record.cluster, record.node_id, now)
    sys.stdout.write(views.describe(record, alerts, results, now, remediation) + "\n")
    return 0


async def cmd_events(args: argparse.Namespace) -> int:
    """A node's alerts and command results from the streams, oldest first; a node with
    neither and no record is unknown (exit 1)."""
    subjects = Subjects(args.prefix)
    since = None if args.since is None else time.time() - args.since
    async with connected(args, "fleetctl") as bus:
        alerts, results = await history.node_history(bus, subjects, args.node, since)
        if not alerts and not results:
            # Nothing to show: an unknown node (a typo) is an error, a known one is quiet.
            await registry.read_record(bus, subjects, args.node)
    for entry in history.merged(alerts, results):
        sys.stdout.write((views.event_json(entry) if args.json else views.event_line(entry)) + "\n")
    return 0


async def cmd_simulate(args: argparse.Namespace) -> int:
    if args.nodes < 1 or (args.rate is not None and args.rate <= 0) or args.duration <= 0:
        return fail("simulate: --nodes, --rate and --duration must be positive")
    check_token("cluster", args.cluster)
    options = SimOptions(
        nodes=args.nodes,
        rate=args.rate or args.nodes / 10.0,
        duration=args.duration,
        cluster=args.cluster,
        gpus=args.gpus,
        prefix=args.prefix,
        wait=args.wait,
        kill=args.kill,
        processes=args.processes,
    )
    if not 0 <= args.kill <= args.nodes:
        return fail("simulate: --kill must be between 0 and --nodes")
    if not 1 <= args.processes <= args.nodes:
        return fail("simulate: --processes must be between 1 and --nodes")
    client = settings_from(args, ClientConfig, CLIENT_ENV_PREFIX)
    async with connected(args, "fleetctl-simulate") as bus:
        return await simulate(bus, options, sys.stdout, client)


async def cmd_nats_config(args: argparse.Namespace) -> int:
    """Print (or write) the accounts block of the fleet's servers: nodes from ``--nodes``,
    else every approved node in ``fleet_trust``."""
    subjects = Subjects(args.prefix)
    if args.nodes is not None:
        nodes = nats_config.parse_nodes(args.nodes.read_text())
    else:
        async with connected(args, "fleetctl") as bus:
            nodes = await nats_config.approved_nodes(bus, subjects, args.cluster or "")
    users = nats_config.Users(
        nodes=nodes,
        aggregators=args.aggregator or [],
        operators=args.operator or [],
        monitors=args.monitor or [],
    )
    text = nats_config.render(subjects, users, args.identity)
    if args.output is None:
        sys.stdout.write(text)
    else:
        args.output.write_text(text)
        sys.stderr.write(f"{len(nodes)} node users written to {args.output}\n")
    return 0


def parser() -> argparse.ArgumentParser:
    root: argparse.ArgumentParser = completion.SuggestingParser(
        prog="fleetctl", description="operate a nats-node-agent fleet"
    )
    add_version(root)
    commands = root.add_subparsers(dest="command", required=True)

    up = commands.add_parser("up", help="embedded nats-server + aggregator + N fake-GPU agents")
    up.add_argument("--nodes", type=int, default=3, help="agents to run (default 3)")
    up.add_argument(
        "--port", type=int, default=4222, help="NATS client port (default 4222; 0: any free port)"
    )
    up.add_argument(
        "--store",
        type=Path,
        default=None,
        help=f"where the fleet keeps NATS data, keys and logs (default {default_store()})",
    )
    up.add_argument(
        "--heartbeat-interval", type=duration, default=2.0, help="agents' beat period (default 2s)"
    )
    up.add_argument(
        "--stale-after", type=duration, help="heartbeat TTL (default 3 x --heartbeat-interval)"
    )
    up.add_argument(
        "--gpus-per-node",
        type=gpus_per_node,
        default=8,
        help="N simulated GPUs per agent (default 8); real: this machine's GPUs through "
        "NVML (an error without NVML); auto: real if NVML works, else 8 simulated",
    )
    up.set_defaults(func=cmd_up)

    aggregator = commands.add_parser(
        "aggregator",
        help="run an aggregator until SIGINT/SIGTERM",
        description="Flags beat FLEET_AGGREGATOR_<SETTING> variables, which beat --config "
        "(docs/settings.md). FLEETCTL_SERVER gives the server when FLEET_AGGREGATOR_SERVER "
        "does not; the contexts of fleetctl's config.toml are not read: a service's settings "
        "must not change with the context an operator selected last. "
        "With --workloads-key-file (an operator key the nodes trust) it also keeps workloads "
        "placed by 'fleetctl deploy' without a node running, those signed by a "
        "--workloads-operator key: it moves them off lost, draining and failing nodes "
        "(docs/commands.md, 'Placed workloads').",
    )
    add_config_flags(aggregator, AggregatorConfig, AGGREGATOR_ENV_PREFIX)
    aggregator.set_defaults(func=cmd_aggregator)

    keys = commands.add_parser("keys", help="operator keys")
    keys_commands = keys.add_subparsers(dest="keys_command", required=True)
    keys_init = keys_commands.add_parser("init", help="create the operator key")
    keys_init.add_argument(
        "--key-file",
        type=Path,
        default=None,
        help=f"where to write it (env {KEY_FILE_ENV}; default {default_operator_key()})",
    )
    add_context_flag(keys_init)
    keys_init.set_defaults(func=cmd_keys_init)
    keys_show = keys_commands.add_parser(
        "show", help="print the operator's public key (stdout) and its fingerprint (stderr)"
    )
    keys_show.add_argument(
        "--key-file",
        type=Path,
        default=None,
        help=f"the operator key (env {KEY_FILE_ENV}; default: the context's, else "
        f"{default_operator_key()})",
    )
    add_context_flag(keys_show)
    keys_show.set_defaults(func=cmd_keys_show, config=None)

    approve = commands.add_parser(
        "approve",
        help="approve a node's public key (given, or from its pending registration)",
        description="Without KEY, the key of the node's pending registration is shown with "
        "its fingerprint and approved once confirmed. When several keys registered the name "
        "(anyone may register any name), each is shown and none is approved: give KEY.",
    )
    approve.add_argument("node", type=token("node id"), help="the node's id")
    approve.add_argument(
        "public_key",
        nargs="?",
        metavar="KEY",
        help="its public key (U...; 'node-agent key show' prints it); default: the key "
        "its pending registration carries, when only one key registered the name",
    )
    approve.add_argument(
        "--yes",
        action="store_true",
        help="approve the registered key without asking (refused when several keys "
        "registered the name: give KEY)",
    )
    add_server(approve)
    approve.set_defaults(func=cmd_approve)

    revoke = commands.add_parser("revoke", help="revoke a node's approved key")
    revoke.add_argument("node", type=token("node id"), help="the node's id")
    add_server(revoke)
    revoke.set_defaults(func=cmd_revoke)

    forget = commands.add_parser(
        "forget",
        help="remove a node from the provider side (deregistered, key revoked, commands purged)",
        description="A request signed by the operator key, carried out by an aggregator that "
        "trusts the key (its trust_operators). Idempotent. The node's record becomes "
        "deregistered naming the operator key and the reason; 'fleetctl approve NODE' admits "
        "it again.",
    )
    forget.add_argument("node", type=token("node id"), help="the node's id")
    forget.add_argument("--reason", default="", help="why, recorded in the node's record")
    forget.add_argument(
        "--key-file",
        type=Path,
        default=None,
        help=f"operator key (env {KEY_FILE_ENV}; default {default_operator_key()})",
    )
    forget.add_argument(
        "--timeout",
        type=duration,
        default=10.0,
        help="how long to wait for an aggregator's answer (default 10s)",
    )
    add_server(forget)
    forget.set_defaults(func=cmd_forget)

    reset_seq = commands.add_parser(
        "reset-seq", help="accept a node's next heartbeat whatever its seq (re-imaged node)"
    )
    reset_seq.add_argument("node", type=token("node id"), help="the node's id")
    add_server(reset_seq)
    reset_seq.set_defaults(func=cmd_reset_seq)

    nodes = commands.add_parser("nodes", help="list the fleet")
    nodes.add_argument("--cluster", help="only nodes of this cluster")
    nodes.add_argument(
        "--state",
        action="append",
        choices=get_args(RecordState),
        help="only nodes in this state (repeatable: any of them)",
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
        f"even above {views.SUMMARY_ABOVE} (else a summary)",
    )
    nodes.add_argument(
        "-o",
        "--output",
        choices=views.NODE_OUTPUTS,
        default="table",
        help="table (default), wide (adds SEQ and REASON), json or yaml",
    )
    nodes.add_argument(
        "--watch",
        action="store_true",
        help=f"read again every {WATCH_INTERVAL:g}s, print again on change, Ctrl-C stops",
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
        help="node events (core NATS, live), with whether each verified",
    )
    watch.add_argument("--node", help="only this node")
    watch.add_argument(
        "--since", type=duration, help="replay the alerts of this window first (30s, 10m, 1h)"
    )
    watch.add_argument("--json", action="store_true", help="one JSON object per line")
    add_server(watch)
    watch.set_defaults(func=cmd_watch)

    describe = commands.add_parser(
        "describe", help="one node explained: state, checks, GPUs, recent alerts and results"
    )
    describe.add_argument("node", type=token("node id"), help="the node's id")
    add_server(describe)
    describe.set_defaults(func=cmd_describe)

    events = commands.add_parser(
        "events", help="a node's alerts and command results from the streams, oldest first"
    )
    events.add_argument("node", type=token("node id"), help="the node's id")
    events.add_argument("--since", type=duration, help="only this recent window (30s, 10m, 1h)")
    events.add_argument("--json", action="store_true", help="one JSON object per line")
    add_server(events)
    events.set_defaults(func=cmd_events)

    sim = commands.add_parser(
        "simulate",
        help="fleet simulator / aggregator benchmark",
        description="N signed simulated nodes beat at --rate in all for --duration; prints "
        "the publish rate, when every record carries its node's last seq, and the "
        "publish-to-record latency p50/p99 of each node's FIRST heartbeat of the run: from "
        "that heartbeat's ts to this command's KV watch seeing the fleet_nodes record "
        "written from it (a new boot is a state change, so it is written at once; later "
        "heartbeats reach fleet_nodes only at checkpoints and are not measured).",
    )
    sim.add_argument("--nodes", type=int, required=True, help="how many simulated nodes (required)")
    sim.add_argument("--rate", type=float, default=None, help="heartbeats/s in all (N / 10)")
    sim.add_argument("--duration", type=duration, default=30.0, help="how long (default 30s)")
    sim.add_argument("--cluster", default="sim", help="their cluster (default sim)")
    sim.add_argument("--gpus", type=int, default=8, help="fake GPUs per node (default 8)")
    sim.add_argument(
        "--wait",
        type=duration,
        default=60.0,
        help="catch-up bound after the last publish (default 60s)",
    )
    sim.add_argument(
        "--kill",
        type=int,
        default=0,
        help="stop this many nodes at once half way (a stale storm): reports their alerts",
    )
    sim.add_argument(
        "--processes",
        type=int,
        default=1,
        help="worker processes that sign and publish, each every P-th node (default 1: "
        "this one); this process follows the records and prints the figures",
    )
    add_server(sim)
    sim.set_defaults(func=cmd_simulate)
    config = commands.add_parser(
        "nats-config",
        help="generate the nats-server accounts block (per-node users and permissions)",
        description="Nodes come from --nodes, else from the approved keys in fleet_trust.",
    )
    config.add_argument(
        "--nodes", type=Path, help="file of 'node cluster public_key' lines (no connection)"
    )
    config.add_argument("--cluster", help="cluster of approved nodes that have no record yet")
    config.add_argument("--aggregator", action="append", help="aggregator public key (repeatable)")
    config.add_argument("--operator", action="append", help="operator public key (repeatable)")
    config.add_argument(
        "--monitor",
        action="append",
        help="read-only monitoring public key (repeatable): account MONITORS, node records "
        "by direct get with the JetStream API prefix JS.FLEET.API, alerts and events",
    )
    config.add_argument(
        "--identity",
        choices=["nkey", "cert"],
        default="nkey",
        help=f"nodes log in with their nkey, or a client certificate whose email SAN is "
        f"<node>@{nats_config.CERT_DOMAIN} (server tls verify_and_map); default nkey",
    )
    config.add_argument("--output", type=Path, help="write here instead of stdout")
    add_server(config)
    config.set_defaults(func=cmd_nats_config)
    send.add_command_parsers(commands)
    workloads.add_workload_parsers(commands, duration)
    rolling.add_rolling(commands)
    placement_cli.add_parsers(commands)
    enroll_cli.add_parsers(commands)
    maintenance_cli.add_parsers(commands)
    policy_cli.add_parsers(commands)
    dashboard_cli.add_parsers(commands)
    gpus.add_parser(commands)
    contexts.add_parsers(commands)
    completion.add_node_completers(root)
    return strict(root)


def main(argv: list[str] | None = None) -> int:
    root = parser()
    argcomplete.autocomplete(root)
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        root.print_help()
        return 0
    args = parse(root, argv)
    func: Command = args.func

    async def entry() -> int:
        if args.command not in ("up", "aggregator", "config"):
            contexts.apply(args)
        return await func(args)

    return run_main(entry)


if __name__ == "__main__":
    sys.exit(main())
