"""fleetctl's contexts, as kubeconfig's: named fleets (server, key file, TLS files, nkey,
prefix) in ``$XDG_CONFIG_HOME/fleetctl/config.toml`` (``~/.config/...``), the current
one chosen there (``fleetctl config use-context``) or by ``--context``.

A context is the lowest layer of a command's settings: flags beat ``FLEETCTL_*``
variables, which beat a ``--config`` file, which beats the context, which beats the
defaults. ``fleetctl aggregator`` does not read contexts (a service's settings must not
follow an operator's current context).
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import sys
from pathlib import Path

import msgspec

from actors.cli.common import KEY_FILE_ENV, contexts_path
from actors.cli.parsing import fail
from actors.runtime.atomic_file import write_atomically
from actors.runtime.config import ConfigError, read_toml

DEFAULT_PREFIX = "fleet"
CURRENT_KEY = "current-context"
_CURRENT_LINE = re.compile(r"(?m)^\s*current-context\s*=.*$\n?")


class Context(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One named fleet: where it is and which operator key acts on it."""

    server: str | None = None
    key_file: str | None = None
    nkey_file: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    prefix: str | None = None


class ContextsFile(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The file: ``current-context = "NAME"`` and a ``[contexts.NAME]`` table each."""

    current_context: str = msgspec.field(default="", name=CURRENT_KEY)
    contexts: dict[str, Context] = {}


def read_file(path: Path | None = None) -> ContextsFile:
    """The contexts file; an empty one when it does not exist; ConfigError naming the
    file and the bad key when it is malformed."""
    path = path or contexts_path()
    if not path.exists():
        return ContextsFile()
    try:
        return msgspec.convert(read_toml(path), ContextsFile)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def chosen(name: str | None, path: Path | None = None) -> tuple[str, Context]:
    """The context ``--context`` names, else the file's current one; ("", empty) when
    there is neither. An unknown name is an error that lists the known ones."""
    path = path or contexts_path()
    found = read_file(path)
    wanted = name if name is not None else found.current_context
    if not wanted:
        return "", Context()
    if wanted not in found.contexts:
        raise ConfigError(f"no context {wanted!r} in {path}{suggestion(wanted, found)}")
    return wanted, found.contexts[wanted]


def suggestion(name: str, found: ContextsFile) -> str:
    """``; did you mean 'prod'?`` (difflib), else the names there are."""
    close = difflib.get_close_matches(name, list(found.contexts), n=1)
    if close:
        return f"; did you mean {close[0]!r}?"
    return f" (contexts: {', '.join(sorted(found.contexts)) or 'none'})"


def _path(text: str | None) -> str | None:
    return None if text is None else os.path.expanduser(text)


def apply(args: argparse.Namespace) -> None:
    """Put the chosen context under the command's own settings: ``args.context_settings``
    (read by :func:`actors.cli.common.settings_from` as its lowest layer), ``args.prefix``
    unless ``--prefix`` was given, ``args.key_file`` unless ``--key-file`` or
    FLEETCTL_KEY_FILE was."""
    _, context = chosen(getattr(args, "context", None))
    settings = {
        "server": context.server,
        "nkey_file": _path(context.nkey_file),
        "tls_ca": _path(context.tls_ca),
        "tls_cert": _path(context.tls_cert),
        "tls_key": _path(context.tls_key),
    }
    args.context_settings = {key: value for key, value in settings.items() if value is not None}
    if hasattr(args, "prefix") and args.prefix is None:
        args.prefix = context.prefix or DEFAULT_PREFIX
    if hasattr(args, "key_file") and args.key_file is None and not os.environ.get(KEY_FILE_ENV):
        key_file = _path(context.key_file)
        args.key_file = Path(key_file) if key_file else None


async def cmd_get_contexts(args: argparse.Namespace) -> int:
    """Every context, the current one starred, as kubectl config get-contexts."""
    found = read_file()
    if args.output == "json":
        body = msgspec.to_builtins(found)
        sys.stdout.write(json.dumps(body, sort_keys=True) + "\n")
        return 0
    rows = [("CURRENT", "NAME", "SERVER", "PREFIX", "KEY FILE")]
    for name, context in sorted(found.contexts.items()):
        rows.append(
            (
                "*" if name == found.current_context else "",
                name,
                context.server or "-",
                context.prefix or DEFAULT_PREFIX,
                context.key_file or "-",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        sys.stdout.write("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
        sys.stdout.write("\n")
    return 0


async def cmd_current_context(args: argparse.Namespace) -> int:
    name = read_file().current_context
    if not name:
        return fail(f"current-context is not set in {contexts_path()}")
    sys.stdout.write(name + "\n")
    return 0


async def cmd_use_context(args: argparse.Namespace) -> int:
    """Set the file's current-context to NAME, which must exist; the rest of the file
    (comments included) is kept as written."""
    path = contexts_path()
    found = read_file(path)
    if args.name not in found.contexts:
        return fail(f"no context {args.name!r} in {path}{suggestion(args.name, found)}")
    text = _CURRENT_LINE.sub("", path.read_text())
    line = f"{CURRENT_KEY} = {json.dumps(args.name)}\n"
    try:
        write_atomically(path, (line + text).encode())
    except OSError as exc:
        return fail(f"cannot write {path}: {exc.strerror or exc}")
    sys.stdout.write(f'Switched to context "{args.name}".\n')
    return 0


CONTEXT_FIELDS = tuple(field.name for field in msgspec.structs.fields(Context))
CONTEXT_HELP = {
    "server": "NATS URL(s), comma-separated",
    "key_file": "the operator key that signs commands",
    "nkey_file": "the NATS user nkey seed",
    "tls_ca": "CA bundle the server's certificate is checked against",
    "tls_cert": "client certificate",
    "tls_key": "client certificate's key",
    "prefix": f"subject prefix, default {DEFAULT_PREFIX}",
}


def toml_text(found: ContextsFile) -> str:
    """The file as TOML (every value a string, each quoted as JSON, which TOML reads)."""
    lines = (
        [f"{CURRENT_KEY} = {json.dumps(found.current_context)}\n"] if found.current_context else []
    )
    for name, context in sorted(found.contexts.items()):
        key = name if re.fullmatch(r"[A-Za-z0-9_-]+", name) else json.dumps(name)
        lines.append(f"\n[contexts.{key}]\n")
        for field in CONTEXT_FIELDS:
            value = getattr(context, field)
            if value is not None:
                lines.append(f"{field} = {json.dumps(value)}\n")
    return "".join(lines)


def write_file(path: Path, found: ContextsFile) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, toml_text(found).encode())


def save_context(name: str, context: Context, path: Path | None = None) -> str:
    """Write context ``name`` (replacing one of that name), made the current one when the
    file names none (an operator's own current context is never switched); the line to
    print about it, which says why when the file could not be read or written."""
    path = path or contexts_path()
    try:
        found = read_file(path)
        current = found.current_context or name
        contexts = {**found.contexts, name: context}
        write_file(path, ContextsFile(current_context=current, contexts=contexts))
    except ConfigError as exc:
        return f"context {name!r} not written: {exc}"
    except OSError as exc:
        return f"context {name!r} not written: {path}: {exc.strerror or exc}"
    use = "current" if current == name else f"fleetctl config use-context {name}"
    return f"context: {name} in {path} ({use})"


async def cmd_set_context(args: argparse.Namespace) -> int:
    """Create context NAME, or change the settings given of an existing one (kubectl
    config set-context); ``--current`` makes it the current one too."""
    path = contexts_path()
    found = read_file(path)
    given = {field: getattr(args, field) for field in CONTEXT_FIELDS}
    changes = {field: str(value) for field, value in given.items() if value is not None}
    old = found.contexts.get(args.name, Context())
    contexts = {**found.contexts, args.name: msgspec.structs.replace(old, **changes)}
    current = args.name if args.current else found.current_context
    try:
        write_file(path, ContextsFile(current_context=current, contexts=contexts))
    except OSError as exc:
        return fail(f"cannot write {path}: {exc.strerror or exc}")
    verb = "modified" if args.name in found.contexts else "created"
    sys.stdout.write(f'Context "{args.name}" {verb}.\n')
    return 0


async def cmd_delete_context(args: argparse.Namespace) -> int:
    """Remove context NAME (and the current-context line if it named it)."""
    path = contexts_path()
    found = read_file(path)
    if args.name not in found.contexts:
        return fail(f"no context {args.name!r} in {path}{suggestion(args.name, found)}")
    contexts = {name: c for name, c in found.contexts.items() if name != args.name}
    current = "" if found.current_context == args.name else found.current_context
    try:
        write_file(path, ContextsFile(current_context=current, contexts=contexts))
    except OSError as exc:
        return fail(f"cannot write {path}: {exc.strerror or exc}")
    sys.stdout.write(f'Deleted context "{args.name}" from {path}.\n')
    return 0


def add_parsers(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    config = commands.add_parser(
        "config",
        help="contexts: named fleets in config.toml, as kubectl config",
        description=f"Contexts live in {contexts_path()} ($XDG_CONFIG_HOME respected): "
        f'{CURRENT_KEY} = "NAME" and one [contexts.NAME] table each, with server, '
        "key_file, nkey_file, tls_ca, tls_cert, tls_key and prefix. Flags beat FLEETCTL_* "
        "variables, which beat --config, which beats the context (docs/operations.md).",
    )
    subs = config.add_subparsers(dest="config_command", required=True)
    listing = subs.add_parser("get-contexts", help="list the contexts, the current one starred")
    listing.add_argument(
        "-o",
        "--output",
        choices=("table", "json"),
        default="table",
        help="table (default) or json (the whole file)",
    )
    listing.set_defaults(func=cmd_get_contexts)
    current = subs.add_parser("current-context", help="print the current context's name")
    current.set_defaults(func=cmd_current_context)
    use = subs.add_parser("use-context", help="make NAME the current context")
    use.add_argument("name", metavar="NAME", help="a context of the file")
    use.set_defaults(func=cmd_use_context)
    rewrites = " (rewrites the file: its comments are not kept)"
    setter = subs.add_parser(
        "set-context", help="create a context, or change the settings given of one" + rewrites
    )
    setter.add_argument("name", metavar="NAME", help="the context (created if new)")
    for field in CONTEXT_FIELDS:
        setter.add_argument(
            f"--{field.replace('_', '-')}",
            dest=field,
            help=f"the context's {field} ({CONTEXT_HELP[field]})",
        )
    setter.add_argument("--current", action="store_true", help="make it the current context too")
    setter.set_defaults(func=cmd_set_context)
    delete = subs.add_parser("delete-context", help="remove a context" + rewrites)
    delete.add_argument("name", metavar="NAME", help="a context of the file")
    delete.set_defaults(func=cmd_delete_context)
