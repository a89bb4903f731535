"""What the fleet knows of a node beside its heartbeat, added to every live view: the
maintenance window covering it, the remediation policy's hold on it, and what each of its
workloads is now. A view shows each as it is where its bucket cannot be read."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import msgspec
import nats.errors

from actors.fleet.live.workload_status import status as status_now
from actors.fleet.storage.policy_holds import read_policies
from actors.fleet.storage.windows import InForce, read_windows
from actors.runtime.bus import Bus
from schemas.errors import FleetError
from schemas.subjects import Subjects

if TYPE_CHECKING:  # the reader imports this module: its type only, for annotations
    from actors.fleet.live.reader import LiveRecord


async def fleet_facts(bus: Bus, subjects: Subjects, records: list[LiveRecord]) -> list[LiveRecord]:
    """``records`` with what the fleet knows of each beside its heartbeat: the
    maintenance window covering it, the remediation policy's hold and what its workloads
    are now."""
    marked = await held_by_policy(bus, subjects, await in_maintenance(bus, subjects, records))
    return [with_workload_status(record, time.time()) for record in marked]


def with_workload_status(record: LiveRecord, now: float) -> LiveRecord:
    """``record`` with each listed workload's status now (``workload_status``)."""
    beat = record.heartbeat
    if beat is None or not beat.workloads:
        return record
    shown = {w.name: status_now(record, w, (), now) for w in beat.workloads}
    return msgspec.structs.replace(record, workload_status=shown)


async def held_by_policy(
    bus: Bus, subjects: Subjects, records: list[LiveRecord]
) -> list[LiveRecord]:
    """``records`` with the remediation policy's hold of each (``policy_hold``); as they
    are where the policy's records cannot be read."""
    if not records:
        return records
    try:
        policies = await read_policies(bus, subjects)
    except (nats.errors.Error, TimeoutError, FleetError):
        return records
    holds = {
        (p.cluster, node): f"{hold.action} refused: needs attention"
        if hold.refused
        else hold.action
        for p in policies
        for node, hold in p.holds.items()
    }
    return [
        msgspec.structs.replace(record, policy_hold=action)
        if (action := holds.get((record.cluster, record.node_id)))
        else record
        for record in records
    ]


async def in_maintenance(
    bus: Bus, subjects: Subjects, records: list[LiveRecord]
) -> list[LiveRecord]:
    """``records`` with the maintenance window covering each (``maintenance``); as they
    are where the windows cannot be read (no bucket yet: an older aggregator)."""
    if not records:
        return records
    try:
        windows = await read_windows(bus, subjects)
    except (nats.errors.Error, TimeoutError, FleetError):
        return records
    in_force = InForce(windows, time.time())
    marked = []
    for record in records:
        window = in_force.covering(record.node_id, record.cluster, record.labels)
        if window is not None:
            record = msgspec.structs.replace(record, maintenance=window.id)
        marked.append(record)
    return marked
