"""Answers ``fleetctl maintenance start|end``: the operator's request is signed, and an
aggregator writes the window to ``fleet_maintenance`` only after verifying the signature
against its ``trust_operators`` and the request's age against ``max_skew``, as for
``fleetctl forget`` (what a window does: :mod:`actors.fleet.storage.windows`). It runs beside
the aggregator in its process, as its own actor.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import msgspec
import nats.js.errors
from nats.aio.msg import Msg

from actors.fleet.config import AggregatorConfig
from actors.fleet.operator.requests import RequestRefused, verified
from actors.fleet.storage.windows import MAX_WINDOW
from actors.runtime.bus import Bus
from actors.runtime.subscriptions import listening
from schemas import codec
from schemas.errors import DecodeError
from schemas.messages import Maintenance, MaintenanceReply, MaintenanceWindow
from schemas.subjects import BUCKET_MAINTENANCE, Subjects

log = logging.getLogger(__name__)


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
            signer, request = verified(
                subject,
                body,
                headers,
                Maintenance,
                self.config.operator_keys(),
                self.config.max_skew,
            )
        except RequestRefused as refused:
            window = refused.request.id if refused.request is not None else "unknown"
            return MaintenanceReply(id=window, status="rejected", reason=refused.reason)
        now = time.time()
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
                drain=request.drain,
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
