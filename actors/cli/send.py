"""``fleetctl cordon | drain | uncordon | deregister``: signed commands to one node.

A command is signed with the operator key and published to the FLEET_CMD work queue with
``Nats-Msg-Id`` = its id (the server drops an accidental double publish, and fleetctl says
so and exits 1 rather than wait for a result that will never come), so a node that is down
gets it when it comes back. Absurd durations are refused before anything is sent (the node
checks again). ``--wait`` follows the node's signed results: it subscribes before
publishing (no result can slip past), keeps only results on the node's own result subject
that verify against its approved key and name the digest of the exact body sent, and exits
0 on done, 1 on failed or rejected, 2 when no final result comes in time.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid
from pathlib import Path

import nats.errors
from nats.aio.msg import Msg

from actors.cli.common import add_server, connected, default_operator_key, fail
from actors.fleet import registry
from actors.node.commands.checks import MAX_ACTION_SECONDS
from actors.runtime.bus import PUBLISH_TIMEOUT, Bus, listening
from schemas import codec, signing
from schemas.errors import DecodeError, FleetError, InvalidToken, SignatureError
from schemas.messages import (
    Action,
    Command,
    CommandResult,
    Cordon,
    Deregister,
    Drain,
    Uncordon,
    command_digest,
)
from schemas.signing import KeyPair
from schemas.subjects import Subjects

FINAL = ("done", "failed", "rejected")


def new_command(
    node: str, cluster: str, action: Action, reason: str = "", expires: float = 3600.0
) -> Command:
    now = time.time()
    return Command(
        id=uuid.uuid4().hex,
        node_id=node,
        cluster=cluster,
        action=action,
        issued_at=now,
        expires_at=now + expires,
        reason=reason,
    )


async def publish_command(bus: Bus, subjects: Subjects, key: KeyPair, command: Command) -> str:
    """Sign and publish ``command`` on its node's subject of FLEET_CMD; return the digest
    of the body sent, which the node's results name. A publish the stream drops as a
    duplicate of its id raises FleetError: no node will answer it."""
    body = codec.encode(command)
    headers = key.headers(body)
    headers["Nats-Msg-Id"] = command.id
    subject = subjects.command(command.cluster, command.node_id)
    try:
        ack = await bus.js.publish(subject, body, timeout=PUBLISH_TIMEOUT, headers=headers)
    except (nats.errors.Error, TimeoutError) as exc:
        raise FleetError(f"command not stored by JetStream: {exc or type(exc).__name__}") from None
    if ack.duplicate:
        raise FleetError(
            f"command id {command.id} was already published (JetStream dropped this copy as "
            "a duplicate): not sent again, no result will come for it"
        )
    return command_digest(body)


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
    signed by its approved key, naming the digest of the body sent and its id (or no id: a
    refusal of a message the node could not verify or read)."""

    def __init__(self, subjects: Subjects, command: Command, node_key: str, digest: str) -> None:
        self.subjects = subjects
        self.command = command
        self.node_key = node_key
        self.digest = digest
        self.results: asyncio.Queue[CommandResult] = asyncio.Queue(maxsize=1024)

    async def on_result(self, msg: Msg) -> None:
        node = (self.command.cluster, self.command.node_id)
        try:
            if self.subjects.split_result(msg.subject) != node:
                return
            if signing.verify(msg.headers, msg.data) != self.node_key:
                return
            result = codec.decode(msg.data, CommandResult, msg.subject)
        except (InvalidToken, SignatureError, DecodeError):
            return
        if (
            result.command_digest == self.digest
            and result.command_id in ("", self.command.id)
            and (result.cluster, result.node_id) == node
            and not self.results.full()
        ):
            self.results.put_nowait(result)

    async def until_final(self, timeout: float, show: bool = True) -> CommandResult | None:
        """Print each result as a progress line; the final one, or None at the timeout."""
        deadline = time.monotonic() + timeout
        interactive = show and sys.stdout.isatty()
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                result = await asyncio.wait_for(self.results.get(), left)
            except TimeoutError:
                return None
            if show:
                line = describe(result)
                if interactive and result.status not in FINAL:
                    sys.stdout.write("\r\x1b[K" + line)
                else:
                    sys.stdout.write(("\r\x1b[K" if interactive else "") + line + "\n")
                sys.stdout.flush()
            if result.status in FINAL:
                return result


