"""``fleetctl enroll-token create|list|revoke``: operator-signed tokens for bulk enrollment
(:mod:`actors.fleet.operator.enroll` says what makes an aggregator honour one)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import msgspec

from actors.cli.common import (
    KEY_FILE_ENV,
    add_server,
    connected,
    default_operator_key,
    operator_key,
    token,
)
from actors.cli.render import tables
from actors.fleet.operator import enroll
from actors.runtime.bus import NotProvisioned
from actors.runtime.durations import DurationError, parse_duration
from actors.runtime.spans import clock
from schemas.errors import FleetError
from schemas.messages import EnrollRecord
from schemas.subjects import Subjects

DEFAULT_TTL = 86400.0


def ttl(text: str) -> float:
    """An argparse type: a token lifetime, above 0 and at most MAX_TTL."""
    try:
        seconds = parse_duration(text)
    except DurationError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not 0 < seconds <= enroll.MAX_TTL:
        raise argparse.ArgumentTypeError(
            f"{text!r}: must be above 0 and at most {enroll.MAX_TTL / 86400:.0f} days"
        )
    return seconds


def uses(text: str) -> int:
    try:
        count = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not 1 <= count <= enroll.MAX_USES:
        raise argparse.ArgumentTypeError(f"{text}: must be 1 to {enroll.MAX_USES}")
    return count


def not_provisioned() -> FleetError:
    return FleetError(
        "no enrollment bucket: start an aggregator (of this version) on this prefix first"
    )


async def cmd_create(args: argparse.Namespace) -> int:
    key = operator_key(args)
    token_text, record = enroll.issue(key, args.cluster or "", args.ttl, args.uses)
    async with connected(args, "fleetctl") as bus:
        try:
            await enroll.store(bus, Subjects(args.prefix), record)
        except NotProvisioned:
            raise not_provisioned() from None
    sys.stdout.write(f"{token_text}\n")
    scope = f"cluster {record.cluster}" if record.cluster else "any cluster"
    sys.stderr.write(
        f"token {record.id}: {record.uses} use(s), {scope}, expires "
        f"{clock(record.expires_at)}; aggregators honour it only with "
        f"--trust-operator {key.public_key}\n"
        "  on each node: node-agent start --enroll-token <token>\n"
    )
    return 0


def _row(record: EnrollRecord, now: float) -> tuple[str, ...]:
    if record.revoked:
        status = "revoked"
    elif now >= record.expires_at:
        status = "expired"
    elif record.used >= record.uses:
        status = "used up"
    else:
        status = "valid"
    return (
        record.id,
        record.cluster or "*",
        f"{record.used}/{record.uses}",
        clock(record.expires_at),
        status,
    )


async def cmd_list(args: argparse.Namespace) -> int:
    async with connected(args, "fleetctl") as bus:
        try:
            found = await enroll.records(bus, Subjects(args.prefix))
        except NotProvisioned:
            raise not_provisioned() from None
    if args.json:
        sys.stdout.write(json.dumps(msgspec.to_builtins(found)) + "\n")
        return 0
    now = time.time()
    rows = [("ID", "CLUSTER", "USED", "EXPIRES", "STATUS"), *(_row(r, now) for r in found)]
    sys.stdout.write("\n".join(tables.grid(rows, indent="")) + "\n")
    return 0


async def cmd_revoke(args: argparse.Namespace) -> int:
    async with connected(args, "fleetctl") as bus:
        try:
            record = await enroll.revoke(bus, Subjects(args.prefix), args.id)
        except NotProvisioned:
            raise not_provisioned() from None
    sys.stdout.write(
        f"revoked {record.id} ({record.used} node(s) enrolled with it keep their keys)\n"
    )
    return 0


def add_parsers(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``enroll-token`` and its three subcommands."""
    parser = commands.add_parser(
        "enroll-token", help="operator-signed tokens that admit nodes without hand approval"
    )
    subs = parser.add_subparsers(dest="enroll_command", required=True)
    create = subs.add_parser("create", help="sign a token and store its record; print it")
    create.add_argument(
        "--cluster", type=token("cluster"), help="admit only into this cluster (default any)"
    )
    create.add_argument(
        "--ttl", type=ttl, default=DEFAULT_TTL, help="lifetime, e.g. 24h, 7d (default 24h)"
    )
    create.add_argument("--uses", type=uses, default=1, help="nodes it may admit (default 1)")
    create.add_argument(
        "--key-file",
        type=Path,
        default=None,
        help=f"operator key that signs it (env {KEY_FILE_ENV}; default {default_operator_key()})",
    )
    add_server(create)
    create.set_defaults(func=cmd_create)
    listing = subs.add_parser("list", help="every token's record: uses, expiry, status")
    listing.add_argument("--json", action="store_true", help="the records as JSON")
    add_server(listing)
    listing.set_defaults(func=cmd_list)
    revoke = subs.add_parser("revoke", help="revoke a token (nodes it admitted stay)")
    revoke.add_argument("id", help="the token id (fleetctl enroll-token list)")
    add_server(revoke)
    revoke.set_defaults(func=cmd_revoke)
