"""``fleetctl cordon | drain | uncordon | deregister``: signed commands to one node, and
``fleetctl command ID``, which follows one sent earlier.

A command is signed with the operator key and published to the FLEET_CMD work queue with
``Nats-Msg-Id`` = its id (the server drops an accidental double publish, and fleetctl says
so and exits 1 rather than wait for a result that will never come), so a node that is down
gets it when it comes back. Absurd durations are refused before anything is sent (the node
checks again), and a warning comes first when the command will wait or go nowhere (unknown,
stale or offline node, another cluster). ``--wait`` follows the node's signed results: it
subscribes before publishing (no result can slip past), keeps only results on the node's
own result subject that verify against its approved key and name the digest of the exact
body sent, and exits with :data:`EXIT_STATUSES`. Without ``--wait`` the results are still
in FLEET_EVENTS, and ``fleetctl command`` replays and follows them.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Callable
from pathlib import Path

import nats.errors
from nats.aio.msg import Msg
from nats.js.api import DeliverPolicy

from actors.cli.common import (
    KEY_FILE_ENV,
    add_server,
    connected,
    default_operator_key,
    operator_key,
    stop_event,
    token,
)
from actors.cli.fleetctl.signer import add_signing_check, check_signer
from actors.cli.node_names import node_selection
from actors.cli.parsing import fail
from actors.cli.render import tables
from actors.fleet.live import reader as live
from actors.fleet.operator.commands import new_command, publish_command
from actors.fleet.storage import registry
from actors.runtime import spans
from actors.runtime.bus import Bus
from actors.runtime.durations import DurationError, parse_duration
from actors.runtime.subscriptions import listening, unsubscribe_quietly
from schemas import codec, signing
from schemas.errors import DecodeError, FleetError, InvalidToken, SignatureError
from schemas.messages import (
    FINAL_STATUSES,
    MAX_ACTION_SECONDS,
    SAFE_ID,
    Action,
    CommandResult,
    Cordon,
    Deregister,
    Drain,
    NodeRecord,
    Uncordon,
    command_digest,
)
from schemas.subjects import STREAM_EVENTS, Subjects

EXIT_DONE = 0
EXIT_FAILED = 1
EXIT_TIMEOUT = 2
EXIT_LEFT_IN_FLIGHT = 3
EXIT_INTERRUPTED = 130
EXIT_STATUSES = (
    "Exit status with --wait: 0 done, 1 failed or rejected, 2 no final result in time "
    "(or a usage error), 3 a drain whose deadline passed with work still in flight or "
    "placed workloads not moved, 130 interrupted (the command continues)."
)


async def results_key(bus: Bus, subjects: Subjects, node: str) -> str:
    """The node's approved public key: only results signed by it are believed."""
    entry = await registry.trust_entry(bus, subjects, node)
    if entry is None:
        raise FleetError(f"node {node} has no approved key; cannot verify its results")
    key = registry.approved_key(entry)
    if key is None:
        raise FleetError(f"node {node}'s key is revoked")
    return key


