"""Remediation actor: runs the policy every ``interval`` over the nodes' records.

Each round takes every node's record from the process's live feed
(:class:`actors.fleet.live.feed.NodeFeed`: memory, current within a heartbeat for what
the policy reads; no round while it is not complete), and per cluster reads the shared
:class:`PolicyRecord`
(KV ``fleet_policy``, key = cluster) with its revision, decides
(:func:`actors.fleet.remediation.policy.decide`), writes the new record by
compare-and-set and only then sends the commands, signed with the policy's key. A CAS
that loses (another aggregator decided first) sends nothing: the next round decides
again from what the winner wrote, so two aggregators never both take the last breaker
slot. In ``dry_run`` nothing is written or sent; what would be done is logged and
raised as ``remediation`` alerts. Where hooks are configured, each round reads the trust
entries of the nodes it holds (one get each, at most the breaker's limit): their
enrolled identity gates the hooks and is what the hooks are given.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import msgspec
import nats.errors
import nats.js.errors
from nats.js.api import KeyValueConfig, StorageType
from nats.js.kv import KeyValue

from actors.fleet.alerts.publisher import AlertPublisher
from actors.fleet.live.feed import NodeFeed, followed
from actors.fleet.metrics import AggregatorMetrics
from actors.fleet.operator.commands import new_command, publish_command
from actors.fleet.remediation.hooks import environment, run_hook
from actors.fleet.remediation.policy import Order, Plan, PolicyConfig, decide
from actors.fleet.storage import registry
from actors.runtime import kv
from actors.runtime.bus import Bus
from actors.runtime.schedule import jittered
from schemas import codec
from schemas.errors import DecodeError, FleetError
from schemas.messages import Action, AlertKind, Cordon, Drain, NodeRecord, TrustEntry, Uncordon
from schemas.remediation import Hold, PolicyRecord
from schemas.signing import load_key_file
from schemas.subjects import BUCKET_POLICY, Subjects

log = logging.getLogger(__name__)

MIB = 1024 * 1024
POLICY_BUCKET_BYTES = 8 * MIB
POLICY_VALUE_BYTES = MIB


FEED_WAIT = 0.2
"""Seconds before a round the live feed was not complete for is tried again."""
MAX_HOOKS_RUNNING = 8
"""Hooks one aggregator runs at once; more wait for a later round."""
FINISH_ATTEMPTS = 5
"""Compare-and-set tries to record a hook's result."""


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
    """Reads the live feed and fleet_policy; writes fleet_policy, sends commands, raises
    remediation, breaker_tripped and needs_attention alerts."""

    name = "remediation"

    def __init__(
        self,
        config: PolicyConfig,
        bus: Bus,
        prefix: str = "fleet",
        metrics: AggregatorMetrics | None = None,
        feed: NodeFeed | None = None,
    ) -> None:
        self.config = config
        self.metrics = metrics or AggregatorMetrics()
        self.bus = bus
        self.subjects = Subjects(prefix)
        self._own_feed = feed is None
        self.feed = feed or NodeFeed(bus, self.subjects, metrics=self.metrics)
        """The nodes' records: the process's live feed, or one of its own."""
        self.key = load_key_file(Path(config.key_file))
        self.alerts = AlertPublisher(bus, self.subjects)
        self.bucket: KeyValue | None = None
        self.rounds = 0
        self.hook_tasks: set[asyncio.Task[None]] = set()
        """Hooks running now (at most MAX_HOOKS_RUNNING), each claimed in fleet_policy."""

    async def open(self) -> KeyValue:
        if self.bucket is None:
            self.bucket = await self.bus.js.create_key_value(policy_bucket(self.subjects))
        return self.bucket

    async def run(self, ready: Callable[[], None]) -> None:
        await self.open()
        async with followed(self.feed, self._own_feed) as following:
            ready()
            await self._rounds(following)

    async def _rounds(self, following: asyncio.Future[None]) -> None:
        try:
            while True:
                if following.done():
                    following.result()  # its own feed's watch failed: restarted with it
                try:
                    await self.round()
                except (nats.errors.Error, TimeoutError, FleetError) as exc:
                    log.warning("policy round failed", extra={"reason": str(exc)})
                # A round the feed was not complete for is tried again soon.
                complete = self.feed.complete
                await asyncio.sleep(jittered(self.config.interval) if complete else FEED_WAIT)
        finally:
            for task in self.hook_tasks:
                task.cancel()
            await asyncio.gather(*self.hook_tasks, return_exceptions=True)

    def records(self) -> list[NodeRecord] | None:
        """Every node's whole record from the live feed (a decode each, from memory), in
        node order; None while the feed is not complete (a node missing for a moment
        would look released)."""
        if not self.feed.complete:
            return None
        return [record for _, record in sorted(self.feed.whole().items())]

    async def round(self) -> None:
        """Decide once for every cluster the policy covers."""
        records = self.records()
        if records is None:
            log.debug("policy waits for the live feed to be complete")
            return
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
        entries = await self._trust_entries(current)
        enrolled = {node: entry.identity if entry else None for node, entry in entries.items()}
        now = time.time()
        plan = decide(
            self.config, self.key.public_key, current, members, now, uuid.uuid4().hex, enrolled
        )
        self.metrics.breaker.labels(cluster).set(1 if plan.record.tripped_at else 0)
        self.metrics.policy_holds.labels(cluster).set(len(plan.record.holds))
        self.metrics.policy_limit.labels(cluster).set(plan.record.limit)
        if self.config.dry_run:
            plan.notes += [("remediation", h.node, f"run hook {h.hook}") for h in plan.hooks]
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
        for wanted in plan.hooks:
            record = next((m for m in members if m.node_id == wanted.node), None)
            if record is not None and len(self.hook_tasks) < MAX_HOOKS_RUNNING:
                entry = entries.get(wanted.node)
                await self._start_hook(bucket, cluster, record, wanted.hook, entry)

    async def _trust_entries(self, current: PolicyRecord) -> dict[str, TrustEntry | None]:
        """The trust entries of the nodes ``current`` holds, where hooks are configured
        (an unreadable one is logged and left out: that node's hooks get no identity)."""
        entries: dict[str, TrustEntry | None] = {}
        if not self.config.hooks:
            return entries
        for node in current.holds:
            try:
                entries[node] = await registry.trust_entry(self.bus, self.subjects, node)
            except DecodeError as exc:
                log.error("trust entry unreadable", extra={"node": node, "reason": str(exc)})
        return entries

    async def _start_hook(
        self,
        bucket: KeyValue,
        cluster: str,
        record: NodeRecord,
        hook: str,
        entry: TrustEntry | None,
    ) -> None:
        """Claim the hook in the cluster's record (compare-and-set: one aggregator runs
        it), then run it in the background."""
        current, revision = await kv.read_with_revision(bucket, cluster, PolicyRecord)
        hold = current.holds.get(record.node_id) if current is not None else None
        if current is None or hold is None or hold.hook_running or hold.needs_attention:
            return
        claimed = msgspec.structs.replace(
            hold, hook_running=hook, hook_started=time.time(), hook_error=""
        )
        holds = {**current.holds, record.node_id: claimed}
        try:
            await bucket.update(
                cluster, codec.encode(msgspec.structs.replace(current, holds=holds)), last=revision
            )
        except nats.js.errors.KeyWrongLastSequenceError:
            return  # another aggregator claimed it (or changed the record): its turn
        task = asyncio.create_task(
            self._run_hook(bucket, cluster, record, claimed, hook, entry), name=f"hook-{hook}"
        )
        self.hook_tasks.add(task)
        task.add_done_callback(self.hook_tasks.discard)

    async def _run_hook(
        self,
        bucket: KeyValue,
        cluster: str,
        record: NodeRecord,
        hold: Hold,
        hook: str,
        entry: TrustEntry | None,
    ) -> None:
        node = record.node_id
        log.info("policy hook started", extra={"node": node, "hook": hook})
        env = environment(record, hold, hook, entry)
        result = await run_hook(self.config.hooks[hook], env, self.config.hook_timeout)
        now = time.time()
        for _ in range(FINISH_ATTEMPTS):
            current, revision = await kv.read_with_revision(bucket, cluster, PolicyRecord)
            held = current.holds.get(node) if current is not None else None
            if current is None or held is None or held.hook_running != hook:
                return  # released meanwhile (an operator took the node over, say)
            if not result.ok:
                done = msgspec.structs.replace(
                    held, hook_running="", needs_attention=True, hook_error=result.detail[:1024]
                )
            elif hook in self.config.reboot_hooks:
                done = msgspec.structs.replace(
                    held, hook_running="", rebooting=hook, reboot_from=record.boot_id,
                    hook_started=now,
                )  # fmt: skip
            else:
                done = msgspec.structs.replace(
                    held, hook_running="", hook_started=None, hooks_done=[*held.hooks_done, hook]
                )
            updated = msgspec.structs.replace(current, holds={**current.holds, node: done})
            try:
                await bucket.update(cluster, codec.encode(updated), last=revision)
                break
            except nats.js.errors.KeyWrongLastSequenceError:
                continue
        kind: AlertKind = "remediation" if result.ok else "needs_attention"
        message = f"hook {hook}: {result.detail}"
        if not result.ok:
            message += "; stays cordoned until an operator clears it (fleetctl policy clear)"
        log.log(
            logging.INFO if result.ok else logging.ERROR,
            "policy hook finished",
            extra={"node": node, "hook": hook, "result": result.detail},
        )
        event = f"hook-{hook}-{hold.hook_started or now:.0f}"
        await self.alerts.publish(kind, cluster, node, message[:1024], event, {"hook": hook})

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
                # One per claim: the message names the claim and the enrolled identity.
                "hardware_changed": "identity-" + hashlib.sha256(message.encode()).hexdigest()[:16],
            }.get(kind, f"{now:.0f}-{message[:48]}")
            if dry:
                event = f"dry-{event}-{int(now // 300)}"
            details = {"would": "; ".join(plan.record.would)} if kind == "breaker_tripped" else {}
            await self.alerts.publish(
                kind, cluster, node, prefix + message, event.replace(" ", "_"), details
            )
