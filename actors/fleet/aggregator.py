"""Aggregator actor (provider side): verifies heartbeats and keeps ``fleet_nodes`` true.

It consumes ``FLEET_HB`` through a durable pull consumer shared by every aggregator. A
heartbeat is accepted only if its key is the node's approved key, its signature verifies
over the received bytes, its body names the subject's node and cluster, its timestamp is
within the skew bound and its seq is above the last accepted one. Refusals change nothing
and raise an alert. The server's TTL delete marker on a node's subject is the ``stale``
signal; a stale record older than ``offline_after`` becomes offline.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Literal

import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from actors.fleet import enroll, record_rules
from actors.fleet.alerts import AlertPublisher
from actors.fleet.config import AggregatorConfig
from actors.fleet.metrics import AggregatorMetrics
from actors.fleet.node_store import NodeStore
from actors.fleet.refusals import RefusalTracker
from actors.fleet.streams import StreamLimits, provision
from actors.runtime.bus import Bus, listening
from actors.runtime.consumer import DurableConsumer, consume_forever
from actors.runtime.schedule import RateLimit
from actors.runtime.supervisor import FatalError
from schemas import codec, signing
from schemas.errors import DecodeError, InvalidToken, SignatureError
from schemas.messages import AlertKind, Heartbeat, NodeRecord, Registration, RegistrationReply
from schemas.subjects import STREAM_HEARTBEATS, Subjects

log = logging.getLogger(__name__)

MARKER_REASON = "Nats-Marker-Reason"
ROLLUP = "Nats-Rollup"
REPLICAS_NOT_SUPPORTED = 10074
"""JetStream's error code for ``replicas > 1 not supported in non-clustered mode``."""
"""No agent sends it; on FLEET_HB (where the server forces rollups on, for its delete
markers) ``all`` purges every node's heartbeat: the sender is refused and alerted on."""
FETCH_BATCH = 128


class Refused(Exception):
    """A heartbeat that must not change state; carries the alert to raise."""

    def __init__(self, kind: AlertKind, message: str, **details: str) -> None:
        self.kind: AlertKind = kind
        self.message = message
        self.details = details
        super().__init__(message)


class LateDelivery(Exception):
    """An older heartbeat delivered after a newer one (another aggregator was faster)."""


