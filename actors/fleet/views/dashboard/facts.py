"""What the fleet knows of its nodes beside their records, as the pages show it: the
remediation policy's records (holds, breaker, history), the maintenance windows and the
placed workloads. Each is read from the store that keeps it now through one small
function (:func:`read_policy`, :func:`read_maintenance`, :func:`read_workloads`), every
:data:`FACTS_EVERY` seconds, for every open page together; a failed read keeps what was
read before, and the pages say it failed (``errors``).

These are the fleet's own records (written by the policy, by an aggregator that verified
an operator's signature, by ``fleetctl deploy`` and the reconcilers), shown as facts; what
a node says of itself comes in its heartbeat and is shown as its claim.
"""

from __future__ import annotations

import asyncio
import logging
import time

import nats.errors

from actors.fleet.storage.placed import read_placed
from actors.fleet.storage.policy_holds import read_policies
from actors.fleet.storage.windows import InForce, read_windows
from actors.runtime.bus import Bus, NotProvisioned
from schemas.errors import FleetError
from schemas.messages import MaintenanceWindow, NodeRecord
from schemas.placement import PlacedWorkload
from schemas.remediation import Hold, PolicyRecord
from schemas.subjects import Subjects

log = logging.getLogger(__name__)

FACTS_EVERY = 5.0
"""Seconds between two reads of the facts."""


async def read_policy(bus: Bus, subjects: Subjects) -> list[PolicyRecord]:
    """The remediation policy's record of each cluster."""
    return await read_policies(bus, subjects)


async def read_maintenance(bus: Bus, subjects: Subjects) -> list[MaintenanceWindow]:
    """Every maintenance window (ended ones too, until the bucket drops them)."""
    try:
        return await read_windows(bus, subjects)
    except NotProvisioned:
        return []


async def read_workloads(bus: Bus, subjects: Subjects) -> list[PlacedWorkload]:
    """Every placed workload."""
    return await read_placed(bus, subjects)


class Facts:
    """The facts as last read, and the lookups the pages make in them."""

    def __init__(self, bus: Bus, subjects: Subjects) -> None:
        self.bus = bus
        self.subjects = subjects
        self.policies: list[PolicyRecord] = []
        self.windows: list[MaintenanceWindow] = []
        self.placed: list[PlacedWorkload] = []
        self.errors: dict[str, str] = {}
        """What could not be read at the last try, by fact (``policy``, ...)."""
        self.read_at: float | None = None
        self.holds: dict[tuple[str, str], Hold] = {}
        """The policy's holds by (cluster, node)."""

    async def refresh(self) -> None:
        """Read every fact again; one that fails keeps its last value."""
        self.errors = {}
        try:
            self.policies = await read_policy(self.bus, self.subjects)
        except (nats.errors.Error, TimeoutError, FleetError) as exc:
            self.errors["policy"] = str(exc) or type(exc).__name__
        try:
            self.windows = await read_maintenance(self.bus, self.subjects)
        except (nats.errors.Error, TimeoutError, FleetError) as exc:
            self.errors["maintenance"] = str(exc) or type(exc).__name__
        try:
            self.placed = await read_workloads(self.bus, self.subjects)
        except (nats.errors.Error, TimeoutError, FleetError) as exc:
            self.errors["workloads"] = str(exc) or type(exc).__name__
        self.holds = {
            (record.cluster, node): hold
            for record in self.policies
            for node, hold in record.holds.items()
        }
        self.read_at = time.time()
        if self.errors:
            log.warning("dashboard facts not read", extra={"reason": str(self.errors)})

    async def follow(self) -> None:
        """Read the facts every FACTS_EVERY seconds, until cancelled."""
        while True:
            await self.refresh()
            await asyncio.sleep(FACTS_EVERY)

    def hold(self, cluster: str, node: str) -> Hold | None:
        """The policy's hold of the node, if it holds it."""
        return self.holds.get((cluster, node))

    def in_force(self, now: float) -> InForce:
        return InForce(self.windows, now)

    def covering(
        self, record: NodeRecord, now: float, windows: InForce | None = None
    ) -> MaintenanceWindow | None:
        """The window in force covering the node (``windows``: those in force, if known)."""
        in_force = self.in_force(now) if windows is None else windows
        return in_force.covering(record.node_id, record.cluster, record.labels)

    def needs_attention(self) -> set[tuple[str, str]]:
        """(cluster, node) of the holds the policy leaves to an operator."""
        return {key for key, hold in self.holds.items() if hold.needs_attention}

    def tripped(self) -> set[str]:
        """The clusters whose breaker is tripped."""
        return {record.cluster for record in self.policies if record.tripped_at is not None}