class ResultFollower:
    """Verified results of one command, in arrival order: on the node's own result subject,
    signed by its approved key, naming the command's id (or no id: a refusal of a message
    the node could not verify or read) and the digest of the body sent.

    Given no node, the first verified result naming the id says which node it is; given
    no digest, the first such result's digest is the command's (a re-attach has only the
    id; the node's result to the command sent comes before any later copy's). A node's
    rejection of a message signed by a key it does not trust names no id, only the id
    that message claims (``claimed_id``): a re-attach takes it as the command's, and
    shows who signed it."""

    def __init__(
        self,
        bus: Bus,
        subjects: Subjects,
        command_id: str,
        node: tuple[str, str] | None = None,
        digest: str = "",
    ) -> None:
        self.bus = bus
        self.subjects = subjects
        self.command_id = command_id
        self.node = node
        self.digest = digest
        self.keys: dict[str, str | None] = {}
        self.left_over: int | None = None
        """In flight when the drain ended (results of a drained node carry it)."""
        self.placed_left: int | None = None
        """Placed workloads the fleet had not moved off the node when the drain ended."""
        self.results: asyncio.Queue[CommandResult] = asyncio.Queue(maxsize=1024)

    async def expect_key(self, node: str) -> None:
        """Read the node's approved key now (an error before publishing if it has none)."""
        self.keys[node] = await results_key(self.bus, self.subjects, node)

    async def on_result(self, msg: Msg) -> None:
        try:
            node = self.subjects.split_result(msg.subject)
            if self.node not in (None, node):
                return
            signer = signing.verify(msg.headers, msg.data)
            if signer != await self._key_of(node[1]):
                return
            result = codec.decode(msg.data, CommandResult, msg.subject)
        except (InvalidToken, SignatureError, DecodeError):
            return
        claims = result.command_id == "" and result.claimed_id == self.command_id
        if (result.command_id == self.command_id or claims) and not self.digest:
            self.digest = result.command_digest
        named = result.command_id == self.command_id or (result.command_id == "" and self.digest)
        if (
            named
            and result.command_digest == self.digest
            and (result.cluster, result.node_id) == node
            and not self.results.full()
        ):
            self.node = node
            if result.schedulability == "drained" and result.in_flight is not None:
                self.left_over = result.in_flight
            if result.schedulability == "drained" and result.jobs_running:
                # Slurm jobs still running at the deadline were cut off like requests.
                self.left_over = (self.left_over or 0) + result.jobs_running
            if result.schedulability == "drained" and result.status in FINAL_STATUSES:
                self.placed_left = result.placed
            self.results.put_nowait(result)

    async def _key_of(self, node: str) -> str | None:
        if node not in self.keys:
            try:
                self.keys[node] = await results_key(self.bus, self.subjects, node)
            except (FleetError, nats.errors.Error):
                self.keys[node] = None
        return self.keys[node]

    async def until_final(
        self,
        timeout: float,
        show: bool = True,
        progress: Callable[[CommandResult], None] | None = None,
    ) -> CommandResult | None:
        """Print each result as a progress line (or hand it to ``progress``); the final
        one, or None at the timeout."""
        deadline = time.monotonic() + timeout
        interactive = show and sys.stdout.isatty()
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                async with asyncio.timeout(left):
                    result = await self.results.get()
            except TimeoutError:
                return None
            if progress is not None:
                progress(result)
            elif show:
                line = describe(result)
                if interactive and result.status not in FINAL_STATUSES:
                    sys.stdout.write("\r\x1b[K" + line)
                else:
                    sys.stdout.write(("\r\x1b[K" if interactive else "") + line + "\n")
                sys.stdout.flush()
            if result.status in FINAL_STATUSES:
                return result

    def exit_status(self, final: CommandResult) -> int:
        """0 done, 1 failed or rejected, 3 done with work still in flight or placed
        workloads not moved at the deadline."""
        if final.status != "done":
            return EXIT_FAILED
        return EXIT_LEFT_IN_FLIGHT if self.left_over or self.placed_left else EXIT_DONE


def describe(result: CommandResult) -> str:
    """One result as a line: its status and detail, the node's state and counts, and for
    a rejection who signed what the node refused (and the id a message claimed)."""
    facts: list[str] = [result.schedulability or ""]
    if result.in_flight is not None:
        facts.append(f"{result.in_flight} in flight")
    if result.jobs_running is not None:
        facts.append(f"{result.jobs_running} Slurm jobs running")
    if result.placed is not None:
        facts.append(f"{result.placed} placed workloads")
    if result.status == "rejected" and result.signer:
        facts.append(f"signed by {key_name(result.signer)}")
    if result.status == "rejected" and result.claimed_id:
        facts.append(f"a message claiming id {result.claimed_id}")
    tail = ", ".join(fact for fact in facts if fact)
    detail = f": {result.detail}" if result.detail else ""
    return tables.printable(f"{result.status}{detail}" + (f" [{tail}]" if tail else ""))


def key_name(public_key: str) -> str:
    """A key as a node's result names it: its fingerprint, or the text if it is no key."""
    try:
        return signing.fingerprint(public_key)
    except ValueError:
        return tables.printable(public_key)


def action_of(args: argparse.Namespace) -> Action:
    build: Callable[[argparse.Namespace], Action] | None = getattr(args, "build_action", None)
    if build is not None:  # deploy, stop: built by actors.cli.fleetctl.workloads
        return build(args)
    if args.command == "cordon":
        return Cordon(ttl=args.ttl)
    if args.command == "drain":
        return Drain(deadline=args.deadline)
    if args.command == "deregister":
        return Deregister(deadline=args.deadline)
    return Uncordon()


