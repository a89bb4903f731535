"""Whether a message on a node's command subject may run, and if not, why.

The order matters: the signature is checked over the received bytes before anything is
decoded, the signer against the trusted operator keys, then the body, its addressee, its
expiry and whether its id was already executed.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable

import msgspec
import nats.errors
from nats.aio.msg import Msg

from actors.node.config import AgentConfig
from schemas import codec, signing
from schemas.errors import DecodeError, InvalidToken, SignatureError
from schemas.messages import Command
from schemas.subjects import Subjects

SAFE_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
"""Command ids go into Nats-Msg-Id headers; anything else is refused as malformed."""


class Rejection(Exception):
    """A command that must not run, with the id to answer under and the reason."""

    def __init__(self, command_id: str, reason: str) -> None:
        self.command_id = command_id
        self.reason = reason
        super().__init__(reason)


def check_command(
    msg: Msg, subjects: Subjects, config: AgentConfig, seen: Callable[[str], bool]
) -> Command:
    """The command if it may run; Rejection (naming the id when it can) otherwise."""
    command_id = guess_id(msg)
    try:
        signer = signing.verify(msg.headers, msg.data)
    except SignatureError as exc:
        raise Rejection(command_id, f"unsigned or bad signature: {exc.reason}") from None
    if signer not in config.operator_keys():
        raise Rejection(command_id, f"signed by an untrusted key {signer}")
    try:
        command = codec.decode(msg.data, Command, msg.subject)
    except DecodeError as exc:
        raise Rejection(command_id, f"malformed command: {exc.reason}") from None
    if not SAFE_ID.fullmatch(command.id):
        raise Rejection(command_id, "malformed command id")
    try:
        cluster, node = subjects.split_command(msg.subject)
    except InvalidToken as exc:
        raise Rejection(command.id, str(exc)) from None
    if (command.cluster, command.node_id) != (cluster, node) or (cluster, node) != (
        config.cluster,
        config.node_id,
    ):
        raise Rejection(command.id, "command names another node or cluster than its subject")
    if command.expires_at <= time.time():
        raise Rejection(command.id, "command expired")
    if seen(command.id):
        raise Rejection(command.id, "duplicate command id (already executed)")
    return command


def guess_id(msg: Msg) -> str:
    """The id a refused command claims, if it names a usable one, so the operator can
    match the refusal; else one made from the stream sequence."""
    try:
        body = msgspec.json.decode(msg.data)
    except msgspec.DecodeError:
        body = None
    claimed = body.get("id") if isinstance(body, dict) else None
    if isinstance(claimed, str) and SAFE_ID.fullmatch(claimed):
        return claimed
    try:
        return f"unparsed-s{msg.metadata.sequence.stream}"
    except (nats.errors.Error, AttributeError, ValueError):
        return "unparsed"
