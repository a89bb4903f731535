"""Remediation actor: runs the policy every ``interval`` over the nodes' records.

Each round reads every node record, and per cluster the shared :class:`PolicyRecord`
(KV ``fleet_policy``, key = cluster) with its revision, decides
(:func:`actors.fleet.remediation.policy.decide`), writes the new record by
compare-and-set and only then sends the commands, signed with the policy's key. A CAS
that loses (another aggregator decided first) sends nothing: the next round decides
again from what the winner wrote, so two aggregators never both take the last breaker
slot. In ``dry_run`` nothing is written or sent; what would be done is logged and
raised as ``remediation`` alerts.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import nats.errors
import nats.js.errors
from nats.js.api import KeyValueConfig, StorageType
from nats.js.kv import KeyValue

from actors.fleet import registry
from actors.fleet.alerts import AlertPublisher
from actors.fleet.metrics import AggregatorMetrics
from actors.fleet.remediation.policy import Order, Plan, PolicyConfig, decide
from actors.runtime import kv
from actors.runtime.bus import Bus
from actors.runtime.commands import new_command, publish_command
from actors.runtime.schedule import jittered
from schemas import codec
from schemas.errors import DecodeError, FleetError
from schemas.messages import Action, Cordon, Drain, NodeRecord, Uncordon
from schemas.remediation import PolicyRecord
from schemas.signing import load_key_file
from schemas.subjects import BUCKET_POLICY, Subjects

log = logging.getLogger(__name__)

MIB = 1024 * 1024
POLICY_BUCKET_BYTES = 8 * MIB
POLICY_VALUE_BYTES = MIB


def policy_bucket(subjects: Subjects, replicas: int = 1) -> KeyValueConfig:
    return KeyValueConfig(
        bucket=subjects.bucket_name(BUCKET_POLICY),
        description="the remediation policy's holds, history and breaker, per cluster",
        history=1,
        storage=StorageType.FILE,
        replicas=replicas,
        max_bytes=POLICY_BUCKET_BYTES,
        max_value_size=POLICY_VALUE_BYTES,
        direct=True,
    )


def action_of(order: Order, config: PolicyConfig) -> Action:
    if order.action == "drain":
        return Drain(deadline=config.drain_deadline)
    if order.action == "cordon":
        return Cordon()
    return Uncordon()


class RemediationActor:
    """Reads fleet_nodes and fleet_policy; writes fleet_policy, sends commands, raises
    remediation, breaker_tripped and needs_attention alerts."""

    name = "remediation"

    def __init__(
        self,
        config: PolicyConfig,
        bus: Bus,
        prefix: str = "fleet",
        metrics: AggregatorMetrics | None = None,
    ) -> None:
        self.config = config
        self.metrics = metrics or AggregatorMetrics()
        self.bus = bus
        self.subjects = Subjects(prefix)
        self.key = load_key_file(Path(config.key_file))
        self.alerts = AlertPublisher(bus, self.subjects)
        self.bucket: KeyValue | None = None
        self.rounds = 0

    async def open(self) -> KeyValue:
        if self.bucket is None:
            self.bucket = await self.bus.js.create_key_value(policy_bucket(self.subjects))
        return self.bucket

    async def run(self, ready: Callable[[], None]) -> None:
        await self.open()
        ready()
        while True:
            try:
                await self.round()
            except (nats.errors.Error, TimeoutError, FleetError) as exc:
                log.warning("policy round failed", extra={"reason": str(exc)})
            await asyncio.sleep(jittered(self.config.interval))

    async def round(self) -> None:
        """Decide once for every cluster the policy covers."""
        records = await registry.read_records(self.bus, self.subjects)
        clusters: dict[str, list[NodeRecord]] = {}
        for record in records:
            if not self.config.clusters or record.cluster in self.config.clusters:
                clusters.setdefault(record.cluster, []).append(record)
        for cluster, members in sorted(clusters.items()):
            await self.decide_cluster(cluster, members)
        self.rounds += 1

    async def decide_cluster(self, cluster: str, members: list[NodeRecord]) -> None:
        bucket = await self.open()
        try:
            current, revision = await kv.read_with_revision(bucket, cluster, PolicyRecord)
        except DecodeError as exc:
            log.error("policy record unreadable: no action", extra={"reason": str(exc)})
            return
        current = current or PolicyRecord(cluster=cluster)
        now = time.time()
        plan = decide(self.config, self.key.public_key, current, members, now, uuid.uuid4().hex)
        self.metrics.breaker.labels(cluster).set(1 if plan.record.tripped_at else 0)
        self.metrics.policy_holds.labels(cluster).set(len(plan.record.holds))
        self.metrics.policy_limit.labels(cluster).set(plan.record.limit)
        if self.config.dry_run:
            await self._report(cluster, plan, now, dry=True)
            return
        if plan.record != current:
            try:
                if revision is None:
                    await bucket.create(cluster, codec.encode(plan.record))
                else:
                    await bucket.update(cluster, codec.encode(plan.record), last=revision)
            except nats.js.errors.KeyWrongLastSequenceError:
                log.info("another aggregator decided first", extra={"cluster": cluster})
                return
        for order in plan.orders:
            command = new_command(
                order.node,
                cluster,
                action_of(order, self.config),
                order.reason[:1024],
                command_id=order.command_id,
            )
            try:
                await publish_command(self.bus, self.subjects, self.key, command)
            except FleetError as exc:
                log.error("policy command not sent", extra={"node": order.node, "reason": str(exc)})
        await self._report(cluster, plan, now, dry=False)

    async def _report(self, cluster: str, plan: Plan, now: float, dry: bool) -> None:
        prefix = "dry run, would: " if dry else ""
        for kind, node, message in plan.notes:
            log.warning(
                "policy decision",
                extra={"cluster": cluster, "node": node, "decision": prefix + message},
            )
            # The same decision in every aggregator (or round) gets the same id: raised once.
            event = {
                "breaker_tripped": f"{plan.record.tripped_at or now:.0f}",
                "needs_attention": f"{cluster}-{node}",
            }.get(kind, f"{now:.0f}-{message[:48]}")
            if dry:
                event = f"dry-{event}-{int(now // 300)}"
            details = {"would": "; ".join(plan.record.would)} if kind == "breaker_tripped" else {}
            await self.alerts.publish(
                kind, cluster, node, prefix + message, event.replace(" ", "_"), details
            )
