"""``fleet.register``: a node asks to join (``node-agent register``) and is told whether
its key is approved.

A registration records a pending node in ``fleet_nodes``, or, with an enrollment token
an operator issued, approves its key at once (:mod:`actors.fleet.enroll`). Self-signed
registrations cost nothing to make, so they are rate-limited (all keys, then per key)
and pending records are capped (``max_pending``, counted by the full sweep). Owns the
rate limits and the answer; the pending record of a node this aggregator owns goes into
its ledger, so the node's first heartbeat finds it in memory.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Literal

from nats.aio.msg import Msg

from actors.fleet import enroll, hot_state, record_rules
from actors.fleet.config import AggregatorConfig
from actors.fleet.ledger import Ledger
from actors.fleet.metrics import AggregatorMetrics
from actors.fleet.node_store import NodeStore
from actors.runtime.bus import Bus
from actors.runtime.schedule import RateLimit
from schemas import codec, signing
from schemas.errors import DecodeError, SignatureError
from schemas.messages import NodeRecord, Registration, RegistrationReply
from schemas.subjects import Subjects

log = logging.getLogger(__name__)


class Registrar:
    """Answers ``fleet.register`` for one aggregator; ``owns`` says whether a node's
    partition is this aggregator's."""

    def __init__(
        self,
        config: AggregatorConfig,
        bus: Bus,
        subjects: Subjects,
        metrics: AggregatorMetrics,
        store: NodeStore,
        ledger: Ledger,
        owns: Callable[[str], bool],
    ) -> None:
        self.config = config
        self.bus = bus
        self.subjects = subjects
        self.metrics = metrics
        self.store = store
        self.ledger = ledger
        self.owns = owns
        self.registrations = RateLimit(config.registrations_per_minute, 60.0)
        self.registrations_by_key = RateLimit(config.registrations_per_key_per_minute, 60.0)

    async def on_register(self, msg: Msg) -> None:
        """Answer one registration; a rejection is counted and logged."""
        reply = await self.register(msg)
        if reply.status == "rejected":
            self.metrics.dropped.labels("registration_rejected").inc()
            log.warning(
                "registration rejected", extra={"node": reply.node_id, "reason": reply.reason}
            )
        await msg.respond(codec.encode(reply))

    async def register(self, msg: Msg) -> RegistrationReply:
        if not self.registrations.allow():
            return RegistrationReply(
                node_id="unknown", status="rejected", reason="too many registrations; retry later"
            )
        try:
            registration = codec.decode(msg.data, Registration, msg.subject)
            signer = signing.verify(msg.headers, msg.data)
        except (DecodeError, SignatureError) as exc:
            return RegistrationReply(node_id="unknown", status="rejected", reason=str(exc))
        node = registration.node_id
        if signer != registration.public_key:
            return RegistrationReply(
                node_id=node,
                status="rejected",
                reason="registration not signed by the key it names",
            )
        if not self.registrations_by_key.allow(signer):
            return RegistrationReply(
                node_id=node,
                status="rejected",
                reason="too many registrations from this key; retry later",
            )
        enrolled = None
        if registration.enroll_token:
            enrolled = await enroll.admit(
                self.bus, self.subjects, registration, self.config.operator_keys()
            )
            log.info(
                "enrollment token presented",
                extra={"node": node, "approved": enrolled.approved, "reason": enrolled.reason},
            )
        trusted = await self.store.trusted_key(node, fresh=True)
        status: Literal["active", "pending"] = (
            "active" if trusted == registration.public_key else "pending"
        )
        ledger = self.ledger
        full = ledger.pending >= self.config.max_pending
        now = time.time()

        def change(record: NodeRecord | None) -> NodeRecord | None:
            if record is not None or full:
                return None
            return record_rules.pending_record(
                node, registration.cluster, registration.public_key, since=now
            )

        before, created, revision = await self.store.update(node, change)
        if created is not None:
            ledger.pending += 1
            if self.owns(node) and node not in ledger.nodes:
                # The node's first heartbeat comes here: its record is known, not read.
                state = ledger.nodes[node] = hot_state.from_record(
                    created, time.monotonic(), ledger.nodes.bodies
                )
                state.revision = revision
        elif before is None and status == "pending":
            return RegistrationReply(
                node_id=node, status="rejected", reason="too many pending registrations"
            )
        return RegistrationReply(
            node_id=node, status=status, reason=enrolled.reason if enrolled else ""
        )
