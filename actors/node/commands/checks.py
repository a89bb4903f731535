"""Whether a message on a node's command subject may run, and if not, why.

The order matters: the signature is checked over the received bytes before anything is
decoded, the signer against the trusted operator keys, then the body, its addressee, its
times (lifetime, clock skew, expiry, issued before the node's command state began), its
durations and whether its id was already executed. Until the body is verified and decoded
its id is unknown: a refusal then names no id (only the digest of the bytes), so nobody
can make the node sign a rejection under the id of a command it did not refuse.
"""

from __future__ import annotations

import time

from nats.aio.msg import Msg

from actors.node.commands.store import CommandStore
from actors.node.config import AgentConfig
from schemas import codec, signing
from schemas.errors import DecodeError, InvalidToken, SignatureError
from schemas.messages import MAX_ACTION_SECONDS, SAFE_ID, Command, Cordon, Deregister, Drain
from schemas.subjects import Subjects
from schemas.workloads import Deploy


class Rejection(Exception):
    """A command that must not run, with the id to answer under ("" when the message was
    not verified and read), the reason, the key that signed it (where the signature
    verified) and, for a message signed by a key the node does not trust, the id it
    claims (answered apart: ``CommandResult.claimed_id``)."""

    def __init__(
        self, command_id: str, reason: str, signer: str = "", claimed_id: str = ""
    ) -> None:
        self.command_id = command_id
        self.reason = reason
        self.signer = signer
        self.claimed_id = claimed_id
        super().__init__(reason)


def check_command(
    msg: Msg, subjects: Subjects, config: AgentConfig, store: CommandStore
) -> Command:
    """The command if it may run; Rejection otherwise."""
    try:
        signer = signing.verify(msg.headers, msg.data)
    except SignatureError as exc:
        raise Rejection("", f"unsigned or bad signature: {exc.reason}") from None
    if signer not in config.operator_keys():
        raise Rejection(
            "", f"signed by an untrusted key {signer}", signer, claimed_id(msg.data, msg.subject)
        )
    try:
        command = codec.decode(msg.data, Command, msg.subject)
    except DecodeError as exc:
        raise Rejection("", f"malformed command: {exc.reason}", signer) from None
    if not SAFE_ID.fullmatch(command.id):
        raise Rejection("", "malformed command id", signer)
    try:
        check_addressee(command, msg.subject, subjects, config)
        check_times(command, config, store.created_at)
        check_durations(command)
        if store.seen(command.id):
            raise Rejection(command.id, "duplicate command id (already executed)")
    except Rejection as refusal:
        raise Rejection(refusal.command_id, refusal.reason, signer) from None
    return command


def check_addressee(
    command: Command, subject: str, subjects: Subjects, config: AgentConfig
) -> None:
    """The command's subject, its own node and cluster, and this node agree."""
    try:
        cluster, node = subjects.split_command(subject)
    except InvalidToken as exc:
        raise Rejection(command.id, str(exc)) from None
    if (command.cluster, command.node_id) != (cluster, node) or (cluster, node) != (
        config.cluster,
        config.node_id,
    ):
        raise Rejection(command.id, "command names another node or cluster than its subject")


def claimed_id(body: bytes, subject: str) -> str:
    """The id a message signed by an untrusted key claims ("" when it has no readable
    one): answered as a claim, never as the id of a command the node refused."""
    try:
        claimed = codec.decode(body, Command, subject).id
    except DecodeError:
        return ""
    return claimed if SAFE_ID.fullmatch(claimed) else ""


def check_times(command: Command, config: AgentConfig, history_since: float) -> None:
    """A command is valid from ``issued_at`` to ``expires_at``, no longer than the node
    allows, issued no later than now plus the clock skew, and not before the node's command
    history began (``history_since``; 0: unknown): its id is remembered only that long."""
    now = time.time()
    lifetime = command.expires_at - command.issued_at
    if lifetime > config.max_command_lifetime:
        raise Rejection(
            command.id,
            f"command valid for {lifetime:.0f}s; this node accepts at most "
            f"{config.max_command_lifetime:g}s (max_command_lifetime)",
        )
    if command.issued_at > now + config.max_skew:
        raise Rejection(
            command.id,
            f"command issued {command.issued_at - now:.0f}s in the future of this node's "
            f"clock (max_skew {config.max_skew:g}s)",
        )
    if command.expires_at <= now:
        raise Rejection(command.id, "command expired")
    if command.issued_at < history_since:
        since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(history_since))
        raise Rejection(
            command.id,
            f"command issued before this node's command state was created at {since} "
            "(state lost or new node: which commands already ran is unknown); send it again",
        )


def check_durations(command: Command) -> None:
    """A cordon TTL or a drain deadline beyond MAX_ACTION_SECONDS is refused before acting."""
    action = command.action
    duration = None
    if isinstance(action, Cordon):
        duration = action.ttl
    elif isinstance(action, Drain | Deregister):
        duration = action.deadline
    elif isinstance(action, Deploy):
        duration = action.ready_timeout
    if duration is not None and not duration <= MAX_ACTION_SECONDS:
        raise Rejection(
            command.id, f"duration {duration:g}s out of range (at most {MAX_ACTION_SECONDS:g}s)"
        )