def seconds(allow_zero: bool) -> Callable[[str], float]:
    """An argparse type: seconds above 0 (or from 0) up to MAX_ACTION_SECONDS, so an
    absurd, negative or non-finite value is a usage error (exit 2) before anything is
    sent; the node checks again."""
    floor = "0 or more" if allow_zero else "more than 0"

    def parse(text: str) -> float:
        try:
            value = parse_duration(text)
        except DurationError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        above = value >= 0 if allow_zero else value > 0
        if not (above and value <= MAX_ACTION_SECONDS):  # NaN fails both
            raise argparse.ArgumentTypeError(
                f"{text}: must be {floor} and at most {MAX_ACTION_SECONDS:.0f} seconds "
                f"({MAX_ACTION_SECONDS / 86400:.0f} days)"
            )
        return value

    return parse


def command_id(text: str) -> str:
    """An argparse type: what a node accepts as a command id."""
    if not SAFE_ID.fullmatch(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a command id")
    return text


POSITIVE = seconds(allow_zero=False)
NOT_NEGATIVE = seconds(allow_zero=True)


async def target_cluster(bus: Bus, subjects: Subjects, node: str, cluster: str | None) -> str:
    """The cluster to address ``node`` in: ``--cluster`` or its record's. Warns on stderr,
    before anything is sent, when the command will wait or go nowhere: a node with no
    record, a stale, offline or deregistered one, or one in another cluster than given."""
    try:
        record: NodeRecord | None = await live.stored_record(bus, subjects, node)
    except registry.NotFound:
        record = None
    if record is None:
        if cluster is None:
            raise FleetError(
                f"node {node} not found (--cluster C queues a command for it all the same)"
            )
        warn(
            f"node {node} is unknown (no record in fleet_nodes): the command waits in "
            f"cluster {cluster}'s queue until an agent of that name reads it"
        )
        return cluster
    if cluster is not None and cluster != record.cluster:
        warn(
            f"node {node} is in cluster {record.cluster}, not {cluster}: the command is "
            f"queued for {cluster}/{node}, which that node does not read"
        )
    if record.state in ("stale", "offline", "deregistered"):
        seen = spans.age(time.time() - record.last_seen) if record.last_seen else "never"
        warn(
            f"node {node} is {record.state} (last seen {seen}): the command waits in its "
            "queue until the node reads it"
        )
    return cluster or record.cluster


def warn(message: str) -> None:
    sys.stderr.write(f"warning: {message}\n")


def reattach_hint(args: argparse.Namespace, command_id: str, node: str | None) -> str:
    """The command line that follows ``command_id`` again."""
    where = f" --node {node}" if node else ""
    prefix = f" --prefix {args.prefix}" if args.prefix != "fleet" else ""
    return f"fleetctl command {command_id}{where}{prefix}"


async def follow(
    args: argparse.Namespace,
    follower: ResultFollower,
    timeout: float,
    what: str,
    stop: asyncio.Event,
) -> int:
    """Follow ``follower`` until a final result (its exit status), the timeout (2) or
    ``stop`` (Ctrl-C: 130, saying that the command continues and how to follow it again;
    made before publishing, so a Ctrl-C just after it is answered so too)."""
    waiting = asyncio.create_task(follower.until_final(timeout))
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({waiting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    node = follower.node[1] if follower.node else args.node
    if not waiting.done():
        waiting.cancel()
        hint = reattach_hint(args, follower.command_id, node)
        sys.stdout.write("\n" if sys.stdout.isatty() else "")
        sys.stderr.write(
            f"interrupted: stopped following {what}, which continues"
            + (f" on {node}" if node else "")
            + f"; follow it again with: {hint}\n"
        )
        return EXIT_INTERRUPTED
    final = waiting.result()
    if final is None:
        where = f"from {node} " if node else ""
        return fail(f"no final result {where}within {timeout:g}s", EXIT_TIMEOUT)
    return follower.exit_status(final)


async def cmd_send(args: argparse.Namespace) -> int:
    key = operator_key(args)
    subjects = Subjects(args.prefix)
    stop = stop_event()
    async with connected(args, "fleetctl") as bus:
        await check_signer(bus, subjects, key, args)
        cluster = await target_cluster(bus, subjects, args.node, args.cluster)
        command = new_command(args.node, cluster, action_of(args), args.reason, args.expires)
        sent = f"{args.command} sent: id={command.id} node={args.node}\n"
        if not args.wait:
            await publish_command(bus, subjects, key, command)
            sys.stdout.write(sent)
            sys.stderr.write(
                f"follow its results with: {reattach_hint(args, command.id, args.node)}\n"
            )
            return EXIT_DONE
        # Listening starts before the publish; msgspec encodes deterministically, so
        # this is the digest of the body publish_command sends.
        digest = command_digest(codec.encode(command))
        follower = ResultFollower(bus, subjects, command.id, (cluster, args.node), digest)
        await follower.expect_key(args.node)
        async with listening(bus, {subjects.result(cluster, args.node): follower.on_result}):
            await publish_command(bus, subjects, key, command)
            sys.stdout.write(sent)
            sys.stdout.flush()
            timeout = args.timeout or getattr(args, "deadline", 0.0) + 60.0
            return await follow(args, follower, timeout, f"{args.command} {command.id}", stop)


async def cmd_command(args: argparse.Namespace) -> int:
    """Re-attach to a command sent earlier: replay its results stored in FLEET_EVENTS,
    then follow new ones until a final one."""
    subjects = Subjects(args.prefix)
    wanted = f"{subjects.prefix}.result.{args.cluster or '*'}.{args.node or '*'}"
    stop = stop_event()
    async with connected(args, "fleetctl") as bus:
        follower = ResultFollower(bus, subjects, args.id)
        subscription = await bus.js.subscribe(
            wanted,
            cb=follower.on_result,
            stream=subjects.stream_name(STREAM_EVENTS),
            ordered_consumer=True,
            deliver_policy=DeliverPolicy.ALL,
        )
        try:
            return await follow(args, follower, args.timeout, f"command {args.id}", stop)
        finally:
            await unsubscribe_quietly(subscription)


def add_signed_command_options(sub: argparse.ArgumentParser) -> None:
    """The options every signed command to one node takes (``cordon`` ... and the
    workload commands): its cluster, the command's lifetime, the operator key, the server."""
    sub.add_argument(
        "--cluster", type=token("cluster"), help="the node's cluster (default: its record's)"
    )
    sub.add_argument(
        "--expires",
        type=POSITIVE,
        default=3600.0,
        help="seconds the command stays valid (default 3600)",
    )
    sub.add_argument(
        "--key-file",
        type=Path,
        default=None,
        help=f"operator key (env {KEY_FILE_ENV}; default {default_operator_key()})",
    )
    add_signing_check(sub)
    add_server(sub)


def add_parsers(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add cordon, drain, uncordon, deregister and command to fleetctl's subcommands."""
    helps = {
        "cordon": "stop scheduling work on a node",
        "drain": "cordon, then wait for in-flight work to finish",
        "uncordon": "make a node schedulable again",
        "deregister": "drain a node and remove it from the fleet; its agent exits",
    }
    for name, text in helps.items():
        sub = commands.add_parser(name, help=text, description=text + ". " + EXIT_STATUSES)
        if name == "deregister":
            sub.add_argument("node", type=token("node id"), help="the node's id")
        else:
            sub.add_argument(
                "node",
                nargs="?",
                type=node_selection,
                help="the node's id, or a list or range of them, rolling (node[1-4],gpu-a); "
                "or -l KEY=VALUE, or --cluster C",
            )
        sub.add_argument("--reason", default="", help="recorded with the node's state")
        if name == "cordon":
            sub.add_argument(
                "--ttl", type=POSITIVE, default=None, help="uncordon after S seconds (> 0)"
            )
        if name in ("drain", "deregister"):
            sub.add_argument(
                "--deadline",
                type=NOT_NEGATIVE,
                default=300.0,
                help="seconds in-flight work may take (default 300)",
            )
        sub.add_argument("--wait", action="store_true", help="follow the node's results")
        sub.add_argument(
            "--timeout", type=POSITIVE, default=None, help="--wait limit (default deadline + 60 s)"
        )
        add_signed_command_options(sub)
        sub.set_defaults(func=cmd_send)

    command = commands.add_parser(
        "command",
        help="follow a command sent earlier (its stored results, then new ones)",
        description="Re-attach to a command by its id. " + EXIT_STATUSES,
    )
    command.add_argument(
        "id", type=command_id, help="the id printed by cordon, drain, uncordon, deregister"
    )
    command.add_argument(
        "--node", type=token("node id"), help="the node it was sent to (default: found)"
    )
    command.add_argument("--cluster", type=token("cluster"), help="the node's cluster")
    command.add_argument(
        "--timeout",
        type=POSITIVE,
        default=60.0,
        help="seconds to wait for a final result (default 60s)",
    )
    add_server(command)
    command.set_defaults(func=cmd_command)
