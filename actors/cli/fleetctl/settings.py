"""``fleetctl settings set|unset|get|diff|history|rollback``: the fleet's signed settings
for every node, a cluster or a label selector (KV ``fleet_settings``; what a node makes
of them: actors/node/settings/, docs/settings.md "Fleet settings").

Every change writes the scope's whole entry again, signed by the operator key, at a
revision above every one the bucket holds, by compare-and-set on the key (two operators
changing one scope at once: the second is told to run it again). ``rollback`` writes an
earlier revision's values as a new revision, so nodes that took the later one take it.
"""

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
from actors.cli.parsing import fail
from actors.cli.render import tables
from actors.fleet import labels as fleet_labels
from actors.fleet.storage import settings as store
from actors.node.settings.effective import value_refusal
from actors.runtime.spans import clock
from schemas import signing
from schemas.errors import FleetError
from schemas.settings import (
    FLEET_KEY,
    MAX_SETTINGS,
    Scope,
    SettingsEntry,
    entry_key,
    selector_text,
)
from schemas.subjects import Subjects


def scope_of(args: argparse.Namespace) -> SettingsEntry:
    """The scope ``-l`` or ``--cluster`` names (neither: the whole fleet), as an empty entry."""
    selector = dict(fleet_labels.parse_selectors(args.label or []))
    if selector and args.cluster:
        raise FleetError("one scope at a time: -l KEY=VALUE or --cluster CLUSTER")
    scope: Scope = "selector" if selector else "cluster" if args.cluster else "fleet"
    return SettingsEntry(
        scope=scope,
        revision=1,
        issued_at=time.time(),
        cluster=args.cluster or "",
        selector=selector,
        reason=getattr(args, "reason", ""),
    )


def scope_text(key: str, entry: SettingsEntry | None = None) -> str:
    """``fleet``, ``cluster gpu-a``, ``selector pool=inference`` (the key when unknown)."""
    if entry is not None and entry.scope == "cluster":
        return f"cluster {entry.cluster}"
    if entry is not None and entry.scope == "selector":
        return f"selector {selector_text(entry.selector)}"
    return "fleet" if key == FLEET_KEY else key


def parse_values(pairs: list[str]) -> dict[str, str]:
    """``KEY=VALUE`` arguments, each checked as every node would check it."""
    values: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise FleetError(f"{pair!r} is not KEY=VALUE")
        why = value_refusal(key, value)
        if why:
            raise FleetError(f"{key}: {why}")
        values[key] = value
    if len(values) > MAX_SETTINGS:
        raise FleetError(f"at most {MAX_SETTINGS} settings in one scope")
    return values


def changes(before: dict[str, str], after: dict[str, str]) -> list[str]:
    """What goes from ``before`` to ``after``, one line a key: ``+ k v``, ``- k v``,
    ``~ k old -> new``."""
    lines = []
    for key in sorted(before.keys() | after.keys()):
        old, new = before.get(key), after.get(key)
        if old == new:
            continue
        if old is None:
            lines.append(f"+ {key} {new}")
        elif new is None:
            lines.append(f"- {key} {old}")
        else:
            lines.append(f"~ {key} {old} -> {new}")
    return lines


def _values(stored: store.StoredEntry | None) -> dict[str, str]:
    return dict(stored.entry.values) if stored is not None and stored.entry else {}


async def _write(args: argparse.Namespace, draft: SettingsEntry, verb: str) -> int:
    signer = operator_key(args)
    async with connected(args, "fleetctl") as bus:
        entry, kept = await store.put(bus, Subjects(args.prefix), signer, draft)
    lines = changes(_values(store.newest(kept)), dict(entry.values)) or ["(no change)"]
    sys.stdout.write(
        f"settings {scope_text(entry_key(entry), entry)}: {verb} revision {entry.revision}\n"
        + "".join(f"  {line}\n" for line in lines)
    )
    return 0


async def _newest(args: argparse.Namespace, key: str) -> store.StoredEntry | None:
    async with connected(args, "fleetctl") as bus:
        return store.newest(await store.history(bus, Subjects(args.prefix), key))


