"""``fleetctl keys init|show``, ``approve``, ``revoke`` and ``reset-seq`` (``forget``: its own
module): the operator's key and the trust the provider side gives each node's key."""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

from actors.cli.common import (
    KEY_FILE_ENV,
    add_context_flag,
    add_server,
    connected,
    default_operator_key,
    operator_key,
    token,
)
from actors.cli.parsing import fail
from actors.cli.render.tables import printable
from actors.fleet import identity
from actors.fleet.aggregator import pending
from actors.fleet.live import reader as live
from actors.fleet.storage import registry
from actors.runtime.bus import Bus
from schemas import signing
from schemas.errors import FleetError
from schemas.messages import NodeRecord
from schemas.subjects import Subjects


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
    showing its fingerprint and the identity it registered with, and asking (unless
    --yes): that key came over the network. A name that several keys registered is
    approved only with the key named. The identity the approved key's registration
    carried becomes the node's enrolled identity; ``--identity`` records what the node
    claims now instead (:func:`cmd_approve_identity`)."""
    if args.identity:
        return await cmd_approve_identity(args)
    if args.public_key is not None:
        registry.check_public_key(args.public_key)
    async with connected(args, "fleetctl") as bus:
        subjects = Subjects(args.prefix)
        key = args.public_key
        record: NodeRecord | None = None
        if key is None:
            registered = await pending_record(bus, subjects, args.node)
            key, record = chosen_key(args.node, registered, args.yes), registered
        else:
            with contextlib.suppress(FleetError):  # a key given needs no registration
                record = await pending_record(bus, subjects, args.node)
        enrolled = pending.identity_of_key(record, key) if record is not None else None
        await registry.approve(bus, subjects, args.node, key, by="fleetctl", identity=enrolled)
        readmitted = await registry.readmit(bus, subjects, args.node)
    sys.stdout.write(f"approved {args.node}\n")
    if readmitted:
        sys.stdout.write(
            f"{args.node} re-admitted: its heartbeats are accepted again (on the node, "
            "'node-agent start --rejoin' once, if it deregistered itself)\n"
        )
    return 0


def chosen_key(node: str, record: NodeRecord, yes: bool) -> str:
    """The one key that registered ``node`` (in ``record``), once shown with its
    fingerprint and identity and confirmed; FleetError when several did or no one said
    yes."""
    keys = pending.keys(record)
    for candidate in keys:
        registry.check_public_key(candidate)
        registered = pending.identity_of_key(record, candidate)
        sys.stderr.write(
            f"{node} registered key {candidate}\n"
            f"  fingerprint {signing.fingerprint(candidate)}\n"
            + printable(f"  identity {identity.summary(registered)}")
            + "\n"
        )
    if len(keys) > 1:
        raise FleetError(
            f"{len(keys)} keys registered {node}: compare each with 'node-agent key show' on "
            f"the node and approve one by key (fleetctl approve {node} KEY); --yes does not "
            "choose"
        )
    sys.stderr.write("  compare with 'node-agent key show' on the node\n")
    if not yes and not confirm(f"approve this key for {node}?"):
        raise FleetError(f"{node} not approved")
    return keys[0]


async def cmd_approve_identity(args: argparse.Namespace) -> int:
    """``approve --identity NODE``: record the host name and GPUs the node's latest
    accepted heartbeat claims as its enrolled identity, after showing both and asking
    (unless --yes). What a hardware change (or a forged heartbeat) made the remediation
    policy withhold runs once this is done: only an operator says which machine a node is."""
    if args.public_key is not None:
        return fail("--identity takes no KEY: it records what the approved node claims now")
    async with connected(args, "fleetctl") as bus:
        subjects = Subjects(args.prefix)
        record = await live.read_node(bus, subjects, args.node)
        claims = identity.claimed(record)
        if claims is None:
            return fail(f"{args.node} has sent no heartbeat with its host name and GPUs yet")
        entry = await registry.trust_entry(bus, subjects, args.node)
        enrolled = entry.identity if entry is not None else None
        sys.stderr.write(
            printable(f"{args.node} enrolled as {identity.summary(enrolled)}")
            + "\n"
            + printable(f"{args.node} claims   {identity.summary(claims)}")
            + "\n"
        )
        if not args.yes and not confirm(f"record what {args.node} claims as its identity?"):
            return fail(f"identity of {args.node} not recorded")
        await registry.confirm_identity(bus, subjects, args.node, claims, by="fleetctl")
    sys.stdout.write(f"identity of {args.node} recorded: {printable(identity.summary(claims))}\n")
    return 0


async def pending_record(bus: Bus, subjects: Subjects, node: str) -> NodeRecord:
    """The node's pending (or deregistered) record, whose keys an approval without a key
    chooses from, and whose registrations carried the identities."""
    try:
        record = await live.stored_record(bus, subjects, node)
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
    return record


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


async def cmd_reset_seq(args: argparse.Namespace) -> int:
    async with connected(args, "fleetctl") as bus:
        await registry.reset_seq(bus, Subjects(args.prefix), args.node)
    sys.stdout.write(f"{args.node}: its next valid heartbeat is accepted whatever its seq\n")
    return 0


def add_parsers(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``keys``, ``approve``, ``revoke`` and ``reset-seq``."""
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
        "its fingerprint and the identity it registered with (host name, GPUs) and approved "
        "once confirmed; that identity becomes the node's enrolled identity, the one hooks "
        "act on. When several keys registered the name (anyone may register any name), each "
        "is shown and none is approved: give KEY. With --identity, what the approved node "
        "claims now is recorded as its identity instead.",
    )
    approve.add_argument("node", type=token("node id"), help="the node's id")
    approve.add_argument(
        "--identity",
        action="store_true",
        help="record the host name and GPUs the approved node claims now as its enrolled "
        "identity (after a hardware change; the remediation policy runs no hook for a node "
        "whose claims differ from it until then)",
    )
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
        "registered the name: give KEY); with --identity, record it without asking",
    )
    add_server(approve)
    approve.set_defaults(func=cmd_approve)

    revoke = commands.add_parser("revoke", help="revoke a node's approved key")
    revoke.add_argument("node", type=token("node id"), help="the node's id")
    add_server(revoke)
    revoke.set_defaults(func=cmd_revoke)

    reset_seq = commands.add_parser(
        "reset-seq", help="accept a node's next heartbeat whatever its seq (re-imaged node)"
    )
    reset_seq.add_argument("node", type=token("node id"), help="the node's id")
    add_server(reset_seq)
    reset_seq.set_defaults(func=cmd_reset_seq)
