"""Placed workloads as ``fleet_workloads`` keeps them (every reader goes through
:func:`read_all`; :mod:`actors.fleet.placement.store` writes them), and where a placed
replica stands in its node's last heartbeat: listed there (:func:`listed`), reached at
:func:`endpoint`."""

from __future__ import annotations

import logging

from actors.runtime import kv
from actors.runtime.bus import Bus, NotProvisioned
from schemas import codec
from schemas.errors import DecodeError
from schemas.messages import NodeRecord, WorkloadSummary
from schemas.placement import PlacedWorkload
from schemas.subjects import BUCKET_WORKLOADS, Subjects

log = logging.getLogger(__name__)

READ_LIMIT = 10_000
"""Placed workloads read at most (the 1 MiB bucket holds a few hundred)."""
READ_TIMEOUT = 10.0


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


async def read_placed(bus: Bus, subjects: Subjects) -> list[PlacedWorkload]:
    """Every placed workload (none where no aggregator provisioned the bucket yet: one
    older than placement)."""
    try:
        await bus.kv(subjects.bucket_name(BUCKET_WORKLOADS))
    except NotProvisioned:
        return []
    return [workload for workload, _ in (await read_all(bus, subjects)).values()]


def listed(record: NodeRecord | None, name: str) -> WorkloadSummary | None:
    """The workload named ``name`` in the node's last heartbeat."""
    beat = record.heartbeat if record is not None else None
    if beat is None:
        return None
    return next((w for w in beat.workloads if w.name == name), None)


def endpoint(record: NodeRecord, port: int) -> str:
    """Where a client reaches the workload: the node's advertised gateway URL when its
    heartbeat has one (``Heartbeat.endpoint``, from agents with an outside gateway), else
    its port on the node's loopback."""
    advertised = record.heartbeat.endpoint if record.heartbeat else ""
    return advertised or f"127.0.0.1:{port}"
