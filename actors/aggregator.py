"""Aggregator actor (provider side): verifies heartbeats and keeps ``fleet_nodes`` true.

It consumes ``FLEET_HB`` through a durable pull consumer. A heartbeat is accepted only if
its key is the node's approved key, its signature verifies over the received bytes, its
body names the subject's node and cluster, its timestamp is within the skew bound and its
seq is above the last accepted one. Refusals change nothing and raise an alert. The
server's TTL delete marker on a node's subject is the ``stale`` signal.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Literal

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.kv import KeyValue

from actors import records
from actors.bus import Bus, unsubscribe_quietly
from actors.streams import provision
from schemas import codec, signing
from schemas import subjects as names
from schemas.errors import DecodeError, InvalidToken, SignatureError
from schemas.messages import (
    Alert,
    AlertKind,
    Heartbeat,
    NodeRecord,
    Registration,
    RegistrationReply,
    TrustEntry,
)
from schemas.subjects import Subjects

log = logging.getLogger(__name__)

MARKER_REASON = "Nats-Marker-Reason"
FETCH_BATCH = 128
CAS_ATTEMPTS = 8


class AggregatorConfig(msgspec.Struct, frozen=True, kw_only=True):
    prefix: str = "fleet"
    durable: str = "aggregator"
    max_skew: float = 300.0
    offline_after: float = 300.0
    sweep_interval: float = 5.0
    replicas: int = 1


class Refused(Exception):
    """A heartbeat that must not change state; carries the alert to raise."""

    def __init__(self, kind: AlertKind, message: str, **details: str) -> None:
        self.kind: AlertKind = kind
        self.message = message
        self.details = details
        super().__init__(message)


SEVERITY: dict[AlertKind, str] = {
    "stale": "warning",
    "offline": "critical",
    "recovered": "info",
    "anomaly": "warning",
    "sequence_gap": "warning",
    "replay": "critical",
    "bad_signature": "critical",
    "unknown_node": "warning",
    "clock_skew": "warning",
    "health": "warning",
    "interruption": "critical",
    "deregistered": "info",
}


class Aggregator:
    name = "aggregator"

    def __init__(self, config: AggregatorConfig, bus: Bus) -> None:
        self.config = config
        self.bus = bus
        self.subjects = Subjects(config.prefix)
        self.stream = self.subjects.stream_name(names.STREAM_HEARTBEATS)
        self.accepted = 0
        self.refused = 0

    async def run(self, ready: Callable[[], None]) -> None:
        await provision(self.bus.js, self.subjects, self.config.replicas)
        self.nodes = await self.bus.kv(self.subjects.bucket_name(names.BUCKET_NODES))
        self.trust = await self.bus.kv(self.subjects.bucket_name(names.BUCKET_TRUST))
        consumer = await self.bus.js.pull_subscribe(
            self.subjects.heartbeats(),
            durable=self.subjects.stream_name(self.config.durable),
            stream=self.stream,
            config=ConsumerConfig(
                ack_policy=AckPolicy.EXPLICIT,
                deliver_policy=DeliverPolicy.ALL,
                ack_wait=30,
                max_ack_pending=10_000,
            ),
        )
        registrations = await self.bus.subscribe(
            self.subjects.register(), self._on_register, queue="aggregators"
        )
        sweeper = asyncio.create_task(self._sweep_forever(), name="aggregator-sweep")
        try:
            await self.bus.flush()
            ready()
            while True:
                try:
                    batch = await consumer.fetch(FETCH_BATCH, timeout=1.0)
                except (nats.errors.TimeoutError, TimeoutError):
                    continue
                except nats.errors.ConnectionClosedError:
                    raise
                except nats.errors.Error as exc:
                    log.warning("fetch failed", extra={"reason": str(exc)})
                    await asyncio.sleep(1.0)
                    continue
                for msg in batch:
                    await self.handle(msg)
                    await msg.ack()
        finally:
            sweeper.cancel()
            await asyncio.gather(sweeper, return_exceptions=True)
            await unsubscribe_quietly(registrations)
            await unsubscribe_quietly(consumer)

    async def handle(self, msg: Msg) -> None:
        """Apply one message of FLEET_HB. Never raises for bad input: it alerts."""
        try:
            cluster, node = self.subjects.split_heartbeat(msg.subject)
        except InvalidToken:
            log.warning("heartbeat on a malformed subject", extra={"subject": msg.subject})
            return
        stream_seq = msg.metadata.sequence.stream
        if msg.headers and MARKER_REASON in msg.headers:
            await self._mark_stale(cluster, node, msg.headers[MARKER_REASON])
            return
        try:
            heartbeat, public_key = await self._verify(msg, cluster, node)
        except Refused as refusal:
            self.refused += 1
            log.warning(
                "heartbeat refused",
                extra={"node": node, "kind": refusal.kind, "reason": refusal.message},
            )
            await self.alert(
                refusal.kind, cluster, node, refusal.message, f"s{stream_seq}", **refusal.details
            )
            return
        await self._accept(heartbeat, public_key)

    async def _verify(self, msg: Msg, cluster: str, node: str) -> tuple[Heartbeat, str]:
        trusted = await self._trusted_key(node)
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

    async def _trusted_key(self, node: str) -> str | None:
        try:
            entry = await self.trust.get(node)
        except nats.js.errors.KeyNotFoundError:
            return None
        if entry.value is None:
            return None
        try:
            trust = codec.decode(entry.value, TrustEntry, f"trust record {node}")
        except DecodeError as exc:
            log.error("unreadable trust entry", extra={"node": node, "reason": str(exc)})
            return None
        return None if trust.revoked else trust.public_key

    async def _accept(self, heartbeat: Heartbeat, public_key: str) -> None:
        now = time.time()
        node = heartbeat.node_id
        alerts: list[tuple[AlertKind, str, dict[str, str]]] = []

        def change(record: NodeRecord | None) -> NodeRecord:
            alerts.clear()
            previous = record or records.pending_record(node, heartbeat.cluster, public_key)
            if heartbeat.seq <= previous.last_seq:
                raise Refused(
                    "replay",
                    f"seq {heartbeat.seq} is not above the last accepted {previous.last_seq}",
                    seq=str(heartbeat.seq),
                )
            if previous.state in ("stale", "offline"):
                alerts.append(("recovered", f"heartbeats resumed after {previous.state}", {}))
            same_boot = previous.boot_id == heartbeat.boot_id
            if same_boot and heartbeat.seq > previous.last_seq + 1:
                missed = heartbeat.seq - previous.last_seq - 1
                alerts.append(
                    (
                        "sequence_gap",
                        f"{missed} heartbeat(s) missing",
                        {"from": str(previous.last_seq), "to": str(heartbeat.seq)},
                    )
                )
            gap = now - previous.last_seen
            if same_boot and previous.state == "active" and gap > 2.5 * heartbeat.interval:
                alerts.append(
                    (
                        "anomaly",
                        f"{gap:.1f}s since the previous heartbeat "
                        f"(interval {heartbeat.interval:g}s)",
                        {},
                    )
                )
            updated = records.accept(previous, heartbeat, public_key, now)
            alerts.extend(records.lifecycle_alerts(previous, heartbeat))
            if (
                previous.health_status is not None
                and updated.health_status != previous.health_status
            ):
                alerts.append(
                    (
                        "health",
                        f"health {previous.health_status} -> {updated.health_status}",
                        {"score": str(updated.health_score)},
                    )
                )
            return updated

        try:
            await self.update_record(node, change)
        except Refused as refusal:
            self.refused += 1
            log.warning(
                "heartbeat refused",
                extra={"node": node, "kind": refusal.kind, "reason": refusal.message},
            )
            await self.alert(
                refusal.kind,
                heartbeat.cluster,
                node,
                refusal.message,
                f"q{heartbeat.seq}:{heartbeat.boot_id}",
                **refusal.details,
            )
            return
        self.accepted += 1
        for kind, message, details in alerts:
            # Lifecycle alerts name their own event, so every aggregator derives one id.
            event = details.pop("event", f"q{heartbeat.seq}")
            await self.alert(kind, heartbeat.cluster, node, message, event, **details)

    async def _mark_stale(self, cluster: str, node: str, reason: str) -> None:
        now = time.time()
        became_stale: list[NodeRecord] = []

        def change(record: NodeRecord | None) -> NodeRecord | None:
            became_stale.clear()
            if record is None or record.stale_since is not None or record.deregistered:
                return None
            updated = records.with_state(record, stale_since=now)
            became_stale.append(updated)
            return updated

        await self.update_record(node, change)
        if became_stale:
            record = became_stale[0]
            await self.alert(
                "stale",
                cluster,
                node,
                f"no heartbeat for {self._stale_after(record):g}s (server marker: {reason})",
                f"q{record.last_seq}",
                last_seq=str(record.last_seq),
            )

    @staticmethod
    def _stale_after(record: NodeRecord) -> float:
        return record.heartbeat.stale_after if record.heartbeat else 0.0

    async def sweep(self) -> None:
        """Stale records older than ``offline_after`` become offline."""
        now = time.time()
        try:
            keys = await self.nodes.keys()
        except nats.js.errors.NoKeysError:
            return
        for node in keys:
            went_offline: list[NodeRecord] = []

            def change(
                record: NodeRecord | None, went_offline: list[NodeRecord] = went_offline
            ) -> NodeRecord | None:
                went_offline.clear()
                if record is None or record.stale_since is None or record.offline_since:
                    return None
                if now - record.stale_since < self.config.offline_after:
                    return None
                updated = records.with_state(record, offline_since=now)
                went_offline.append(updated)
                return updated

            await self.update_record(node, change)
            for record in went_offline:
                await self.alert(
                    "offline",
                    record.cluster,
                    node,
                    f"stale for more than {self.config.offline_after:g}s",
                    f"q{record.last_seq}",
                )

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.sweep_interval)
            try:
                await self.sweep()
            except nats.errors.Error as exc:
                log.warning("offline sweep failed", extra={"reason": str(exc)})

    async def update_record(
        self, node: str, change: Callable[[NodeRecord | None], NodeRecord | None]
    ) -> NodeRecord | None:
        """Read-modify-write of one record with compare-and-set, so concurrent
        aggregators never overwrite each other. ``change`` returning None writes nothing."""
        for _ in range(CAS_ATTEMPTS):
            current, revision = await self._read(self.nodes, node)
            updated = change(current)
            if updated is None:
                return current
            body = codec.encode(updated)
            try:
                if revision is None:
                    await self.nodes.create(node, body)
                else:
                    await self.nodes.update(node, body, last=revision)
                return updated
            except (nats.js.errors.KeyWrongLastSequenceError, nats.js.errors.APIError) as exc:
                log.debug(
                    "record changed underneath; retrying", extra={"node": node, "reason": str(exc)}
                )
        raise RuntimeError(f"could not update record of {node} after {CAS_ATTEMPTS} attempts")

    async def _read(self, bucket: KeyValue, node: str) -> tuple[NodeRecord | None, int | None]:
        try:
            entry = await bucket.get(node)
        except nats.js.errors.KeyNotFoundError:
            return None, None
        if entry.value is None:
            return None, entry.revision
        return codec.decode(entry.value, NodeRecord, f"kv {node}"), entry.revision

    async def alert(
        self,
        kind: AlertKind,
        cluster: str,
        node: str,
        message: str,
        event: str,
        **details: str,
    ) -> None:
        """Publish an alert whose id (and Nats-Msg-Id) is the same in every aggregator."""
        alert_id = f"{kind}:{cluster}:{node}:{event}"
        alert = Alert(
            id=alert_id,
            kind=kind,
            node_id=node,
            cluster=cluster,
            severity=SEVERITY[kind],  # type: ignore[arg-type]
            message=message,
            ts=time.time(),
            details=details,
        )
        try:
            await self.bus.js.publish(
                self.subjects.alert(kind, cluster, node),
                codec.encode(alert),
                timeout=5.0,
                headers={"Nats-Msg-Id": alert_id},
            )
        except (nats.errors.Error, TimeoutError) as exc:
            log.error("alert not published", extra={"alert": alert_id, "reason": str(exc)})

    async def _on_register(self, msg: Msg) -> None:
        try:
            registration = codec.decode(msg.data, Registration, msg.subject)
            signer = signing.verify(msg.headers, msg.data)
        except (DecodeError, SignatureError) as exc:
            await msg.respond(
                codec.encode(
                    RegistrationReply(node_id="unknown", status="rejected", reason=str(exc))
                )
            )
            return
        if signer != registration.public_key:
            reply = RegistrationReply(
                node_id=registration.node_id,
                status="rejected",
                reason="registration not signed by the key it names",
            )
        else:
            trusted = await self._trusted_key(registration.node_id)
            status: Literal["active", "pending"] = (
                "active" if trusted == registration.public_key else "pending"
            )

            def change(record: NodeRecord | None) -> NodeRecord | None:
                if record is not None:
                    return None
                return records.pending_record(
                    registration.node_id, registration.cluster, registration.public_key
                )

            await self.update_record(registration.node_id, change)
            reply = RegistrationReply(node_id=registration.node_id, status=status)
        await msg.respond(codec.encode(reply))
