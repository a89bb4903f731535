"""Maintenance windows: the ``fleet_maintenance`` bucket that holds them, and which nodes a
window covers (:mod:`actors.fleet.operator.maintenance` answers ``fleetctl maintenance``).

An operator marks nodes (a label selector, optionally in one cluster, or names) as in
maintenance for a while: their alerts are still recorded in ``FLEET_ALERTS``, but not
forwarded to Alertmanager (:mod:`actors.fleet.alerts.alertmanager`), and every view shows them as
``maintenance``. The request is signed by the operator key; an aggregator writes the
window only after verifying the signature against its ``trust_operators`` and the
request's age against ``max_skew``, as for ``fleetctl forget``. A window is never deleted
by hand: ``end`` sets its ``until`` to now, so a replayed ``start`` finds the id taken
and is refused; the bucket's age limit drops windows 31 days after they were written.
"""

from __future__ import annotations

import asyncio
import logging

import nats.errors
import nats.js.errors

from actors.fleet import labels as fleet_labels
from actors.runtime.bus import Bus
from actors.runtime.kv import latest_values
from schemas import codec
from schemas.errors import DecodeError
from schemas.messages import MaintenanceWindow, NodeRecord
from schemas.subjects import BUCKET_MAINTENANCE, Subjects

log = logging.getLogger(__name__)

MAX_WINDOW = 30 * 86_400.0
"""Longest window, in seconds (the bucket keeps a window 31 days)."""
MAX_WINDOWS = 10_000
"""Windows read at most (the bucket's keys)."""
READ_TIMEOUT = 5.0
REFRESH_EVERY = 5.0
"""Seconds between two reads of the windows by a follower (:meth:`MaintenanceWindows.follow`)."""


def covers(
    window: MaintenanceWindow, node: str, cluster: str, labels: dict[str, str], now: float
) -> bool:
    """``window`` is in force at ``now`` and names or selects the node (its selector read
    as ``fleetctl nodes -l`` reads one)."""
    if not window.since <= now < window.until:
        return False
    if node in window.nodes:
        return True
    if not window.selector or (window.cluster and cluster != window.cluster):
        return False
    return fleet_labels.matches(labels, window.selector.items())


async def read_windows(bus: Bus, subjects: Subjects) -> list[MaintenanceWindow]:
    """Every window of ``fleet_maintenance`` (ended ones too), skipping unreadable ones."""
    values = await latest_values(
        bus, subjects.bucket_name(BUCKET_MAINTENANCE), MAX_WINDOWS, READ_TIMEOUT
    )
    windows = []
    for key, value in values.items():
        try:
            windows.append(codec.decode(value, MaintenanceWindow))
        except DecodeError:
            log.warning("unreadable maintenance window skipped", extra={"window": key})
    return windows


class MaintenanceWindows:
    """The windows as last read, and which one covers a node."""

    def __init__(self, bus: Bus, subjects: Subjects) -> None:
        self.bus = bus
        self.subjects = subjects
        self.windows: list[MaintenanceWindow] = []

    def covering(self, record: NodeRecord, now: float) -> MaintenanceWindow | None:
        for window in self.windows:
            if covers(window, record.node_id, record.cluster, record.labels, now):
                return window
        return None

    async def refresh(self) -> None:
        self.windows = await read_windows(self.bus, self.subjects)

    async def follow(self) -> None:
        """Read the windows again every REFRESH_EVERY seconds, until cancelled; a failed
        read keeps the last windows read."""
        while True:
            try:
                await self.refresh()
            except (nats.errors.Error, TimeoutError) as exc:
                log.warning("maintenance windows not read", extra={"reason": str(exc)})
            await asyncio.sleep(REFRESH_EVERY)
