"""The signed commands that go out after a write of ``fleet_workloads`` (its records are
read by :mod:`actors.fleet.storage.placed`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from actors.fleet.operator.commands import new_command, publish_command
from actors.runtime.bus import Bus
from schemas.errors import FleetError
from schemas.signing import KeyPair
from schemas.subjects import Subjects
from schemas.workloads import Deploy, Stop

log = logging.getLogger(__name__)


@dataclass
class Order:
    """One command to send once the record saying so is written."""

    node: str
    cluster: str
    action: Deploy | Stop
    command_id: str
    reason: str


async def send(bus: Bus, subjects: Subjects, key: KeyPair, orders: list[Order]) -> list[str]:
    """Sign and send each order; the errors of those that were not sent."""
    errors = []
    for order in orders:
        reason = order.reason[:1024]
        command = new_command(
            order.node, order.cluster, order.action, reason, command_id=order.command_id
        )
        try:
            await publish_command(bus, subjects, key, command)
        except FleetError as exc:
            log.error("placement command not sent", extra={"node": order.node, "reason": str(exc)})
            errors.append(f"{order.node}: {exc}")
    return errors