class AggregatorActor:
    """Subscribes to FLEET_HB (shared durable consumer) and fleet.register; publishes
    NodeRecord in fleet_nodes and Alert on fleet.alert.<kind>.<cluster>.<node>."""

    name = "aggregator"

    def __init__(
        self, config: AggregatorConfig, bus: Bus, metrics: AggregatorMetrics | None = None
    ) -> None:
        self.config = config
        self.bus = bus
        self.subjects = Subjects(config.prefix)
        self.alerts = AlertPublisher(bus, self.subjects, config.alert_window, config.alert_repeat)
        self.refusals = RefusalTracker(config.refused_note_every)
        self.metrics = metrics or AggregatorMetrics()
        self.store = NodeStore(bus, self.subjects, self.metrics)
        self.stale: set[str] = set()
        """Nodes this aggregator saw go stale: the offline sweep checks these often."""
        self._consumer: DurableConsumer | None = None
        self.pending = 0
        """Pending records as of the last full sweep, plus those registered since."""
        self.registrations = RateLimit(config.registrations_per_minute, 60.0)
        self.registrations_by_key = RateLimit(config.registrations_per_key_per_minute, 60.0)

    def consumer(self) -> DurableConsumer:
        """The heartbeat consumer every aggregator shares, as it is (re-)created."""
        return DurableConsumer(
            self.bus.js,
            self.subjects.stream_name(STREAM_HEARTBEATS),
            self.subjects.heartbeats(),
            self.subjects.stream_name(self.config.durable),
            ConsumerConfig(
                ack_policy=AckPolicy.EXPLICIT,
                deliver_policy=DeliverPolicy.ALL,
                ack_wait=30,
                max_ack_pending=10_000,
                max_deliver=self.config.max_deliver,
            ),
        )

    def problem(self) -> str:
        """Why this aggregator is not doing its work while running ("" when it is)."""
        return self._consumer.missing if self._consumer else ""

    async def run(self, ready: Callable[[], None]) -> None:
        try:
            await provision(
                self.bus.js, self.subjects, self.config.replicas, StreamLimits.of(self.config)
            )
        except nats.js.errors.APIError as exc:
            if exc.err_code != REPLICAS_NOT_SUPPORTED:
                raise
            # No restart makes a single server a cluster: say so and stop.
            raise FatalError(
                f"replicas = {self.config.replicas} needs a clustered nats-server; "
                "this one is not (use replicas = 1)"
            ) from None
        self._consumer = consumer = self.consumer()
        await consumer.open()
        routes = {self.subjects.register(): self._on_register}
        try:
            # Either task failing ends both and the actor, so the supervisor restarts it.
            async with (
                listening(self.bus, routes, ready, queue="aggregators"),
                asyncio.TaskGroup() as group,
            ):
                group.create_task(
                    consume_forever(
                        consumer,
                        self._handle_and_ack,
                        batch=FETCH_BATCH,
                        wait=1.0,
                        what="heartbeat",
                        dropped=self._count_drop,
                    )
                )
                group.create_task(self._sweep_forever())
                group.create_task(self.store.follow_trust())
        finally:
            self._consumer = None
            await consumer.close()

    def _count_drop(self, reason: str) -> None:
        self.metrics.dropped.labels(reason).inc()

    async def _handle_and_ack(self, msg: Msg) -> None:
        await self.handle(msg)
        await msg.ack()

    async def handle(self, msg: Msg) -> None:
        """Apply one message of FLEET_HB. Never raises for bad input: it alerts."""
        try:
            cluster, node = self.subjects.split_heartbeat(msg.subject)
        except InvalidToken:
            self.metrics.dropped.labels("malformed_subject").inc()
            log.warning("heartbeat on a malformed subject", extra={"subject": msg.subject})
            return
        self.metrics.processed(msg.metadata.timestamp.timestamp(), msg.metadata.num_pending)
        if msg.headers and MARKER_REASON in msg.headers:
            marked_at = msg.metadata.timestamp.timestamp()
            await self._mark_stale(cluster, node, msg.headers[MARKER_REASON], marked_at, msg.data)
            return
        stream_seq = msg.metadata.sequence.stream
        try:
            heartbeat, public_key = await self._verify(msg, cluster, node)
            # Behind the stream, a node's older heartbeats may have been replaced (one per
            # subject) before we read them: a gap then says nothing about the node.
            behind = msg.metadata.num_pending > 0
            stored = msg.metadata.timestamp.timestamp()
            await self._accept(heartbeat, public_key, stream_seq, stored, behind)
        except Refused as refusal:
            self.metrics.refused.labels(refusal.kind).inc()
            log.warning(
                "heartbeat refused",
                extra={"node": node, "kind": refusal.kind, "reason": refusal.message},
            )
            if await self._on_refused(node, refusal):
                await self.alerts.publish(
                    refusal.kind,
                    cluster,
                    node,
                    refusal.message,
                    refusal.details.pop("event", f"s{stream_seq}"),
                    refusal.details,
                )
        except LateDelivery:
            self.metrics.dropped.labels("late_delivery").inc()
            log.debug("older heartbeat delivered late; ignored", extra={"node": node})

    async def _verify(self, msg: Msg, cluster: str, node: str) -> tuple[Heartbeat, str]:
        if msg.headers and ROLLUP in msg.headers:
            raise Refused(
                "bad_signature",
                "heartbeat carries a Nats-Rollup header (it purged earlier heartbeats)",
                rollup=msg.headers[ROLLUP][:16],
            )
        signer = msg.headers.get(signing.HEADER_KEY) if msg.headers else None
        trusted = await self.store.trusted_key(node)
        if trusted is None or trusted != signer:
            # Refusing costs a fresh read: the node may have been approved (or given a
            # new key) a moment ago, before the trust watch delivered it.
            trusted = await self.store.trusted_key(node, fresh=True)
        if trusted is None:
            raise Refused("unknown_node", f"node {node} has no approved key")
        try:
            public_key = signing.verify(msg.headers, msg.data)
        except SignatureError as exc:
            raise Refused("bad_signature", exc.reason, key=exc.public_key) from None
        if public_key != trusted:
            raise Refused(
                "unknown_node",
                "signed by a key that is not the node's approved key",
                key=public_key,
            )
        try:
            heartbeat = codec.decode(msg.data, Heartbeat, msg.subject)
        except DecodeError as exc:
            raise Refused(
                "bad_signature", f"signed body is not a Heartbeat: {exc.reason}"
            ) from None
        if heartbeat.node_id != node or heartbeat.cluster != cluster:
            raise Refused(
                "bad_signature",
                "body names another node or cluster than its subject",
                body_node=heartbeat.node_id,
                body_cluster=heartbeat.cluster,
            )
        skew = heartbeat.ts - time.time()
        if abs(skew) > self.config.max_skew:
            raise Refused(
                "clock_skew",
                f"timestamp is {skew:+.0f}s off the aggregator's clock",
                seq=str(heartbeat.seq),
            )
        return heartbeat, public_key

    async def _accept(
        self,
        heartbeat: Heartbeat,
        public_key: str,
        stream_seq: int,
        stored: float,
        behind: bool = False,
    ) -> None:
        now = time.time()
        node = heartbeat.node_id

        def change(record: NodeRecord | None) -> NodeRecord:
            previous = record or record_rules.pending_record(node, heartbeat.cluster, public_key)
            verdict = record_rules.judge_seq(
                previous, heartbeat.seq, self.config.max_seq_jump, public_key
            )
            if verdict == "replay":
                if stream_seq < previous.last_stream_seq:
                    raise LateDelivery
                raise Refused(
                    "replay",
                    f"seq {heartbeat.seq} is not above the last accepted {previous.last_seq}",
                    seq=str(heartbeat.seq),
                )
            if verdict == "jump":
                raise Refused(
                    "sequence_gap",
                    f"seq {heartbeat.seq} jumps more than {self.config.max_seq_jump} above "
                    f"the last accepted {previous.last_seq}; refused (fleetctl reset-seq "
                    "lets the node in)",
                    refused="true",
                    **{"from": str(previous.last_seq), "to": str(heartbeat.seq)},
                )
            # After the seq checks, so a late delivery stays one (several aggregators).
            left = record_rules.deregistered_refusal(previous, heartbeat)
            if left is not None:
                raise Refused(left.kind, left.message, **left.details)
            accepted = record_rules.accept(previous, heartbeat, public_key, now, stream_seq, stored)
            return record_rules.with_lifecycle(previous, accepted, heartbeat)

        before, after = await self.store.update(node, change)
        if after is None:  # an unreadable record, left alone (counted by the store)
            return
        self.metrics.accepted.inc()
        self.refusals.on_accepted(node)
        previous = before or record_rules.pending_record(node, heartbeat.cluster, public_key)
        hardware = record_rules.hardware_alert(previous, heartbeat)
        for kind, message, details, severity in record_rules.heartbeat_alerts(
            previous, after, heartbeat, gaps_are_news=not behind
        ) + ([hardware] if hardware else []):
            # Lifecycle alerts name their own event, so every aggregator derives one id.
            event = details.pop("event", f"q{heartbeat.seq}")
            await self.alerts.publish(
                kind, heartbeat.cluster, node, message, event, details, severity
            )

    async def _mark_stale(
        self, cluster: str, node: str, reason: str, marked_at: float, body: bytes
    ) -> None:
        """A TTL marker makes the node stale, if it can be the server's (see
        :func:`record_rules.marker_is_real`); a forged one is counted and ignored."""
        now = time.time()
        forged = False

        def change(record: NodeRecord | None) -> NodeRecord | None:
            nonlocal forged
            forged = not record_rules.marker_is_real(record, marked_at, body)
            if forged or record is None or record.stale_since is not None or record.deregistered:
                return None
            return record_rules.with_state(record, stale_since=now)

        _, stale = await self.store.update(node, change)
        if forged:
            self.metrics.dropped.labels("forged_marker").inc()
            log.warning("forged TTL marker ignored", extra={"node": node, "reason": reason})
        else:
            self.metrics.markers.inc()
        if stale is not None:
            self.stale.add(node)
            stale_after = stale.heartbeat.stale_after if stale.heartbeat else 0.0
            await self.alerts.publish(
                "stale",
                cluster,
                node,
                f"no heartbeat for {stale_after:g}s (server marker: {reason})",
                f"q{stale.last_seq}",
                {"last_seq": str(stale.last_seq)},
            )

    async def sweep(self, everything: bool = False) -> None:
        """Stale records older than ``offline_after`` become offline. Only the nodes this
        aggregator saw go stale are checked, unless ``everything``: then every record is
        read, which also finds nodes that went stale while another aggregator (or none)
        was watching, marks stale the silent nodes whose TTL marker never came (see
        :func:`record_rules.silent_without_marker`), deletes pending records older than
        ``pending_expire_after`` and counts the pending ones left (the cap on
        registrations)."""
        now = time.time()
        grace = self.config.full_sweep_interval

        def change(record: NodeRecord | None) -> NodeRecord | None:
            if record is None or record.offline_since:
                return None
            if record.stale_since is None:
                if everything and record_rules.silent_without_marker(record, now, grace):
                    return record_rules.with_state(record, stale_since=now)
                return None
            if now - record.stale_since < self.config.offline_after:
                return None
            return record_rules.with_state(record, offline_since=now)

        candidates = await self.store.node_ids() if everything else list(self.stale)
        expire_after = self.config.pending_expire_after
        pending = 0
        for node in candidates:
            before, after = await self.store.update(node, change)
            if before is not None and record_rules.pending_expired(before, now, expire_after):
                if await self.store.delete_if(
                    node, lambda record: record_rules.pending_expired(record, now, expire_after)
                ):
                    log.info("pending registration expired", extra={"node": node})
                    continue
            if before is not None and before.state == "pending":
                pending += 1
            current = after or before
            if (
                current is not None
                and current.stale_since is not None
                and not current.offline_since
            ):
                self.stale.add(node)  # stale, not offline yet: check again at the next sweep
            else:
                self.stale.discard(node)
            if after is not None and after.offline_since:
                await self.alerts.publish(
                    "offline",
                    after.cluster,
                    node,
                    f"stale for more than {self.config.offline_after:g}s",
                    f"q{after.last_seq}",
                )
            elif after is not None:
                silent = now - after.last_seen
                log.warning("node silent but no TTL marker came", extra={"node": node})
                await self.alerts.publish(
                    "stale",
                    after.cluster,
                    node,
                    f"no heartbeat for {silent:.0f}s and no server marker (lost or purged)",
                    f"q{after.last_seq}",
                    {"last_seq": str(after.last_seq)},
                )
        if everything:
            self.pending = pending

    async def _sweep_forever(self) -> None:
        last_full = 0.0
        while True:
            await asyncio.sleep(self.config.sweep_interval)
            everything = time.monotonic() - last_full >= self.config.full_sweep_interval
            try:
                await self.sweep(everything)
                await self.sweep_refused()
                await self.alerts.flush()
            except nats.errors.Error as exc:
                log.warning("offline sweep failed", extra={"reason": str(exc)})
                continue
            if everything:
                last_full = time.monotonic()

    # Refused nodes (issue 9) --------------------------------------------------------------

    async def _on_refused(self, node: str, refusal: Refused) -> bool:
        """Remember the refused node for :meth:`sweep_refused`, note the refusal kind in its
        record for the node to read (rate-limited), and say whether to raise the alert:
        ``deregistered_node_beating`` once per boot, the rest through the rate limit."""
        if node not in self.stale:
            self.refusals.on_refused(node)
        if self.refusals.should_note(node, refusal.kind, time.monotonic()):
            now, every = time.time(), self.config.refused_note_every
            try:
                await self.store.update(
                    node, lambda r: record_rules.mark_refused(r, refusal.kind, now, every)
                )
            except (nats.errors.Error, RuntimeError) as exc:
                log.warning("refusal not noted", extra={"node": node, "reason": str(exc)})
        if refusal.kind == "deregistered_node_beating":
            return self.refusals.first_of_boot(node, refusal.details.get("boot_id", ""))
        return True

    async def sweep_refused(self) -> None:
        """Refused nodes whose last accepted heartbeat is older than its ``stale_after``
        become stale: their refused messages keep the TTL marker from firing."""
        now = time.time()

        def change(record: NodeRecord | None) -> NodeRecord | None:
            if record is None or not record_rules.refused_silent(record, now):
                return None
            return record_rules.with_state(record, stale_since=now)

        for node in list(self.refusals.refused):
            before, stale = await self.store.update(node, change)
            if stale is None:
                if before is None or before.stale_since is not None or before.deregistered:
                    self.refusals.forget(node)
                continue
            self.refusals.forget(node)
            self.stale.add(node)
            stale_after = stale.heartbeat.stale_after if stale.heartbeat else 0.0
            await self.alerts.publish(
                "stale",
                stale.cluster,
                node,
                f"no accepted heartbeat for {stale_after:g}s (its heartbeats are refused: "
                f"{stale.refused or 'unknown'})",
                f"q{stale.last_seq}",
                {"last_seq": str(stale.last_seq), "refused": stale.refused},
            )

    async def _on_register(self, msg: Msg) -> None:
        """``node-agent register``: record a pending node, say whether it is approved.
        Self-signed registrations cost nothing to make, so they are rate-limited (all
        keys, then per key) and pending records are capped."""
        reply = await self._register(msg)
        if reply.status == "rejected":
            self.metrics.dropped.labels("registration_rejected").inc()
            log.warning(
                "registration rejected", extra={"node": reply.node_id, "reason": reply.reason}
            )
        await msg.respond(codec.encode(reply))

    async def _register(self, msg: Msg) -> RegistrationReply:
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
        full = self.pending >= self.config.max_pending
        now = time.time()

        def change(record: NodeRecord | None) -> NodeRecord | None:
            if record is not None or full:
                return None
            return record_rules.pending_record(
                node, registration.cluster, registration.public_key, since=now
            )

        before, created = await self.store.update(node, change)
        if created is not None:
            self.pending += 1
        elif before is None and status == "pending":
            return RegistrationReply(
                node_id=node, status="rejected", reason="too many pending registrations"
            )
        return RegistrationReply(
            node_id=node, status=status, reason=enrolled.reason if enrolled else ""
        )
