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
import math
from collections.abc import Iterable

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


class InForce:
    """The windows in force at ``now``, to be asked of many nodes: the others left out
    once (the bucket keeps every window 31 days after it ends), each one's names a set (a
    window names up to 1,000). Asking every window kept of every node cost up to 97 µs a
    node with 1,000 windows kept (9.7 s a pass over 100,000 nodes), a list of 1,000 names
    5.3 µs a node; 0.1 µs each now."""

    def __init__(self, windows: Iterable[MaintenanceWindow], now: float) -> None:
        self.windows: list[tuple[MaintenanceWindow, frozenset[str]]] = []
        self.start, self.end = -math.inf, math.inf
        """The times between which the same windows are in force."""
        for window in windows:
            if window.since <= now < window.until:
                self.windows.append((window, frozenset(window.nodes)))
                self.start, self.end = max(self.start, window.since), min(self.end, window.until)
            elif window.until <= now:
                self.start = max(self.start, window.until)
            else:
                self.end = min(self.end, window.since)

    def __bool__(self) -> bool:
        return bool(self.windows)

    def holds_at(self, now: float) -> bool:
        """Whether the same windows are in force at ``now``."""
        return self.start <= now < self.end

    def covering(self, node: str, cluster: str, labels: dict[str, str]) -> MaintenanceWindow | None:
        """The first window that names or selects the node (its selector read as
        ``fleetctl nodes -l`` reads one)."""
        for window, names in self.windows:
            if node in names:
                return window
            if (
                window.selector
                and (not window.cluster or cluster == window.cluster)
                and fleet_labels.matches(labels, window.selector.items())
            ):
                return window
        return None


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
        self._in_force = InForce((), 0.0)
        self._found_in: list[MaintenanceWindow] = self.windows
        """The windows ``_in_force`` was found in."""

    def covering(self, record: NodeRecord, now: float) -> MaintenanceWindow | None:
        """The window in force at ``now`` covering the node; the windows in force are
        found again only once one began or ended, or the windows were read again."""
        if self._found_in is not self.windows or not self._in_force.holds_at(now):
            self._in_force, self._found_in = InForce(self.windows, now), self.windows
        return self._in_force.covering(record.node_id, record.cluster, record.labels)

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
