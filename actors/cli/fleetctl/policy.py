"""``fleetctl policy status|reset|clear``: what the remediation policy holds and why, its
breaker, and the two operator acts it waits for (a breaker reset, a node cleared)."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import msgspec
import nats.js.errors

from actors.cli.common import add_server, connected, token
from actors.cli.render import tables
from actors.fleet.storage.policy_holds import read_policies
from actors.runtime import kv, spans
from actors.runtime.bus import Bus, NotProvisioned
from actors.runtime.spans import clock
from schemas import codec
from schemas.errors import FleetError
from schemas.remediation import PolicyRecord
from schemas.subjects import BUCKET_POLICY, Subjects

CAS_ATTEMPTS = 10


def status_text(records: list[PolicyRecord], now: float) -> str:
    """The breaker and the holds of each cluster, one block per cluster."""
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
        lines.append(
            f"Cluster {record.cluster}: breaker {breaker}; holds {len(record.holds)} of "
            f"at most {record.limit}"
        )
        for would in record.would if record.tripped_at is not None else []:
            lines.append(f"  would: {would}")
        rows = [("NODE", "ACTION", "SINCE", "CLASS", "STATUS", "REASON")]
        for node, hold in sorted(record.holds.items()):
            status = "needs attention" if hold.needs_attention else "held"
            if hold.healthy_since is not None and not hold.needs_attention:
                status = f"healthy for {spans.span(now - hold.healthy_since)}"
            rows.append(
                (node, hold.action, clock(hold.since), hold.reason_class, status, hold.reason)
            )
        if len(rows) > 1:
            lines += tables.grid(rows)
    return "\n".join(tables.printable(line) for line in lines)


def node_lines(records: list[PolicyRecord], cluster: str, node: str, now: float) -> list[str]:
    """``fleetctl describe``'s remediation lines for one node."""
    lines = []
    for record in records:
        if record.cluster != cluster:
            continue
        hold = record.holds.get(node)
        if hold is not None:
            note = "; needs attention (fleetctl policy clear)" if hold.needs_attention else ""
            lines.append(
                f"Remediation:     {hold.action} by policy since {clock(hold.since)} "
                f"({hold.reason}){note}"
            )
        times = record.history.get(node, [])
        if times:
            lines.append(
                f"Remediated:      {len(times)} times: " + ", ".join(clock(at) for at in times[-5:])
            )
    return lines


async def change(
    bus: Bus, subjects: Subjects, cluster: str, edit: Callable[[PolicyRecord], PolicyRecord]
) -> PolicyRecord:
    """Compare-and-set ``edit`` on a cluster's policy record."""
    try:
        bucket = await bus.kv(subjects.bucket_name(BUCKET_POLICY))
    except NotProvisioned:
        raise FleetError("no policy bucket: no aggregator has run the policy here") from None
    for _ in range(CAS_ATTEMPTS):
        current, revision = await kv.read_with_revision(bucket, cluster, PolicyRecord)
        if current is None or revision is None:
            raise FleetError(f"the policy has no record for cluster {cluster}")
        updated = edit(current)
        try:
            await bucket.update(cluster, codec.encode(updated), last=revision)
            return updated
        except nats.js.errors.KeyWrongLastSequenceError:
            continue
    raise FleetError(f"the policy record of {cluster} kept changing; try again")


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


async def cmd_reset(args: argparse.Namespace) -> int:
    def reset(record: PolicyRecord) -> PolicyRecord:
        return msgspec.structs.replace(record, tripped_at=None, would=[], updated_by="fleetctl")

    async with connected(args, "fleetctl") as bus:
        await change(bus, Subjects(args.prefix), args.cluster, reset)
    sys.stdout.write(
        f"breaker of {args.cluster} reset: the policy decides from the nodes' current state\n"
    )
    return 0


async def cmd_clear(args: argparse.Namespace) -> int:
    """Forget a node's needs_attention hold and history; the node stays as it is (an
    operator uncordons it with fleetctl uncordon)."""

    def clear(record: PolicyRecord) -> PolicyRecord:
        if args.node not in record.holds and args.node not in record.history:
            raise FleetError(f"the policy holds nothing of {args.node} in {args.cluster}")
        holds = {node: hold for node, hold in record.holds.items() if node != args.node}
        history = {node: at for node, at in record.history.items() if node != args.node}
        return msgspec.structs.replace(record, holds=holds, history=history, updated_by="fleetctl")

    async with connected(args, "fleetctl") as bus:
        await change(bus, Subjects(args.prefix), args.cluster, clear)
    sys.stdout.write(
        f"{args.node} cleared: the policy no longer holds it (uncordon it yourself when ready)\n"
    )
    return 0


def add_parsers(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``policy`` and its subcommands."""
    parser = commands.add_parser(
        "policy", help="the remediation policy: what it holds and why, its breaker"
    )
    subs = parser.add_subparsers(dest="policy_command", required=True)
    status = subs.add_parser("status", help="the breaker and the nodes the policy holds")
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
    add_server(reset)
    reset.set_defaults(func=cmd_reset)
    clear = subs.add_parser(
        "clear", help="forget a node the policy holds (needs_attention) and its history"
    )
    clear.add_argument("node", type=token("node id"), help="the node's id")
    clear.add_argument(
        "--cluster", type=token("cluster"), required=True, help="the cluster of the node"
    )
    add_server(clear)
    clear.set_defaults(func=cmd_clear)
