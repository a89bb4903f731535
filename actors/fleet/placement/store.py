"""The one reader and writer of ``fleet_workloads``: every placed workload with its
revision, and the signed commands that go out after a write."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from actors.fleet.operator.commands import new_command, publish_command
from actors.runtime import kv
from actors.runtime.bus import Bus
from schemas import codec
from schemas.errors import DecodeError, FleetError
from schemas.placement import PlacedWorkload
from schemas.signing import KeyPair
from schemas.subjects import BUCKET_WORKLOADS, Subjects
from schemas.workloads import Deploy, Stop

log = logging.getLogger(__name__)

READ_LIMIT = 10_000
"""Placed workloads read at most (the 1 MiB bucket holds a few hundred)."""
READ_TIMEOUT = 10.0


@dataclass
class Order:
    """One command to send once the record saying so is written."""

    node: str
    cluster: str
    action: Deploy | Stop
    command_id: str
    reason: str


async def read_all(bus: Bus, subjects: Subjects) -> dict[str, tuple[PlacedWorkload, int]]:
    """Every placed workload with its revision, by name; unreadable ones are logged and
    left out (never moved by anyone: a newer writer's record stays as it is)."""
    entries = await kv.latest_entries(
        bus, subjects.bucket_name(BUCKET_WORKLOADS), READ_LIMIT, READ_TIMEOUT
    )
    found = {}
    for name, (value, revision) in sorted(entries.items()):
        try:
            found[name] = (codec.decode(value, PlacedWorkload, f"key {name}"), revision)
        except DecodeError as exc:
            log.warning("unreadable placed workload", extra={"workload": name, "reason": str(exc)})
    return found


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
