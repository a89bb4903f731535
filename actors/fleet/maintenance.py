"""Maintenance windows: ``fleetctl maintenance start|end``'s signed requests, the
``fleet_maintenance`` bucket that holds the windows, and which nodes a window covers.

An operator marks nodes (a label selector, optionally in one cluster, or names) as in
maintenance for a while: their alerts are still recorded in ``FLEET_ALERTS``, but not
forwarded to Alertmanager (:mod:`actors.fleet.alertmanager`), and every view shows them as
``maintenance``. The request is signed by the operator key; an aggregator writes the
window only after verifying the signature against its ``trust_operators`` and the
request's age against ``max_skew``, as for ``fleetctl forget``. A window is never deleted
by hand: ``end`` sets its ``until`` to now, so a replayed ``start`` finds the id taken
and is refused; the bucket's age limit drops windows 31 days after they were written.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.msg import Msg

from actors.fleet import labels as fleet_labels
from actors.fleet.config import AggregatorConfig
from actors.runtime.bus import Bus, listening
from actors.runtime.kv import latest_values
from schemas import codec, signing
from schemas.errors import DecodeError, SignatureError
from schemas.messages import Maintenance, MaintenanceReply, MaintenanceWindow, NodeRecord
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


class MaintenanceActor:
    """Subscribes to fleet.maintenance (queue group ``aggregators``: one aggregator answers)."""

    name = "maintenance"

    def __init__(self, config: AggregatorConfig, bus: Bus) -> None:
        self.config = config
        self.bus = bus
        self.subjects = Subjects(config.prefix)

    async def run(self, ready: Callable[[], None]) -> None:
        routes = {self.subjects.maintenance(): self._on_request}
        async with listening(self.bus, routes, ready, queue="aggregators"):
            await asyncio.Event().wait()  # answer until cancelled

    async def _on_request(self, msg: Msg) -> None:
        reply = await self.answer(msg.subject, msg.data, msg.headers)
        level = logging.WARNING if reply.status == "rejected" else logging.INFO
        log.log(
            level,
            "maintenance request",
            extra={"window": reply.id, "status": reply.status, "reason": reply.reason},
        )
        await msg.respond(codec.encode(reply))

    async def answer(
        self, subject: str, body: bytes, headers: dict[str, str] | None
    ) -> MaintenanceReply:
        """Verify, then start or end the window; every refusal is a reply saying why."""
        try:
            signer = signing.verify(headers, body)
            request = codec.decode(body, Maintenance, subject)
        except (SignatureError, DecodeError) as exc:
            return MaintenanceReply(id="unknown", status="rejected", reason=str(exc))
        if signer not in self.config.operator_keys():
            return self._refuse(
                request, "signed by a key the aggregators do not trust (trust_operators)"
            )
        now = time.time()
        if abs(request.ts - now) > self.config.max_skew:
            off = f"{request.ts - now:+.0f}s"
            return self._refuse(request, f"request is {off} off the aggregator's clock")
        bucket = await self.bus.kv(self.subjects.bucket_name(BUCKET_MAINTENANCE))
        if request.action == "start":
            if not (request.selector or request.nodes):
                return self._refuse(request, "a window needs a selector or node names")
            if not now < request.until <= now + MAX_WINDOW:
                return self._refuse(request, "until must be in the next 30 days")
            window = MaintenanceWindow(
                id=request.id,
                since=now,
                until=request.until,
                by=signer,
                selector=request.selector,
                cluster=request.cluster,
                nodes=request.nodes,
                reason=request.reason,
            )
            try:
                await bucket.create(request.id, codec.encode(window))
            except nats.js.errors.KeyWrongLastSequenceError:
                return self._refuse(request, f"window {request.id} exists already")
            return MaintenanceReply(id=request.id, status="started")
        try:
            entry = await bucket.get(request.id)
            window = codec.decode(entry.value or b"", MaintenanceWindow)
        except (nats.js.errors.KeyNotFoundError, DecodeError):
            return self._refuse(request, f"no window {request.id}")
        if window.until <= now:
            return self._refuse(request, f"window {request.id} has ended already")
        ended = msgspec.structs.replace(window, until=now)
        try:
            await bucket.update(request.id, codec.encode(ended), last=entry.revision)
        except nats.js.errors.KeyWrongLastSequenceError:
            return self._refuse(request, f"window {request.id} changed meanwhile; try again")
        return MaintenanceReply(id=request.id, status="ended")

    def _refuse(self, request: Maintenance, reason: str) -> MaintenanceReply:
        return MaintenanceReply(id=request.id, status="rejected", reason=reason)
