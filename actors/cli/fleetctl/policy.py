"""``fleetctl policy status|reset|clear``: what the remediation policy holds and why, its
breaker, what a dry run would do, and the two operator acts it waits for (a breaker
reset, a node cleared), sent as signed requests an aggregator verifies
(:mod:`actors.fleet.operator.policy_requests`)."""

from __future__ import annotations

import argparse
import sys
import time

import msgspec
import nats.errors

from actors.cli.common import add_server, connected, operator_key, token
from actors.cli.fleetctl.signer import add_request_signing, check_signer
from actors.cli.parsing import fail
from actors.cli.render import tables
from actors.fleet.storage.policy_holds import read_policies
from actors.runtime import spans
from actors.runtime.spans import clock
from schemas import codec
from schemas.errors import FleetError
from schemas.messages import PolicyReply, PolicyRequest
from schemas.remediation import Hold, PolicyRecord
from schemas.subjects import Subjects


def hold_status(hold: Hold, now: float) -> str:
    """``pending``, ``held``, ``healthy for 2m``, ``hung``, ``refused`` or ``needs
    attention``: where a hold stands."""
    if hold.refused:
        return "refused: needs attention"
    if hold.needs_attention:
        return "needs attention"
    if hold.reason_class == "hung" and hold.back_at is None:
        return "hung: waiting for a new boot id"
    if not hold.applied:
        return "pending (cordon not shown yet)"
    if hold.healthy_since is not None:
        return f"healthy for {spans.span(now - hold.healthy_since)}"
    return "held"


def status_text(records: list[PolicyRecord], now: float) -> str:
    """The breaker, the holds, the would-be actions (dry run) and the skipped nodes of
    each cluster, one block per cluster."""
    if not records:
        return "The remediation policy holds nothing (no aggregator has run it here)."
    lines: list[str] = []
    for record in records:
        breaker = (
            f"TRIPPED {spans.age(now - record.tripped_at)} (fleetctl policy reset "
            f"--cluster {record.cluster})"
            if record.tripped_at is not None
            else "closed"
        )
        counted = sum(1 for hold in record.holds.values() if not hold.refused)
        refused = len(record.holds) - counted
        lines.append(
            f"Cluster {record.cluster}: breaker {breaker}; holds {counted} of at most "
            f"{record.limit} (of {record.base} reporting nodes)"
            + (f"; {refused} refused, not counted" if refused else "")
        )
        for would in record.would if record.tripped_at is not None else []:
            lines.append(f"  would: {would}")
        rows = [("NODE", "ACTION", "SINCE", "CLASS", "STATUS", "REASON")]
        for node, hold in sorted(record.holds.items()):
            reason = f"{hold.reason}; {hold.refused}" if hold.refused else hold.reason
            rows.append(
                (node, hold.action, clock(hold.since), hold.reason_class, hold_status(hold, now),
                 reason)
            )  # fmt: skip
        if len(rows) > 1:
            lines += tables.grid(rows)
        if record.dry:
            lines.append("  Dry run: what it would do (nothing is sent)")
            lines += [f"    {node}: {text}" for node, text in sorted(record.dry.items())]
        if record.skipped:
            lines.append("  Skipped:")
            lines += [f"    {node}: {text}" for node, text in sorted(record.skipped.items())]
    return "\n".join(tables.printable(line) for line in lines)


def node_lines(records: list[PolicyRecord], cluster: str, node: str, now: float) -> list[str]:
    """``fleetctl describe``'s remediation lines for one node."""
    lines = []
    for record in records:
        if record.cluster != cluster:
            continue
        hold = record.holds.get(node)
        if hold is not None:
            note = ""
            if hold.refused:
                note = f"; refused: {hold.refused} (fleetctl policy clear)"
            elif hold.needs_attention:
                note = "; needs attention (fleetctl policy clear)"
            lines.append(
                f"Remediation:     {hold.action} by policy since {clock(hold.since)} "
                f"({hold.reason}): {hold_status(hold, now)}{note}"
            )
        for label, texts in (("would", record.dry), ("skipped", record.skipped)):
            if node in texts:
                lines.append(f"Remediation:     {label}: {texts[node]}")
        times = record.history.get(node, [])
        if times:
            lines.append(
                f"Remediated:      {len(times)} times: " + ", ".join(clock(at) for at in times[-5:])
            )
    return lines