async def cmd_set(args: argparse.Namespace) -> int:
    scope = scope_of(args)
    given = parse_values(args.values)
    values = {**_values(await _newest(args, entry_key(scope))), **given}
    return await _write(args, _with(scope, values), "wrote")


async def cmd_unset(args: argparse.Namespace) -> int:
    scope = scope_of(args)
    values = _values(await _newest(args, entry_key(scope)))
    missing = [key for key in args.keys if key not in values]
    if missing:
        return fail(f"{scope_text(entry_key(scope), scope)} does not set {', '.join(missing)}")
    kept = {key: value for key, value in values.items() if key not in args.keys}
    return await _write(args, _with(scope, kept), "wrote")


def _with(scope: SettingsEntry, values: dict[str, str]) -> SettingsEntry:
    return SettingsEntry(
        scope=scope.scope,
        revision=1,
        issued_at=time.time(),
        values=values,
        cluster=scope.cluster,
        selector=scope.selector,
        reason=scope.reason,
    )


async def cmd_get(args: argparse.Namespace) -> int:
    async with connected(args, "fleetctl") as bus:
        found = await store.current(bus, Subjects(args.prefix))
    if args.label or args.cluster:
        key = entry_key(scope_of(args))
        found = [stored for stored in found if stored.key == key]
    if args.json:
        sys.stdout.write(json.dumps([store.as_json(stored) for stored in found]) + "\n")
        return 0
    if not found:
        sys.stdout.write("no fleet settings\n")
        return 0
    rows = [("SCOPE", "KEY", "VALUE", "REVISION", "SIGNED BY")]
    for stored in sorted(found, key=lambda stored: stored.key):
        scope = scope_text(stored.key, stored.entry)
        if stored.entry is None:
            rows.append((scope, "-", f"(ignored by nodes: {stored.problem})", "-", _signer(stored)))
            continue
        for key, value in sorted(stored.entry.values.items()) or [("-", "(none)")]:
            rows.append(
                (scope, key, tables.printable(value), str(stored.entry.revision), _signer(stored))
            )
    sys.stdout.write("\n".join(tables.grid(rows, indent="")) + "\n")
    return 0


def _signer(stored: store.StoredEntry) -> str:
    return signing.fingerprint(stored.signer) if stored.signer else "-"


async def cmd_history(args: argparse.Namespace) -> int:
    key = entry_key(scope_of(args))
    async with connected(args, "fleetctl") as bus:
        kept = await store.history(bus, Subjects(args.prefix), key)
    if args.json:
        sys.stdout.write(json.dumps([store.as_json(stored) for stored in kept]) + "\n")
        return 0
    if not kept:
        sys.stdout.write(f"no settings for {scope_text(key, scope_of(args))}\n")
        return 0
    rows = [("REVISION", "WRITTEN", "SIGNED BY", "VALUES", "REASON")]
    for stored in kept:
        entry = stored.entry
        if entry is None:
            rows.append(("-", clock(stored.stored), _signer(stored), stored.problem, "-"))
            continue
        values = ", ".join(f"{k}={v}" for k, v in sorted(entry.values.items())) or "(none)"
        rows.append(
            (
                str(entry.revision),
                clock(entry.issued_at),
                _signer(stored),
                tables.printable(values),
                tables.printable(entry.reason) or "-",
            )
        )
    sys.stdout.write("\n".join(tables.grid(rows, indent="")) + "\n")
    return 0


def _target(kept: list[store.StoredEntry], to: int | None) -> store.StoredEntry:
    """The kept entry ``rollback`` goes back to: revision ``to``, else the one before the
    newest."""
    valid = sorted(
        (stored for stored in kept if stored.entry is not None),
        key=lambda stored: stored.entry.revision if stored.entry else 0,
    )
    if to is None:
        if len(valid) < 2:
            raise FleetError("no earlier revision kept to roll back to")
        return valid[-2]
    for stored in valid:
        if stored.entry is not None and stored.entry.revision == to:
            return stored
    kept_revisions = ", ".join(str(s.entry.revision) for s in valid if s.entry) or "none"
    raise FleetError(f"revision {to} is not kept (kept: {kept_revisions})")