def describe(result: CommandResult) -> str:
    facts: list[str] = [result.schedulability or ""]
    if result.in_flight is not None:
        facts.append(f"{result.in_flight} in flight")
    tail = ", ".join(fact for fact in facts if fact)
    detail = f": {result.detail}" if result.detail else ""
    return f"{result.status}{detail}" + (f" [{tail}]" if tail else "")


def action_of(args: argparse.Namespace) -> Action:
    if args.command == "cordon":
        return Cordon(ttl=args.ttl)
    if args.command == "drain":
        return Drain(deadline=args.deadline)
    if args.command == "deregister":
        return Deregister(deadline=args.deadline)
    return Uncordon()


def check_durations(args: argparse.Namespace) -> None:
    """Refuse absurd or non-finite durations before anything is sent (the node checks too)."""
    for flag in ("ttl", "deadline", "expires", "timeout"):
        value = getattr(args, flag, None)
        if value is not None and not 0 <= value <= MAX_ACTION_SECONDS:
            raise FleetError(
                f"--{flag} {value:g}: must be between 0 and {MAX_ACTION_SECONDS:g} seconds"
            )


async def cmd_send(args: argparse.Namespace) -> int:
    check_durations(args)
    key = signing.load_key_file(args.key_file or default_operator_key())
    subjects = Subjects(args.prefix)
    async with connected(args, "fleetctl") as bus:
        cluster = args.cluster or (await registry.read_record(bus, subjects, args.node)).cluster
        command = new_command(args.node, cluster, action_of(args), args.reason, args.expires)
        if not args.wait:
            await publish_command(bus, subjects, key, command)
            sys.stdout.write(f"{command.id}\n")
            return 0
        node_key = await results_key(bus, subjects, args.node)
        # Listening starts before the publish; msgspec encodes deterministically, so
        # this is the digest of the body publish_command sends.
        digest = command_digest(codec.encode(command))
        follower = ResultFollower(subjects, command, node_key, digest)
        async with listening(bus, {subjects.result(cluster, args.node): follower.on_result}):
            await publish_command(bus, subjects, key, command)
            sys.stdout.write(f"{command.id}\n")
            sys.stdout.flush()
            timeout = args.timeout or getattr(args, "deadline", 0.0) + 60.0
            final = await follower.until_final(timeout)
    if final is None:
        return fail(f"no final result from {args.node} within {timeout:g}s", 2)
    return 0 if final.status == "done" else 1


def add_command_parsers(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add cordon, drain, uncordon and deregister to fleetctl's subcommands."""
    helps = {
        "cordon": "stop scheduling work on a node",
        "drain": "cordon, then wait for in-flight work to finish",
        "uncordon": "make a node schedulable again",
        "deregister": "drain a node and remove it from the fleet; its agent exits",
    }
    for name, text in helps.items():
        sub = commands.add_parser(name, help=text)
        sub.add_argument("node")
        sub.add_argument("--reason", default="", help="recorded with the node's state")
        if name == "cordon":
            sub.add_argument("--ttl", type=float, default=None, help="uncordon after S seconds")
        if name in ("drain", "deregister"):
            sub.add_argument(
                "--deadline", type=float, default=300.0, help="seconds to wait (default 300)"
            )
        sub.add_argument("--wait", action="store_true", help="follow the node's results")
        sub.add_argument(
            "--timeout", type=float, default=None, help="--wait limit (default deadline + 60 s)"
        )
        sub.add_argument("--cluster", help="the node's cluster (default: from fleet_nodes)")
        sub.add_argument(
            "--expires", type=float, default=3600.0, help="seconds the command stays valid"
        )
        sub.add_argument(
            "--key-file", type=Path, default=None, help=f"default {default_operator_key()}"
        )
        add_server(sub)
        sub.set_defaults(func=cmd_send)
