"""Help at the keyboard: node names completed from the fleet (argcomplete, bash and zsh),
and "did you mean" for a mistyped subcommand or flag (difflib).

Completion runs in the shell's process on every Tab: it reads the node names within
COMPLETION_TIMEOUT and is silent on any failure (no server, no key, a bad setting),
offering nothing rather than an error or a wait.
"""

from __future__ import annotations

import argparse
import asyncio
import difflib
import logging
import re
import sys
from typing import Any, NoReturn

from actors.cli.common import CLIENT_ENV_PREFIX, ClientConfig, connected_to, settings_from
from actors.cli.fleetctl import contexts
from schemas.subjects import BUCKET_NODES, Subjects

COMPLETION_TIMEOUT = 1.5
"""Seconds a Tab may wait for the fleet's node names."""
MAX_COMPLETIONS = 1000
"""Names offered at most (a shell shows no more usefully)."""
NODE_DESTS = ("node",)
"""Arguments (positional ``NODE`` and ``--node``) completed with node names."""


def node_completer(prefix: str, parsed_args: argparse.Namespace, **_: Any) -> list[str]:
    """argcomplete's completer: the fleet's node ids starting with ``prefix``, read with
    the command's own server, prefix and context; [] on any failure or timeout."""
    logging.disable(logging.CRITICAL)  # nothing may reach the shell's terminal
    try:
        return asyncio.run(node_names(prefix, parsed_args))
    except Exception:  # completion offers nothing rather than fail at the prompt
        return []


async def node_names(prefix: str, args: argparse.Namespace) -> list[str]:
    """The node ids starting with ``prefix``; TimeoutError past COMPLETION_TIMEOUT."""
    from actors.runtime import kv  # NATS only for a Tab, not for every command's start

    async with asyncio.timeout(COMPLETION_TIMEOUT):
        contexts.apply(args)
        config = settings_from(args, ClientConfig, CLIENT_ENV_PREFIX)
        async with connected_to(config, "fleetctl-complete") as bus:
            values = await kv.latest_values(
                bus,
                Subjects(args.prefix).bucket_name(BUCKET_NODES),
                MAX_COMPLETIONS,
                COMPLETION_TIMEOUT,
                keep=lambda key: key.startswith(prefix),
            )
    return sorted(values)


def add_node_completers(root: argparse.ArgumentParser) -> None:
    """Every node argument of every subcommand of ``root`` completes node names."""
    for action in root._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                add_node_completers(sub)
        elif action.dest in NODE_DESTS:
            setattr(action, "completer", node_completer)  # noqa: B010 (argcomplete's hook)


class SuggestingParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors add the closest subcommand or flag:
    ``invalid choice: 'nodse' ...; did you mean 'nodes'?``."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}{self.suggestion(message)}\n")

    def suggestion(self, message: str) -> str:
        choice = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if choice:
            choices = re.findall(r"'([^']*)'", choice.group(2))
            return closest_hint(choice.group(1), choices)
        unknown = re.match(r"unrecognized arguments: (.*)", message)
        if unknown:
            flags = [word for word in unknown.group(1).split() if word.startswith("--")]
            if flags:
                return closest_hint(flags[0].split("=")[0], option_strings(self))
        return ""


def closest_hint(word: str, choices: list[str]) -> str:
    """``; did you mean 'json'?`` for the choice closest to ``word`` (difflib), else ""."""
    close = difflib.get_close_matches(word, choices, n=1)
    return f"; did you mean '{close[0]}'?" if close else ""


def option_strings(parser: argparse.ArgumentParser) -> list[str]:
    """Every flag of ``parser`` and of the subcommands under it."""
    found: list[str] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found.extend(option_strings(sub))
        elif action.help != argparse.SUPPRESS:
            found.extend(action.option_strings)
    return found
