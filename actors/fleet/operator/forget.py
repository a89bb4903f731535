"""Answers ``fleetctl forget``: the operator's request is signed, and an aggregator removes
the node (record ``deregistered``, key revoked, commands purged) only after verifying the
signature against its ``trust_operators`` and the request's age against ``max_skew``.

It runs beside the aggregator in its process, as its own actor: the removal is a few KV
writes and a purge (:func:`actors.fleet.storage.registry.forget`), nothing of the heartbeat path.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable

from nats.aio.msg import Msg

from actors.fleet.alerts.publisher import AlertPublisher
from actors.fleet.config import AggregatorConfig
from actors.fleet.operator.requests import RequestRefused, verified
from actors.fleet.storage import registry
from actors.runtime.bus import Bus
from actors.runtime.subscriptions import listening
from schemas import codec
from schemas.messages import Forget, ForgetReply
from schemas.subjects import Subjects

log = logging.getLogger(__name__)

UNKNOWN_CLUSTER = "unknown"
"""The cluster an alert names for a node forgotten with a key and no record."""
MAX_REMEMBERED = 10_000
"""Request digests kept to refuse a replay inside the skew window; the oldest go first."""


class ForgetActor:
    """Subscribes to fleet.forget (queue group ``aggregators``: one aggregator answers)."""

    name = "forget"

    def __init__(self, config: AggregatorConfig, bus: Bus) -> None:
        self.config = config
        self.bus = bus
        self.alerts = AlertPublisher(bus, Subjects(config.prefix))
        self.subjects = Subjects(config.prefix)
        self.seen: dict[str, float] = {}
        """Digests of the requests acted on, with when: a copy sent again is refused."""

    async def run(self, ready: Callable[[], None]) -> None:
        routes = {self.subjects.forget(): self._on_forget}
        async with listening(self.bus, routes, ready, queue="aggregators"):
            await asyncio.Event().wait()  # answer until cancelled

    async def _on_forget(self, msg: Msg) -> None:
        reply = await self.answer(msg.subject, msg.data, msg.headers)
        level = logging.WARNING if reply.status == "rejected" else logging.INFO
        log.log(level, "forget request", extra={"node": reply.node_id, "status": reply.status})
        await msg.respond(codec.encode(reply))

    async def answer(
        self, subject: str, body: bytes, headers: dict[str, str] | None
    ) -> ForgetReply:
        """Verify, then forget; every refusal is a reply saying why, never an exception."""
        try:
            signer, request = verified(
                subject, body, headers, Forget, self.config.operator_keys(), self.config.max_skew
            )
        except RequestRefused as refused:
            node = refused.request.node_id if refused.request is not None else "unknown"
            return ForgetReply(node_id=node, status="rejected", reason=refused.reason)
        node = request.node_id
        now = time.time()
        digest = hashlib.sha256(body).hexdigest()
        self._forget_old(now)
        if digest in self.seen:
            return ForgetReply(node_id=node, status="rejected", reason="request replayed")
        try:
            done = await registry.forget(self.bus, self.subjects, node, signer, request.reason)
        except registry.NotFound:
            return ForgetReply(
                node_id=node, status="rejected", reason=f"node {node} has no record and no key"
            )
        self.seen[digest] = now
        if not done.already:
            await self._raise(node, done, signer, request.reason, digest)
        return ForgetReply(
            node_id=node,
            status="already" if done.already else "forgotten",
            revoked=done.revoked,
            purged=bool(done.purged),
        )

    async def _raise(
        self, node: str, done: registry.Forgotten, by: str, reason: str, digest: str
    ) -> None:
        """The ``forgotten`` alert (who, why): in FLEET_ALERTS, so it is among the node's
        events. Its id names the request, so a retried answer stores it once."""
        cluster = done.record.cluster if done.record is not None else UNKNOWN_CLUSTER
        await self.alerts.publish(
            "forgotten",
            cluster,
            node,
            f"forgotten by operator {by}: {reason or 'no reason given'}",
            f"forget-{digest[:16]}",
            {"by": by, "reason": reason, "revoked": str(done.revoked).lower()},
        )

    def _forget_old(self, now: float) -> None:
        """Drop digests older than the skew window (a copy that old is refused by its ts)
        and, past MAX_REMEMBERED, the oldest."""
        horizon = now - 2 * self.config.max_skew
        for digest, when in list(self.seen.items()):
            if when < horizon or len(self.seen) > MAX_REMEMBERED:
                del self.seen[digest]
            else:
                break
