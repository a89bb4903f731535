"""``fleetctl``: the operator's command line. Assembles the parser from the modules of
this package, one per group of subcommands, and runs the command chosen.

A command imports only the groups that make its parser (:data:`COMMANDS`): ``fleetctl
nodes`` does not load the aggregator, the simulator or ``fleetctl up``'s agents, and
``fleetctl --version`` loads none, nor asyncio or msgspec (argparse and
:mod:`actors.cli.parsing` answer it). ``--help``, completion and a mistyped command build
the whole parser, as :func:`parser` does for the tests and the reference docs.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Coroutine, Iterable, Mapping
from types import ModuleType
from typing import Any

from actors.cli import completion, lazy
from actors.cli.parsing import SuggestingParser, add_version, parse, strict

Command = Callable[[argparse.Namespace], Coroutine[Any, Any, int]]

GROUPS = (
    "up",
    "aggregator",
    "trust",
    "forget",
    "views",
    "events",
    "simulate",
    "nats_config",
    "send",
    "workloads",
    "rolling",
    "placement",
    "enroll",
    "maintenance",
    "settings",
    "policy",
    "dashboard",
    "gpus",
    "contexts",
)
"""fleetctl's groups of subcommands (modules of this package), in the order ``--help``
lists them. ``rolling`` and ``placement`` add options to commands made before them
(``send``'s and ``workloads``')."""

_SIGNED = ("send", "workloads", "rolling", "placement")
"""The groups that make and extend the signed commands: each needs the others' parsers."""

COMMANDS: Mapping[str, tuple[str, ...]] = {
    "up": ("up",),
    "aggregator": ("aggregator",),
    **dict.fromkeys(("keys", "approve", "revoke", "reset-seq"), ("trust",)),
    "forget": ("forget",),
    **dict.fromkeys(("nodes", "aggregators", "node", "watch", "describe"), ("views",)),
    "events": ("events",),
    "simulate": ("simulate",),
    "nats-config": ("nats_config",),
    **dict.fromkeys(
        ("cordon", "drain", "uncordon", "deregister", "command", "deploy", "stop"), _SIGNED
    ),
    **dict.fromkeys(("workloads", "undeploy"), _SIGNED),
    "enroll-token": ("enroll",),
    "maintenance": ("maintenance",),
    "settings": ("settings",),
    "policy": ("policy",),
    **dict.fromkeys(("ui-user", "dashboard"), ("dashboard",)),
    "gpus": ("gpus",),
    "config": ("contexts",),
}
"""Each command and the groups whose parsers make it (tests/cli/test_startup.py holds
this to what the groups add)."""


def group(name: str) -> ModuleType:
    return importlib.import_module(f"actors.cli.fleetctl.{name}")


def parser(groups: Iterable[str] = GROUPS) -> argparse.ArgumentParser:
    """The parser with the subcommands of ``groups`` (every group: the whole of fleetctl)."""
    root: argparse.ArgumentParser = SuggestingParser(
        prog="fleetctl", description="operate a nats-node-agent fleet"
    )
    add_version(root)
    commands = root.add_subparsers(dest="command", required=True)
    for name in groups:
        group(name).add_parsers(commands)
    completion.add_node_completers(root)
    return strict(root)


def groups_for(argv: list[str]) -> tuple[str, ...]:
    """The groups a command line needs: its command's, none for ``--version`` alone,
    every group for anything else (help, completion, a mistyped command)."""
    if "_ARGCOMPLETE" in os.environ or not argv:
        return GROUPS
    if argv == ["--version"]:
        return ()
    return COMMANDS.get(argv[0], GROUPS)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    for name in lazy.DEFERRED:
        lazy.defer(name)
    root = parser(groups_for(argv))
    if "_ARGCOMPLETE" in os.environ:
        import argcomplete  # a Tab's work, not every command's

        argcomplete.autocomplete(root)
    if not argv:
        root.print_help()
        return 0
    args = parse(root, argv)
    func: Command = args.func
    from actors.cli.common import run_main  # after parsing: --version needs neither
    from actors.cli.fleetctl import contexts

    async def entry() -> int:
        if args.command not in ("up", "aggregator", "config"):
            contexts.apply(args)
        return await func(args)

    return run_main(entry)
