"""Rolling operations by selector: ``fleetctl cordon|drain|uncordon|deploy -l KEY=VALUE
--max-unavailable N`` works through the matching nodes, at most N at a time.

Nodes are taken in node-id order. Each gets its own signed command, and its slot is freed
only by the node's final result (for a drain: once its work finished or its deadline
passed; a deploy: once the workload is ready or failed). The first failure (a rejection,
a failed command, no final result in time, a drain whose deadline passed with requests
in flight or placed workloads the fleet had not moved) stops new commands; those already
sent are followed to their end; ``--continue`` goes on instead. Each result is printed
as it comes, with the time (UTC) and the node; one summary line ends the run (``2 of 2
drained, 1 with placed work not moved by the deadline (n3)``), and the exit status is 1
when a node failed, 3 when one left work, else 0. Nodes already in the target state (for
a deploy: running that workload ready) are skipped, so running the same command again
resumes where it stopped. ``--dry-run`` lists the nodes in order and sends nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Sequence

from actors.cli.common import connected, default_operator_key
from actors.cli.fleetctl.send import (
    EXIT_DONE,
    EXIT_FAILED,
    EXIT_LEFT_IN_FLIGHT,
    ResultFollower,
    action_of,
    cmd_send,
    describe,
)
from actors.cli.fleetctl.signer import check_signer
from actors.cli.node_names import did_you_mean, expand_nodes
from actors.cli.parsing import fail
from actors.fleet.labels import matches, parse_selectors
from actors.fleet.live import reader as live
from actors.fleet.operator.commands import new_command, publish_command
from actors.runtime import spans
from actors.runtime.bus import Bus
from actors.runtime.spans import clock
from actors.runtime.subscriptions import listening
from schemas import codec, signing
from schemas.errors import FleetError
from schemas.messages import CommandResult, NodeRecord, command_digest
from schemas.subjects import Subjects

DONE_STATES = {
    "cordon": ("cordoned", "draining", "drained"),
    "drain": ("drained",),
    "uncordon": ("schedulable",),
}
"""Schedulability in which a node needs nothing more (skipped: the resume)."""


def targets(records: Sequence[NodeRecord], args: argparse.Namespace) -> list[NodeRecord]:
    """The nodes the selector (labels, the node list, --cluster) names, in node-id order."""
    selectors = parse_selectors(args.label)
    listed = set(args.nodes)
    return sorted(
        (
            record
            for record in records
            if not record.deregistered
            and (args.cluster is None or record.cluster == args.cluster)
            and (not listed or record.node_id in listed)
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


DONE_WORDS = {
    "cordon": "cordoned",
    "drain": "drained",
    "uncordon": "uncordoned",
    "deploy": "deployed",
}
"""What a node that reached its final ``done`` result is, per command."""


def say(node: str, text: str) -> None:
    """One progress line: the time (UTC), the node, what happened."""
    sys.stdout.write(f"{clock(time.time())} {node}: {text}\n")
    sys.stdout.flush()


class Rollout:
    """Sends the commands, at most ``limit`` unfinished at once, and tells how each node
    ended: done, done with work left (in flight, or placed workloads the fleet did not
    move by the deadline), or failed."""

    def __init__(self, bus: Bus, args: argparse.Namespace, key: signing.KeyPair) -> None:
        self.bus = bus
        self.args = args
        self.key = key
        self.subjects = Subjects(args.prefix)
        self.done: list[str] = []
        self.not_moved: list[str] = []
        self.in_flight: list[str] = []
        self.failed: list[str] = []
        self.stopped = False

    async def one(self, record: NodeRecord, slots: asyncio.Semaphore) -> None:
        args = self.args
        node, cluster = record.node_id, record.cluster
        final: CommandResult | None = None
        follower: ResultFollower | None = None
        try:
            command = new_command(node, cluster, action_of(args), args.reason, args.expires)
            digest = command_digest(codec.encode(command))
            follower = ResultFollower(self.bus, self.subjects, command.id, (cluster, node), digest)
            await follower.expect_key(node)
            routes = {self.subjects.result(cluster, node): follower.on_result}
            async with listening(self.bus, routes):
                await publish_command(self.bus, self.subjects, self.key, command)
                say(node, f"{args.command} sent (id {command.id})")
                work = getattr(args, "deadline", getattr(args, "ready_timeout", 0.0))
                timeout = args.timeout or work + 60.0
                final = await follower.until_final(
                    timeout, progress=lambda result: say(node, describe(result))
                )
            if final is None:
                say(node, f"no final result within {timeout:g}s")
        except FleetError as exc:
            say(node, str(exc))
        finally:
            slots.release()
        if final is None or follower is None or final.status != "done":
            self.failed.append(node)
        else:
            self.done.append(node)
            if follower.placed_left:
                self.not_moved.append(node)
            if follower.left_over:
                self.in_flight.append(node)
        if node in self.failed or node in self.not_moved or node in self.in_flight:
            self.stopped = not args.keep_going

    def summary(self, total: int, started: int) -> str:
        """``2 of 2 drained, 1 with placed work not moved by the deadline (n3)``."""
        parts = [f"{len(self.done)} of {total} {DONE_WORDS[self.args.command]}"]
        for nodes, what in (
            (self.not_moved, "with placed work not moved by the deadline"),
            (self.in_flight, "with requests in flight at the deadline"),
            (self.failed, "failed"),
        ):
            if nodes:
                parts.append(f"{len(nodes)} {what} ({', '.join(sorted(nodes))})")
        if total > started:
            parts.append(f"{total - started} not started (run it again to resume)")
        return ", ".join(parts)

    async def run(self, todo: list[NodeRecord]) -> int:
        """Every node of ``todo`` in order (stopping at the first that failed or left work,
        unless --continue); one summary line; 1 when a node failed, 3 when one left work
        (in flight, or placed and not moved), else 0."""
        slots = asyncio.Semaphore(self.args.max_unavailable)
        tasks = []
        for record in todo:
            await slots.acquire()
            if self.stopped:
                slots.release()
                break
            tasks.append(asyncio.create_task(self.one(record, slots)))
        await asyncio.gather(*tasks)
        line = f"{args_what(self.args)}: {self.summary(len(todo), len(tasks))}\n"
        if self.failed:
            sys.stderr.write(f"error: {line}")
            return EXIT_FAILED
        if self.not_moved or self.in_flight:
            sys.stderr.write(f"error: {line}")
            return EXIT_LEFT_IN_FLIGHT
        sys.stdout.write(line)
        return EXIT_DONE


def selector_text(args: argparse.Namespace) -> str:
    """The selector as given: ``-l K=V``, the node list, ``--cluster C``."""
    parts = [f"-l {label}" for label in args.label]
    parts += [args.node] if args.nodes else []
    parts += [f"--cluster {args.cluster}"] if args.cluster else []
    return " ".join(parts)


def args_what(args: argparse.Namespace) -> str:
    return f"rolling {args.command} {selector_text(args)}"


async def cmd_rolling(args: argparse.Namespace) -> int:
    """``cordon|drain|uncordon -l ...``: see the module docstring."""
    subjects = Subjects(args.prefix)
    async with connected(args, "fleetctl") as bus:
        records = await live.read_fleet(bus, subjects)
        chosen = targets(records, args)
        known = [record.node_id for record in records]
        unknown = sorted(set(args.nodes) - set(known))
        if unknown:
            hint = did_you_mean(unknown[0], known)
            return fail(f"no such node: {', '.join(unknown)}{hint}")
        if not chosen:
            return fail(f"no node matches {selector_text(args)}")
        todo = [record for record in chosen if not done_already(record, args)]
        if args.dry_run:
            now = time.time()
            # By name: searching the list for each record was quadratic (0.18 s at 5,000
            # nodes, about 75 s at 100,000).
            left = {record.node_id for record in todo}
            for record in chosen:
                skip = "" if record.node_id in left else "  (skip: already done)"
                seen = spans.age(now - record.last_seen) if record.last_seen else "never"
                sys.stdout.write(
                    f"{record.node_id}  {record.cluster}  {record.state}  seen {seen}{skip}\n"
                )
            return EXIT_DONE
        key = signing.load_key_file(args.key_file or default_operator_key())
        await check_signer(bus, subjects, key, args)
        skipped = len(chosen) - len(todo)
        sys.stdout.write(
            f"{args_what(args)}: {len(todo)} nodes, at most {args.max_unavailable} at a time"
            + (f" ({skipped} already done: skipped)" if skipped else "")
            + "\n"
        )
        return await Rollout(bus, args, key).run(todo)


async def cmd_one_or_rolling(args: argparse.Namespace) -> int:
    """``cordon|drain|uncordon|deploy``: one node, or every node a selector names, rolling:
    ``-l`` labels, a node list or range (``node[1-4],gpu-a``), or (but for a deploy,
    where it places) ``--cluster`` alone."""
    listed = expand_nodes(args.node) if args.node else []
    args.nodes = listed if len(listed) > 1 else []
    if args.label and listed:
        return fail("give a node or -l KEY=VALUE, not both", 2)
    if args.label or args.nodes or (args.cluster and not listed):
        return await cmd_rolling(args)
    if not listed:
        return fail(
            "a node id (node-1, or a list: node[1-4],gpu-a), -l KEY=VALUE or --cluster C is needed",
            2,
        )
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
        help="every node with these labels instead of one node (repeatable: all must match; "
        "--cluster C alone selects every node of the cluster)",
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
