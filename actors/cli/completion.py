"""Help at the keyboard: node names completed from the fleet (argcomplete, bash and zsh).
("Did you mean" for a mistyped subcommand or flag is :mod:`actors.cli.parsing`'s.)

Completion runs in the shell's process on every Tab: it reads the node names within
COMPLETION_TIMEOUT and is silent on any failure (no server, no key, a bad setting),
offering nothing rather than an error or a wait. Every parser marks its node arguments
(:func:`add_node_completers`), so what a Tab needs (asyncio, the client) is imported by
the Tab, not by every command's start.
"""

from __future__ import annotations

import argparse
from typing import Any

COMPLETION_TIMEOUT = 1.5
"""Seconds a Tab may wait for the fleet's node names."""
MAX_COMPLETIONS = 1000
"""Names offered at most (a shell shows no more usefully)."""
NODE_DESTS = ("node",)
"""Arguments (positional ``NODE`` and ``--node``) completed with node names."""


def node_completer(prefix: str, parsed_args: argparse.Namespace, **_: Any) -> list[str]:
    """argcomplete's completer: the fleet's node ids starting with ``prefix``, read with
    the command's own server, prefix and context; [] on any failure or timeout."""
    import asyncio
    import logging

    logging.disable(logging.CRITICAL)  # nothing may reach the shell's terminal
    try:
        return asyncio.run(node_names(prefix, parsed_args))
    except Exception:  # completion offers nothing rather than fail at the prompt
        return []


async def node_names(prefix: str, args: argparse.Namespace) -> list[str]:
    """The node ids starting with ``prefix``; TimeoutError past COMPLETION_TIMEOUT."""
    import asyncio

    from actors.cli.common import CLIENT_ENV_PREFIX, ClientConfig, connected_to, settings_from
    from actors.cli.fleetctl import contexts
    from actors.runtime import kv  # NATS only for a Tab, not for every command's start
    from schemas.subjects import BUCKET_NODES, Subjects

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
