"""Answers ``fleetctl policy reset|clear``: the operator's request is signed, and an
aggregator changes the remediation policy's record (KV ``fleet_policy``) only after
verifying the signature against its ``trust_operators`` and the request's age against
``max_skew``, as for ``fleetctl forget``. The request names the state it acts on (the
trip it closes, the hold it clears): a copy replayed after the policy moved on (tripped
again, held the node again) changes nothing. What was done is raised as a
``remediation`` alert naming the operator. It runs beside the aggregator in its process,
as its own actor, whether or not that aggregator runs the policy.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable

import msgspec
from nats.aio.msg import Msg

from actors.fleet.alerts.publisher import AlertPublisher
from actors.fleet.config import AggregatorConfig
from actors.fleet.operator.requests import RequestRefused, verified
from actors.fleet.storage.policy_holds import edit_policy
from actors.runtime.bus import Bus
from actors.runtime.spans import clock
from actors.runtime.subscriptions import listening
from schemas import codec, signing
from schemas.errors import FleetError
from schemas.messages import PolicyReply, PolicyRequest
from schemas.remediation import PolicyRecord
from schemas.subjects import Subjects

log = logging.getLogger(__name__)

CLUSTER = "_cluster"
"""The node an alert about a whole cluster's policy names (as the breaker's)."""


def reset(request: PolicyRequest, signer: str) -> Callable[[PolicyRecord], PolicyRecord]:
    """The edit closing the trip ``request`` names (and no later one)."""

    def edit(record: PolicyRecord) -> PolicyRecord:
        if record.tripped_at is None:
            raise FleetError(f"the breaker of {record.cluster} is not tripped")
        if request.tripped_at != record.tripped_at:
            raise FleetError(
                f"the breaker of {record.cluster} tripped again at {clock(record.tripped_at)} "
                "since this request was made: reset it again"
            )
        return msgspec.structs.replace(record, tripped_at=None, would=[], updated_by=signer)

    return edit


def clear(request: PolicyRequest, signer: str) -> Callable[[PolicyRecord], PolicyRecord]:
    """The edit forgetting the hold (the one ``request`` names) and history of a node."""
    node = request.node or ""

    def edit(record: PolicyRecord) -> PolicyRecord:
        hold = record.holds.get(node)
        if hold is None and node not in record.history:
            raise FleetError(f"the policy holds nothing of {node} in {record.cluster}")
        if (hold.since if hold is not None else None) != request.since:
            raise FleetError(f"the policy's hold of {node} changed since this request was made")
        holds = {name: held for name, held in record.holds.items() if name != node}
        history = {name: times for name, times in record.history.items() if name != node}
        return msgspec.structs.replace(record, holds=holds, history=history, updated_by=signer)

    return edit


class PolicyRequestsActor:
    """Subscribes to fleet.policy (queue group ``aggregators``: one aggregator answers)."""

    name = "policy_requests"

    def __init__(self, config: AggregatorConfig, bus: Bus) -> None:
        self.config = config
        self.bus = bus
        self.subjects = Subjects(config.prefix)
        self.alerts = AlertPublisher(bus, self.subjects)

    async def run(self, ready: Callable[[], None]) -> None:
        routes = {self.subjects.policy(): self._on_request}
        async with listening(self.bus, routes, ready, queue="aggregators"):
            await asyncio.Event().wait()  # answer until cancelled

    async def _on_request(self, msg: Msg) -> None:
        reply = await self.answer(msg.subject, msg.data, msg.headers)
        level = logging.WARNING if reply.status == "rejected" else logging.INFO
        log.log(level, "policy request", extra={"status": reply.status, "reason": reply.reason})
        await msg.respond(codec.encode(reply))

    async def answer(
        self, subject: str, body: bytes, headers: dict[str, str] | None
    ) -> PolicyReply:
        """Verify, then reset or clear; every refusal is a reply saying why."""
        try:
            signer, request = verified(
                subject,
                body,
                headers,
                PolicyRequest,
                self.config.operator_keys(),
                self.config.max_skew,
            )
        except RequestRefused as refused:
            return PolicyReply(status="rejected", reason=refused.reason)
        if request.action == "clear" and request.node is None:
            return PolicyReply(status="rejected", reason="clear names no node")
        edit = reset(request, signer) if request.action == "reset" else clear(request, signer)
        try:
            await edit_policy(self.bus, self.subjects, request.cluster, edit)
        except FleetError as exc:
            return PolicyReply(status="rejected", reason=str(exc))
        by = signing.fingerprint(signer)
        if request.action == "reset":
            node, message = CLUSTER, f"breaker reset by operator {by}"
        else:
            node, message = request.node or "", f"hold cleared by operator {by}"
        # Its id names the request, so a retried answer stores it once.
        event = f"{request.action}-{hashlib.sha256(body).hexdigest()[:16]}"
        await self.alerts.publish(
            "remediation", request.cluster, node, message, event, {"by": signer}
        )
        return PolicyReply(status="done")
