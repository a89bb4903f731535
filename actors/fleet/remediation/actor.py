"""Remediation actor: runs the policy every ``interval`` over the nodes' records.

Each round takes every node's record from the process's live feed
(:class:`actors.fleet.live.feed.NodeFeed`: memory, current within a heartbeat for what
the policy reads; no round while it is not complete), reads the maintenance windows, and
per cluster the shared :class:`PolicyRecord` (KV ``fleet_policy``, key = cluster) with
its revision, decides (:func:`actors.fleet.remediation.policy.decide`), writes the new
record by compare-and-set and only then sends the commands, signed with the policy's
key; each new hold records the digest of the exact body sent. A CAS that loses (another
aggregator decided first) sends nothing: the next round decides again from what the
winner wrote, so two aggregators never both take the last breaker slot. For each hold
whose cordon has not shown yet, the round reads the node's signed answers to it
(:mod:`actors.fleet.storage.answers`, at most the breaker's limit of nodes): a rejection
makes the hold refused. In ``dry_run`` only the would-be actions are written
(``PolicyRecord.dry``), each raised as a ``remediation`` alert when new or changed.
Where hooks are configured, each round reads the trust entries of the nodes it holds
(one get each): their enrolled identity gates the hooks and is what the hooks are given.
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
from actors.fleet.remediation.config import PolicyConfig
from actors.fleet.remediation.hooks import environment, run_hook
from actors.fleet.remediation.members import Members
from actors.fleet.remediation.policy import Order, Plan, decide, dry_run
from actors.fleet.storage import registry
from actors.fleet.storage.answers import answers
from actors.fleet.storage.windows import MaintenanceWindows
from actors.runtime import kv
from actors.runtime.bus import Bus
from actors.runtime.schedule import jittered
from schemas import codec
from schemas.errors import DecodeError, FleetError
from schemas.messages import (
    Action,
    AlertKind,
    Command,
    Cordon,
    Drain,
    NodeRecord,
    TrustEntry,
    Uncordon,
    command_digest,
)
from schemas.remediation import Hold, PolicyRecord
from schemas.signing import load_key_file
from schemas.subjects import BUCKET_POLICY, Subjects

log = logging.getLogger(__name__)

MIB = 1024 * 1024
POLICY_BUCKET_BYTES = 8 * MIB
POLICY_VALUE_BYTES = MIB


FEED_WAIT = 0.2
"""Seconds before a round the live feed was not complete for is tried again."""
ANSWER_SLACK = 5.0
"""Seconds before a hold's ``since`` its node's answers are read from (the node's clock
stamps nothing here: the stream's store time is read, and the hold's own time comes
from the aggregator that wrote it)."""
REFUSED = frozenset({"rejected", "failed"})
"""A node's final answers that mean the policy's command did not take effect."""
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


def with_digests(record: PolicyRecord, commands: list[Command]) -> PolicyRecord:
    """``record`` with each new hold naming the digest of the command body sent for it
    (msgspec encodes deterministically: the bytes publish_command sends)."""
    holds = dict(record.holds)
    for command in commands:
        hold = holds.get(command.node_id)
        if hold is not None and hold.command_id == command.id:
            digest = command_digest(codec.encode(command))
            holds[command.node_id] = msgspec.structs.replace(hold, command_digest=digest)
    return msgspec.structs.replace(record, holds=holds)


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
        self.members = Members(self.feed, config)
        """What the policy knows of the fleet, kept from the feed's writes."""
        self._whole = True
        """The next round takes every node in (the first, or the feed was incomplete)."""
        self.key = load_key_file(Path(config.key_file))
        self.alerts = AlertPublisher(bus, self.subjects)
        self.windows = MaintenanceWindows(bus, self.subjects)
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
                # A round the feed was not complete for (as the round began: it may be
                # by its end) decided nothing and is tried again soon.
                decided = self.feed.complete
                try:
                    await self.round()
                except (nats.errors.Error, TimeoutError, FleetError) as exc:
                    log.warning("policy round failed", extra={"reason": str(exc)})
                await asyncio.sleep(jittered(self.config.interval) if decided else FEED_WAIT)
        finally:
            for task in self.hook_tasks:
                task.cancel()
            await asyncio.gather(*self.hook_tasks, return_exceptions=True)

    async def round(self) -> None:
        """Decide once for every cluster the policy covers, on what changed since the
        last round (:class:`Members`): the nodes with a finding, the silent and the held."""
        if not self.feed.complete:
            log.debug("policy waits for the live feed to be complete")
            self._whole = True
            return
        await self.members.refresh(self._whole)
        if not self.feed.complete:
            # It let nodes go while the refresh gave the loop its turns: their records
            # may be missing from what was read.
            self._whole = True
            return
        self._whole = False
        try:
            await self.windows.refresh()
        except (nats.errors.Error, TimeoutError) as exc:
            log.warning("maintenance windows not read", extra={"reason": str(exc)})
        for cluster in self.members.clusters():
            if not self.config.clusters or cluster in self.config.clusters:
                await self.decide_cluster(cluster)
        self.rounds += 1

    def in_maintenance(self, members: list[NodeRecord], now: float) -> dict[str, str]:
        """The window covering each node of ``members`` that is in maintenance."""
        covered = {}
        for record in members:
            window = self.windows.covering(record, now)
            if window is not None:
                covered[record.node_id] = window.id
        return covered

    async def decide_cluster(self, cluster: str) -> None:
        bucket = await self.open()
        try:
            current, revision = await kv.read_with_revision(bucket, cluster, PolicyRecord)
        except DecodeError as exc:
            log.error("policy record unreadable: no action", extra={"reason": str(exc)})
            return
        current = current or PolicyRecord(cluster=cluster)
        members = self.members.of(cluster, set(current.holds))
        if not self.feed.complete:
            # The feed lost nodes since the round began (the aggregator beside it let
            # partitions go, a watch catches up): a held node missing now would read as
            # forgotten and its hold be dropped. Read just now, in the same step as the
            # records, so these were read from a complete feed when it says so.
            log.debug("policy round left: the live feed is catching up", extra={"cluster": cluster})
            self._whole = True
            return
        entries = await self._trust_entries(current)
        enrolled = {node: entry.identity if entry else None for node, entry in entries.items()}
        refusals = await self._refusals(cluster, current, entries)
        now = time.time()
        plan = decide(
            self.config,
            self.key.public_key,
            current,
            members,
            now,
            uuid.uuid4().hex,
            enrolled,
            refusals=refusals,
            maintenance=self.in_maintenance(members, now),
            base=self.members.reporting(cluster),
        )
        if self.config.dry_run:
            plan = dry_run(current, plan)
        self.metrics.breaker.labels(cluster).set(1 if plan.record.tripped_at else 0)
        self.metrics.policy_holds.labels(cluster).set(len(plan.record.holds))
        self.metrics.policy_limit.labels(cluster).set(plan.record.limit)
        commands = [self._command(cluster, order) for order in plan.orders]
        plan.record = with_digests(plan.record, commands)
        if plan.record != current:
            try:
                if revision is None:
                    await bucket.create(cluster, codec.encode(plan.record))
                else:
                    await bucket.update(cluster, codec.encode(plan.record), last=revision)
            except nats.js.errors.KeyWrongLastSequenceError:
                log.info("another aggregator decided first", extra={"cluster": cluster})
                return
        for command in commands:
            try:
                await publish_command(self.bus, self.subjects, self.key, command)
            except FleetError as exc:
                log.error(
                    "policy command not sent", extra={"node": command.node_id, "reason": str(exc)}
                )
        await self._report(cluster, plan, now, dry=self.config.dry_run)
        for wanted in plan.hooks:
            record = next((m for m in members if m.node_id == wanted.node), None)
            if record is not None and len(self.hook_tasks) < MAX_HOOKS_RUNNING:
                entry = entries.get(wanted.node)
                await self._start_hook(bucket, cluster, record, wanted.hook, entry)

    def _command(self, cluster: str, order: Order) -> Command:
        return new_command(
            order.node,
            cluster,
            action_of(order, self.config),
            order.reason[:1024],
            command_id=order.command_id,
        )

    async def _refusals(
        self, cluster: str, current: PolicyRecord, entries: dict[str, TrustEntry | None]
    ) -> dict[str, str]:
        """Why each held node whose cordon has not shown yet refused it, from its signed
        answers (a node without an approved key, or with no answer, is not in it)."""
        found: dict[str, str] = {}
        for node, hold in sorted(current.holds.items()):
            waiting = not (hold.applied or hold.refused or hold.needs_attention)
            if not waiting or not hold.command_digest:
                continue
            if hold.reason_class == "hung" and hold.back_at is None:
                continue  # its command waits in its queue until it beats again
            key = registry.approved_key(entries.get(node))
            if key is None:
                continue
            try:
                results = await answers(
                    self.bus,
                    self.subjects,
                    cluster,
                    node,
                    key,
                    hold.since - ANSWER_SLACK,
                    (hold.command_id, hold.command_digest),
                )
            except (nats.errors.Error, TimeoutError) as exc:
                log.warning("answers not read", extra={"node": node, "reason": str(exc)})
                continue
            refused = [result for result in results if result.status in REFUSED]
            if refused:
                last = refused[-1]
                found[node] = f"the node answered {last.status}: {last.detail}"
        return found

    async def _trust_entries(self, current: PolicyRecord) -> dict[str, TrustEntry | None]:
        """The trust entries of the nodes ``current`` holds that may run a hook (where
        hooks are configured) or whose answer to the policy's cordon is awaited (an
        unreadable one is logged and left out: that node's hooks get no identity, its
        answers are not read)."""
        entries: dict[str, TrustEntry | None] = {}
        for node, hold in current.holds.items():
            if not self.config.hooks and (hold.applied or hold.refused):
                continue
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
            digest = hashlib.sha256(message.encode()).hexdigest()[:16]
            event = {
                "breaker_tripped": f"{plan.record.tripped_at or now:.0f}",
                "needs_attention": f"{cluster}-{node}-{digest}",
                # One per claim: the message names the claim and the enrolled identity.
                "hardware_changed": "identity-" + digest,
            }.get(kind, f"{now:.0f}-{message[:48]}")
            if dry:
                event = f"dry-{node}-{digest}"
            details = {"would": "; ".join(plan.record.would)} if kind == "breaker_tripped" else {}
            await self.alerts.publish(
                kind, cluster, node, prefix + message, event.replace(" ", "_"), details
            )