async def cmd_status(args: argparse.Namespace) -> int:
    async with connected(args, "fleetctl") as bus:
        records = await read_policies(bus, Subjects(args.prefix))
    if args.cluster:
        records = [record for record in records if record.cluster == args.cluster]
    if args.json:
        sys.stdout.write(msgspec.json.encode(records).decode() + "\n")
    else:
        sys.stdout.write(status_text(records, time.time()) + "\n")
    return 0


async def request(args: argparse.Namespace) -> PolicyReply:
    """Sign the request for ``args`` (naming the state it acts on, read now from the
    cluster's record), send it to the aggregators and return the reply."""
    key = operator_key(args)
    subjects = Subjects(args.prefix)
    async with connected(args, "fleetctl") as bus:
        await check_signer(bus, subjects, key, args)
        found = [r for r in await read_policies(bus, subjects) if r.cluster == args.cluster]
        if not found:
            raise FleetError(f"the policy has no record for cluster {args.cluster}")
        record = found[0]
        if args.policy_command == "reset":
            if record.tripped_at is None:
                raise FleetError(f"the breaker of {args.cluster} is not tripped")
            wanted = PolicyRequest(
                action="reset", cluster=args.cluster, ts=time.time(), tripped_at=record.tripped_at
            )
        else:
            hold = record.holds.get(args.node)
            if hold is None and args.node not in record.history:
                raise FleetError(f"the policy holds nothing of {args.node} in {args.cluster}")
            wanted = PolicyRequest(
                action="clear",
                cluster=args.cluster,
                ts=time.time(),
                node=args.node,
                since=hold.since if hold is not None else None,
            )
        body = codec.encode(wanted)
        try:
            msg = await bus.request(subjects.policy(), body, args.timeout, key.headers(body))
        except nats.errors.TimeoutError:
            raise FleetError(f"no aggregator answered within {args.timeout:g}s") from None
        except nats.errors.NoRespondersError:
            raise FleetError("no aggregator is running to take the request") from None
    return codec.decode(msg.data, PolicyReply, msg.subject)


async def cmd_reset(args: argparse.Namespace) -> int:
    reply = await request(args)
    if reply.status == "rejected":
        return fail(f"reset of {args.cluster}'s breaker refused: {reply.reason}")
    sys.stdout.write(
        f"breaker of {args.cluster} reset: the policy decides from the nodes' current state\n"
    )
    return 0


async def cmd_clear(args: argparse.Namespace) -> int:
    """Forget a node's hold and history; the node stays as it is (an operator uncordons
    it with fleetctl uncordon)."""
    reply = await request(args)
    if reply.status == "rejected":
        return fail(f"clear of {args.node} refused: {reply.reason}")
    sys.stdout.write(
        f"{args.node} cleared: the policy no longer holds it (uncordon it yourself when ready)\n"
    )
    return 0


def add_parsers(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``policy`` and its subcommands."""
    parser = commands.add_parser(
        "policy",
        help="the remediation policy: what it holds and why, its breaker",
        description="reset and clear are requests signed by the operator key, carried out by "
        "an aggregator that trusts it (its trust_operators); each names the state it acts "
        "on (the trip, the hold), so a copy sent again later changes nothing.",
    )
    subs = parser.add_subparsers(dest="policy_command", required=True)
    status = subs.add_parser(
        "status", help="the breaker, the nodes the policy holds, what a dry run would do"
    )
    status.add_argument("--cluster", type=token("cluster"), help="one cluster (default all)")
    status.add_argument("--json", action="store_true", help="the policy records as JSON")
    add_server(status)
    status.set_defaults(func=cmd_status)
    reset = subs.add_parser(
        "reset", help="close a tripped breaker (the policy then acts on current state only)"
    )
    reset.add_argument(
        "--cluster", type=token("cluster"), required=True, help="the cluster whose breaker closes"
    )
    add_request_signing(reset)
    reset.set_defaults(func=cmd_reset)
    clear = subs.add_parser(
        "clear", help="forget a node the policy holds (needs attention, refused) and its history"
    )
    clear.add_argument("node", type=token("node id"), help="the node's id")
    clear.add_argument(
        "--cluster", type=token("cluster"), required=True, help="the cluster of the node"
    )
    add_request_signing(clear)
    clear.set_defaults(func=cmd_clear)
