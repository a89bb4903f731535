"""Rolling operations by selector: ``fleetctl cordon|drain|uncordon|deploy -l KEY=VALUE
--max-unavailable N`` works through the matching nodes, at most N at a time.

Nodes are taken in node-id order. Each gets its own signed command, and its slot is freed
only by the node's final result (for a drain: once its work finished or its deadline
passed; a deploy: once the workload is ready or failed). The first failure (a rejection,
a failed command, no final result in time, a drain whose deadline passed with work left)
stops new commands; those already sent are followed to their end; ``--continue`` goes on
instead. Nodes already in the target state (for a deploy: running that workload ready)
are skipped, so running the same command again resumes where it stopped. ``--dry-run``
lists the nodes in order and sends nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Sequence

from actors.cli.common import connected, default_operator_key, fail
from actors.cli.fleetctl.send import (
    EXIT_DONE,
    EXIT_FAILED,
    ResultFollower,
    action_of,
    cmd_send,
    describe,
)
from actors.fleet.labels import matches, parse_selectors
from actors.fleet.live import reader as live
from actors.fleet.operator.commands import new_command, publish_command
from actors.runtime import spans
from actors.runtime.bus import Bus, listening
from schemas import codec, signing
from schemas.errors import FleetError
from schemas.messages import NodeRecord, command_digest
from schemas.subjects import Subjects

DONE_STATES = {
    "cordon": ("cordoned", "draining", "drained"),
    "drain": ("drained",),
    "uncordon": ("schedulable",),
}
"""Schedulability in which a node needs nothing more (skipped: the resume)."""


def targets(records: Sequence[NodeRecord], args: argparse.Namespace) -> list[NodeRecord]:
    """The nodes the selector (and --cluster) names, in node-id order."""
    selectors = parse_selectors(args.label)
    return sorted(
        (
            record
            for record in records
            if not record.deregistered
            and (args.cluster is None or record.cluster == args.cluster)
            and matches(record.labels, selectors)
        ),
        key=lambda record: (record.node_id, record.cluster),
    )


def done_already(record: NodeRecord, args: argparse.Namespace) -> bool:
    if args.command == "deploy":
        beat = record.heartbeat
        return beat is not None and any(
            workload.name == args.name and workload.state == "ready" for workload in beat.workloads
        )
    return record.schedulability in DONE_STATES[args.command]


class Rollout:
    """Sends the commands, at most ``limit`` unfinished at once."""

    def __init__(self, bus: Bus, args: argparse.Namespace, key: signing.KeyPair) -> None:
        self.bus = bus
        self.args = args
        self.key = key
        self.subjects = Subjects(args.prefix)
        self.failed: list[str] = []
        self.stopped = False

    async def one(self, record: NodeRecord, slots: asyncio.Semaphore) -> None:
        args = self.args
        node, cluster = record.node_id, record.cluster
        try:
            command = new_command(node, cluster, action_of(args), args.reason, args.expires)
            digest = command_digest(codec.encode(command))
            follower = ResultFollower(self.bus, self.subjects, command.id, (cluster, node), digest)
            await follower.expect_key(node)
            routes = {self.subjects.result(cluster, node): follower.on_result}
            async with listening(self.bus, routes):
                await publish_command(self.bus, self.subjects, self.key, command)
                sys.stdout.write(f"{node}: {args.command} sent (id {command.id})\n")
                work = getattr(args, "deadline", getattr(args, "ready_timeout", 0.0))
                timeout = args.timeout or work + 60.0
                final = await follower.until_final(timeout, show=False)
            outcome = describe(final) if final else f"no final result within {timeout:g}s"
            ok = final is not None and follower.exit_status(final) == EXIT_DONE
        except FleetError as exc:
            outcome, ok = str(exc), False
        finally:
            slots.release()
        sys.stdout.write(f"{node}: {outcome}\n")
        sys.stdout.flush()
        if not ok:
            self.failed.append(node)
            self.stopped = not args.keep_going

    async def run(self, todo: list[NodeRecord]) -> int:
        slots = asyncio.Semaphore(self.args.max_unavailable)
        tasks = []
        for record in todo:
            await slots.acquire()
            if self.stopped:
                slots.release()
                break
            tasks.append(asyncio.create_task(self.one(record, slots)))
        await asyncio.gather(*tasks)
        if self.failed:
            left = len(todo) - len(tasks)
            tail = f"; {left} nodes not started (run it again to resume)" if left else ""
            failed = ", ".join(self.failed)
            sys.stderr.write(f"error: {args_what(self.args)} failed on {failed}{tail}\n")
            return EXIT_FAILED
        return EXIT_DONE


def args_what(args: argparse.Namespace) -> str:
    return f"rolling {args.command} -l {' -l '.join(args.label)}"


async def cmd_rolling(args: argparse.Namespace) -> int:
    """``cordon|drain|uncordon -l ...``: see the module docstring."""
    subjects = Subjects(args.prefix)
    async with connected(args, "fleetctl") as bus:
        chosen = targets(await live.read_fleet(bus, subjects), args)
        if not chosen:
            return fail(f"no node matches {' '.join(args.label)}")
        todo = [record for record in chosen if not done_already(record, args)]
        if args.dry_run:
            now = time.time()
            for record in chosen:
                skip = "" if record in todo else "  (skip: already done)"
                seen = spans.age(now - record.last_seen) if record.last_seen else "never"
                sys.stdout.write(
                    f"{record.node_id}  {record.cluster}  {record.state}  seen {seen}{skip}\n"
                )
            return EXIT_DONE
        key = signing.load_key_file(args.key_file or default_operator_key())
        skipped = len(chosen) - len(todo)
        sys.stdout.write(
            f"{args_what(args)}: {len(todo)} nodes, at most {args.max_unavailable} at a time"
            + (f" ({skipped} already done: skipped)" if skipped else "")
            + "\n"
        )
        return await Rollout(bus, args, key).run(todo)


async def cmd_one_or_rolling(args: argparse.Namespace) -> int:
    """``cordon|drain|uncordon|deploy``: one node, or (``-l``) every matching node, rolling."""
    if args.label and args.node:
        return fail("give a node or -l KEY=VALUE, not both", 2)
    if args.label:
        return await cmd_rolling(args)
    if not args.node:
        return fail("a node id or -l KEY=VALUE is needed", 2)
    return await cmd_send(args)


def add_parsers(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``-l`` and its options on cordon, drain, uncordon (added by send) and deploy (by
    workloads)."""
    for name in (*DONE_STATES, "deploy"):
        sub = commands.choices[name]
        add_rolling_options(sub)
        sub.set_defaults(func=cmd_one_or_rolling)


def add_rolling_options(sub: argparse.ArgumentParser) -> None:
    """``-l``, ``--max-unavailable``, ``--continue`` and ``--dry-run``."""
    sub.add_argument(
        "-l",
        "--label",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="every node with these labels instead of one node (repeatable: all must match)",
    )
    sub.add_argument(
        "--max-unavailable",
        type=positive_int,
        default=1,
        help="with -l: nodes in progress at once (default 1)",
    )
    sub.add_argument(
        "--continue",
        dest="keep_going",
        action="store_true",
        help="with -l: go on past a failed node (default: stop at the first)",
    )
    sub.add_argument(
        "--dry-run", action="store_true", help="with -l: list the nodes in order, send nothing"
    )


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: must be 1 or more")
    return value
