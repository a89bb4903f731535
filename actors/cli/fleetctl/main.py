"""``fleetctl``: the operator's command line. Assembles the parser from the modules of
this package, one per group of subcommands, and runs the command chosen."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Coroutine
from typing import Any

import argcomplete

from actors.cli import completion
from actors.cli.common import add_version, parse, run_main, strict
from actors.cli.fleetctl import (
    aggregator,
    contexts,
    dashboard,
    enroll,
    gpus,
    maintenance,
    nats_config,
    placement,
    policy,
    rolling,
    send,
    settings,
    simulate,
    trust,
    up,
    views,
    workloads,
)

Command = Callable[[argparse.Namespace], Coroutine[Any, Any, int]]

GROUPS = (
    up,
    aggregator,
    trust,
    views,
    simulate,
    nats_config,
    send,
    workloads,
    rolling,
    placement,
    enroll,
    maintenance,
    settings,
    policy,
    dashboard,
    gpus,
    contexts,
)
"""fleetctl's groups of subcommands, in the order ``--help`` lists them. ``rolling`` and
``placement`` add options to commands made before them (``send``'s and ``workloads``')."""


def parser() -> argparse.ArgumentParser:
    root: argparse.ArgumentParser = completion.SuggestingParser(
        prog="fleetctl", description="operate a nats-node-agent fleet"
    )
    add_version(root)
    commands = root.add_subparsers(dest="command", required=True)
    for group in GROUPS:
        group.add_parsers(commands)
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