async def cmd_rollback(args: argparse.Namespace) -> int:
    scope = scope_of(args)
    async with connected(args, "fleetctl") as bus:
        kept = await store.history(bus, Subjects(args.prefix), entry_key(scope))
    target = _target(kept, args.to)
    assert target.entry is not None
    reason = args.reason or f"rollback to revision {target.entry.revision}"
    draft = msgspec.structs.replace(_with(scope, dict(target.entry.values)), reason=reason)
    return await _write(args, draft, "rolled back to")


async def cmd_diff(args: argparse.Namespace) -> int:
    scope = scope_of(args)
    async with connected(args, "fleetctl") as bus:
        kept = await store.history(bus, Subjects(args.prefix), entry_key(scope))
    before = _values(store.newest(kept))
    if args.to is not None:
        after = _values(_target(kept, args.to))
    else:
        after = {**before, **parse_values(args.values)}
        for key in args.unset or []:
            after.pop(key, None)
    lines = changes(before, after)
    sys.stdout.write(
        f"settings {scope_text(entry_key(scope), scope)}:\n"
        + "".join(f"  {line}\n" for line in lines or ["(no change)"])
    )
    return 0


def _add_scope(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-l",
        "--label",
        action="append",
        help="the scope of nodes with this label, KEY=VALUE (repeatable: all must match)",
    )
    parser.add_argument("--cluster", type=token("cluster"), help="the scope of one cluster")
    add_server(parser)


def _add_signing(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--key-file",
        type=Path,
        default=None,
        help=f"operator key that signs the entry (env {KEY_FILE_ENV}; default "
        f"{default_operator_key()})",
    )
    parser.add_argument("--reason", default="", help="why, kept with the revision")


def add_parsers(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``settings`` and its subcommands."""
    parser = commands.add_parser(
        "settings",
        help="settings for every node, a cluster or a label selector, signed",
        description="Settings the fleet pushes to its nodes: for every node (no scope flag), "
        "one cluster (--cluster) or the nodes whose labels match (-l). A node takes a value "
        "signed by an operator key it trusts, checks it with its own config's rules and "
        "applies it live or at its next start; its heartbeat says which it took, from "
        "where, and which it refused and why (fleetctl describe NODE). Precedence: the "
        "node's file < fleet < cluster < selector < the node's environment and flags. "
        "Only tuning can be set: docs/settings.md lists which.",
    )
    subs = parser.add_subparsers(dest="settings_command", required=True)
    set_ = subs.add_parser("set", help="set values of a scope (its other values stay)")
    set_.add_argument("values", nargs="+", metavar="KEY=VALUE", help="e.g. heartbeat_interval=10s")
    _add_scope(set_)
    _add_signing(set_)
    set_.set_defaults(func=cmd_set)
    unset = subs.add_parser("unset", help="remove values from a scope (nodes go back to theirs)")
    unset.add_argument("keys", nargs="+", metavar="KEY", help="e.g. heartbeat_interval")
    _add_scope(unset)
    _add_signing(unset)
    unset.set_defaults(func=cmd_unset)
    get = subs.add_parser("get", help="the values of every scope, or of one")
    get.add_argument("--json", action="store_true", help="the entries as JSON")
    _add_scope(get)
    get.set_defaults(func=cmd_get)
    diff = subs.add_parser(
        "diff", help="what set (KEY=VALUE, --unset) or rollback (--to) would change; writes nothing"
    )
    diff.add_argument("values", nargs="*", metavar="KEY=VALUE", help="values set would write")
    diff.add_argument("--unset", action="append", metavar="KEY", help="a key unset would remove")
    diff.add_argument("--to", type=int, help="the kept revision rollback --to would go back to")
    _add_scope(diff)
    diff.set_defaults(func=cmd_diff)
    history = subs.add_parser("history", help="a scope's kept revisions, oldest first")
    history.add_argument("--json", action="store_true", help="the revisions as JSON")
    _add_scope(history)
    history.set_defaults(func=cmd_history)
    rollback = subs.add_parser(
        "rollback", help="write an earlier revision's values again, as a new revision"
    )
    rollback.add_argument(
        "--to", type=int, help="the revision to go back to (default: the one before the latest)"
    )
    _add_scope(rollback)
    _add_signing(rollback)
    rollback.set_defaults(func=cmd_rollback)
