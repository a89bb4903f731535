"""``fleetctl forget``: nodes removed from the provider side (they may be dead), one by name
or many by selector (a node list or range, ``-l``, ``--cluster``, ``--state``,
``--older-than``). Each node is one request signed by the operator key and carried out
by an aggregator that trusts it, so a selector widens nothing on the wire: fleetctl
chooses the nodes from the records, shows them, and asks before it sends."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import get_args

import nats.errors

from actors.cli.common import (
    KEY_FILE_ENV,
    add_server,
    connected,
    default_operator_key,
    operator_key,
    token,
)
from actors.cli.fleetctl.signer import add_signing_check, check_signer
from actors.cli.fleetctl.trust import confirm
from actors.cli.node_names import did_you_mean, expand_nodes, node_selection
from actors.cli.parsing import duration, fail
from actors.cli.render import tables
from actors.fleet import labels as fleet_labels
from actors.fleet.live import reader as live
from actors.runtime import spans
from actors.runtime.bus import Bus
from schemas import codec, signing
from schemas.base import RecordState
from schemas.errors import FleetError
from schemas.messages import Forget, ForgetReply, NodeRecord
from schemas.subjects import Subjects


def selecting(args: argparse.Namespace) -> bool:
    """Whether the nodes are chosen by a selector or a list rather than one name."""
    many = args.node is not None and len(expand_nodes(args.node)) > 1
    return bool(many or args.label or args.cluster or args.state or args.older_than or args.dry_run)


def chosen(records: list[NodeRecord], args: argparse.Namespace, now: float) -> list[NodeRecord]:
    """The records the selector names, forgotten ones left out: in the list (when given),
    with every label, in the cluster and state, silent for longer than ``--older-than``."""
    listed = set(expand_nodes(args.node)) if args.node else None
    selectors = fleet_labels.parse_selectors(args.label or [])
    return [
        record
        for record in records
        if record.state != "deregistered"
        and (listed is None or record.node_id in listed)
        and fleet_labels.matches(record.labels, selectors)
        and (not args.cluster or record.cluster == args.cluster)
        and (not args.state or record.state in args.state)
        and (not args.older_than or now - record.last_seen > args.older_than)
    ]


def row(record: NodeRecord, now: float) -> str:
    seen = f"seen {spans.age(now - record.last_seen)} ago" if record.last_seen else "never seen"
    return f"  {record.node_id}  {record.cluster}  {record.state}  {seen}\n"


async def request_forget(
    bus: Bus, subjects: Subjects, key: signing.KeyPair, node: str, args: argparse.Namespace
) -> ForgetReply:
    """One signed Forget of ``node``, answered by an aggregator; FleetError when none does."""
    body = codec.encode(Forget(node_id=node, ts=time.time(), reason=args.reason))
    try:
        msg = await bus.request(subjects.forget(), body, args.timeout, key.headers(body))
    except nats.errors.TimeoutError:
        raise FleetError(f"no aggregator answered within {args.timeout:g}s") from None
    except nats.errors.NoRespondersError:
        raise FleetError("no aggregator is running to take the request") from None
    return codec.decode(msg.data, ForgetReply, msg.subject)


def reply_line(node: str, reply: ForgetReply) -> str:
    what = (
        "was already forgotten" if reply.status == "already" else "forgotten (state deregistered)"
    )
    parts = [f"{node} {what}"]
    parts.append("key revoked" if reply.revoked else "no approved key left")
    parts.append("pending commands purged" if reply.purged else "commands not purged")
    return "; ".join(parts) + "\n"


async def cmd_forget(args: argparse.Namespace) -> int:
    """Forget one node, or (:func:`selecting`) every node a selector names: listed first,
    then asked about (``--yes``: not asked; ``--dry-run``: listed only); a listed name the
    fleet does not know is an error. Needs the operator key file: whoever forgets a node
    is named in its record."""
    if not args.node and not selecting(args):
        return fail(
            "name the nodes: NODE (node[1-4],gpu-a), -l, --cluster, --state or --older-than", 2
        )
    subjects = Subjects(args.prefix)
    if not selecting(args):
        [node] = expand_nodes(args.node)
        key = operator_key(args)
        async with connected(args, "fleetctl") as bus:
            await check_signer(bus, subjects, key, args)
            reply = await request_forget(bus, subjects, key, node, args)
        if reply.status == "rejected":
            return fail(f"forget {node} refused: {reply.reason}")
        sys.stdout.write(reply_line(node, reply))
        return 0
    async with connected(args, "fleetctl") as bus:
        records = await live.stored_records(bus, subjects)
        if args.node:
            known = {record.node_id for record in records}
            unknown = [node for node in expand_nodes(args.node) if node not in known]
            if unknown:
                hint = did_you_mean(unknown[0], known)
                return fail(f"no such node: {', '.join(unknown)}{hint}")
        now = time.time()
        nodes = chosen(records, args, now)
        if not nodes:
            return fail("no node to forget matches the selector")
        count = tables.nodes(len(nodes))
        sys.stdout.write(f"{'would forget' if args.dry_run else 'to forget'} {count}:\n")
        sys.stdout.writelines(row(record, now) for record in nodes)
        sys.stdout.flush()
        if args.dry_run:
            return 0
        key = operator_key(args)
        if not args.yes and not confirm(f"forget {count}?"):
            return fail("nothing forgotten")
        await check_signer(bus, subjects, key, args)
        refused = 0
        for record in nodes:
            reply = await request_forget(bus, subjects, key, record.node_id, args)
            if reply.status == "rejected":
                refused += 1
                sys.stderr.write(f"error: forget {record.node_id} refused: {reply.reason}\n")
            else:
                sys.stdout.write(reply_line(record.node_id, reply))
    return 1 if refused else 0


def add_parsers(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``forget``."""
    forget = commands.add_parser(
        "forget",
        help="remove nodes from the provider side (deregistered, key revoked, commands purged)",
        description="Each node is one request signed by the operator key, carried out by an "
        "aggregator that trusts the key (its trust_operators). Idempotent. A node's record "
        "becomes deregistered naming the operator key and the reason; 'fleetctl approve NODE' "
        "admits it again. With a list, a range or a selector, the nodes chosen are listed and "
        "confirmed first: fleetctl forget --state offline --older-than 7d",
    )
    forget.add_argument(
        "node",
        nargs="?",
        type=node_selection,
        help="the node's id, or a list or range (node[1-4],gpu-a)",
    )
    forget.add_argument(
        "-l",
        "--label",
        action="append",
        metavar="KEY=VALUE",
        help="every node with this label (repeatable: all must match)",
    )
    forget.add_argument("--cluster", type=token("cluster"), help="only nodes of this cluster")
    forget.add_argument(
        "--state",
        action="append",
        choices=[state for state in get_args(RecordState) if state != "deregistered"],
        help="only nodes in this state (repeatable: any of them), e.g. offline",
    )
    forget.add_argument(
        "--older-than",
        type=duration,
        metavar="DURATION",
        help="only nodes not heard from for longer than this (7d, 12h)",
    )
    forget.add_argument(
        "--dry-run", action="store_true", help="list the nodes a selector chooses, forget none"
    )
    forget.add_argument("--reason", default="", help="why, recorded in each node's record")
    forget.add_argument(
        "--yes",
        action="store_true",
        help="forget the nodes a selector chooses without asking (needed without a terminal)",
    )
    add_signing_check(forget)
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
        help="how long to wait for an aggregator's answer, per node (default 10s)",
    )
    add_server(forget)
    forget.set_defaults(func=cmd_forget)
