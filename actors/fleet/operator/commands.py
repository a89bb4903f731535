"""Building and publishing a signed operator command: what ``fleetctl`` and the
remediation policy send a node on FLEET_CMD."""

from __future__ import annotations

import time
import uuid

import nats.errors

from actors.runtime.bus import PUBLISH_TIMEOUT, Bus
from schemas import codec
from schemas.errors import FleetError
from schemas.messages import Action, Command, command_digest
from schemas.signing import KeyPair
from schemas.subjects import Subjects


def new_command(
    node: str,
    cluster: str,
    action: Action,
    reason: str = "",
    expires: float = 3600.0,
    command_id: str = "",
) -> Command:
    """A command to one node, valid for ``expires`` seconds; a fresh id unless given."""
    now = time.time()
    return Command(
        id=command_id or uuid.uuid4().hex,
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
