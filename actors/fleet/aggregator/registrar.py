"""``fleet.register``: a node asks to join (``node-agent register``) and is told whether
its key is approved.

A registration records a pending node in ``fleet_nodes``, or, with an enrollment token
an operator issued, approves its key at once (:mod:`actors.fleet.operator.enroll`). Self-signed
registrations cost nothing to make, so they are rate-limited (per key, and per login
where the server names it, then all together: one key's or login's flood spends only its
own share) and pending records are capped, in all (``max_pending``) and per key and
login (``max_pending_per_key``), counted by the full sweep; a name keeps every key that
registered it (:mod:`actors.fleet.aggregator.pending`). Owns the
rate limits and the answer; the pending record of a node this aggregator owns goes into
its ledger, so the node's first heartbeat finds it in memory.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Literal

from nats.aio.msg import Msg

from actors.fleet import identity
from actors.fleet.aggregator import hot_state, pending
from actors.fleet.aggregator.ledger import Ledger
from actors.fleet.config import AggregatorConfig
from actors.fleet.metrics import AggregatorMetrics
from actors.fleet.operator import enroll
from actors.fleet.storage.node_store import NodeStore
from actors.runtime.bus import Bus
from actors.runtime.schedule import RateLimit
from schemas import codec, signing
from schemas.errors import DecodeError, SignatureError
from schemas.messages import NodeRecord, Registration, RegistrationReply
from schemas.subjects import Subjects

log = logging.getLogger(__name__)

REGISTERING_KEYS = 10_000
"""Keys whose registrations are counted in one minute (a bound on memory): a key beyond
them is refused until the minute ends."""


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
        self.registrations_by_key = RateLimit(
            config.registrations_per_key_per_minute, 60.0, max_keys=REGISTERING_KEYS
        )

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
        login = pending.login_of(msg.headers)
        limited = "" if self.registrations_by_key.allow(signer) else "key"
        if not limited and login and not self.registrations_by_key.allow(pending.LOGIN + login):
            limited = "login"
        if limited:
            return RegistrationReply(
                node_id=node,
                status="rejected",
                reason=f"too many registrations from this {limited}; retry later",
            )
        if not self.registrations.allow():
            return RegistrationReply(
                node_id=node, status="rejected", reason="too many registrations; retry later"
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
        limits = (self.config.max_pending, self.config.max_pending_per_key)
        new_refusal = ledger.pending.refusal(signer, login, True, *limits)
        candidate_refusal = ledger.pending.refusal(signer, login, False, *limits)
        now = time.time()

        def change(record: NodeRecord | None) -> NodeRecord | None:
            if record is None:
                if new_refusal:
                    return None
                return pending.new_record(
                    node,
                    registration.cluster,
                    signer,
                    login,
                    now,
                    approved=status == "active",
                    identity=identity.recordable(registration.identity),
                )
            if candidate_refusal or status == "active":
                return None
            return pending.with_candidate(record, signer, registration.cluster, now, login)

        before, written, revision = await self.store.update(node, change)
        if written is not None:
            ledger.pending.add(signer, login, new_name=before is None)
            if before is None and self.owns(node) and node not in ledger.nodes:
                # The node's first heartbeat comes here: its record is known, not read.
                state = ledger.nodes[node] = hot_state.from_record(
                    written, time.monotonic(), ledger.nodes.bodies
                )
                state.revision = revision
        elif status == "pending":
            refusal = pending.why_unrecorded(before, signer, new_refusal, candidate_refusal)
            if refusal:
                return RegistrationReply(node_id=node, status="rejected", reason=refusal)
        return RegistrationReply(
            node_id=node, status=status, reason=enrolled.reason if enrolled else ""
        )
