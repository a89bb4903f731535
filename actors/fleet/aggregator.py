"""Aggregator actor (provider side): verifies heartbeats and keeps ``fleet_nodes`` true.

``FLEET_HB`` is split into N partitions (docs/failure-detection.md, "How partitions
work"); this aggregator consumes the partitions whose leases it holds
(:mod:`actors.fleet.partitions`), each through a durable pull consumer of its own, and
keeps only those partitions' nodes. A heartbeat is accepted only if its key is the
node's approved key, its signature verifies over the received bytes, its body names the
subject's node and cluster, its timestamp is within the skew bound and its seq is above
the last accepted one. Refusals change nothing and raise an alert. The server's TTL
delete marker on a node's subject is the ``stale`` signal; a stale record older than
``offline_after`` becomes offline.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Literal

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from actors.fleet import enroll, hot_state, record_rules
from actors.fleet.alerts import AlertPublisher
from actors.fleet.config import AggregatorConfig
from actors.fleet.hot_state import CheckpointQueue, NodeState, NodeTable, slim, spread_written
from actors.fleet.lease import holder_id
from actors.fleet.metrics import AggregatorMetrics
from actors.fleet.node_store import NodeStore
from actors.fleet.partitions import Partitions
from actors.fleet.refusals import RefusalTracker
from actors.fleet.streams import MAX_NODES, StreamLimits, heartbeat_partitions, provision
from actors.runtime import kv
from actors.runtime.bus import Bus, listening
from actors.runtime.consumer import (
    BatchPuller,
    Chain,
    Delivery,
    DurableConsumer,
    Step,
    consume_in_batches,
    delivery,
)
from actors.runtime.schedule import RateLimit, stop_if_cancelled
from actors.runtime.supervisor import FatalError
from schemas import codec, signing
from schemas.errors import DecodeError, InvalidToken, SignatureError
from schemas.messages import AlertKind, Heartbeat, NodeRecord, Registration, RegistrationReply
from schemas.subjects import (
    BUCKET_LEASES,
    BUCKET_NODES,
    STREAM_HEARTBEATS,
    Subjects,
    partition_of,
)

log = logging.getLogger(__name__)

MARKER_REASON = "Nats-Marker-Reason"
ROLLUP = "Nats-Rollup"
REPLICAS_NOT_SUPPORTED = 10074
"""JetStream's error code for ``replicas > 1 not supported in non-clustered mode``."""
"""No agent sends it; on FLEET_HB (where the server forces rollups on, for its delete
markers) ``all`` purges every node's heartbeat: the sender is refused and alerted on."""
LOAD_TIMEOUT = 120.0
"""Seconds to read every record of fleet_nodes at a cold start (100,000 in a few)."""
REFRESH_INTERVAL = 5.0
"""A refused node's record is read afresh at most this often (a reset-seq shows then)."""
TRUST_WAIT = 2.0
"""Seconds a batch of heartbeats waits at most for the trust watch to catch up."""
CHECKPOINT_TICK = 0.5
CHECKPOINTS_PER_TICK = 4096
CHECKPOINTS_IN_FLIGHT = 256
WRITE_TIMEOUT = 5.0
"""Seconds a batch of record writes waits for the server's answers (then each is written
the careful way)."""


SETTLED = ("stale", "offline", "deregistered", "pending")
"""Record states written when entered: no heartbeat after their checkpoint is missing."""


class _NeedsFetch(Exception):
    """The judgement needs the node's key or record read afresh (the slow path)."""


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
    """Subscribes to its partitions of FLEET_HB (one durable consumer each) and
    fleet.register; publishes NodeRecord in fleet_nodes and Alert on
    fleet.alert.<kind>.<cluster>.<node>."""

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
        self._consumers: dict[int, DurableConsumer] = {}
        self._pullers: dict[int, BatchPuller] = {}
        """Each consumed partition's puller: when it had read its partition to the end."""
        """The consumer of every partition this aggregator works on."""
        self._work: dict[int, asyncio.Task[None]] = {}
        self._group: asyncio.TaskGroup | None = None
        self.partition_count = config.partitions
        """N of FLEET_HB (the stream's, once provisioned)."""
        self.partitions: Partitions | None = None
        self._resume_floor: dict[int, int] = {}
        """Per partition gained: the oldest stream seq its live records' checkpoints need."""
        self._writing: dict[str, asyncio.Future[None]] = {}
        """Record writes in flight, by node: a lost partition waits for its nodes' ones."""
        self._batch: list[tuple[str, bytes, int, asyncio.Future[int | None]]] = []
        """Writes of this turn of the event loop, sent together (see :meth:`write`)."""
        self._sending: set[asyncio.Task[None]] = set()
        """The batches being sent (kept referenced until done)."""
        self.pending = 0
        """Pending records as of the last full sweep, plus those registered since."""
        self.registrations = RateLimit(config.registrations_per_minute, 60.0)
        self.registrations_by_key = RateLimit(config.registrations_per_key_per_minute, 60.0)
        self.nodes = NodeTable()
        """The acceptance state of every node this aggregator owns (see hot_state)."""
        self.checkpoints = CheckpointQueue(config.checkpoint_interval)
        self._accepted = 0
        self._last_delivery: tuple[float, int, int] | None = None
        self._heartbeat_base = f"{self.subjects.prefix}.hb"
        self._reread: set[str] = set()
        """Nodes whose trust entry changed: their records are read again."""
        self._reread_due = asyncio.Event()
        self._new_verifier: tuple[str, bytes] | None = None
        """The verifier built for the last heartbeat of a node with no state yet."""
        self._fresh_keys: dict[str, str | None] = {}
        """Trusted keys read afresh for the slow path, while it judges again."""
        self._to_pack: list[tuple[NodeState, bytes]] = []
        """The bodies of the heartbeats accepted while judging, packed once it is done
        (:meth:`_after_judging`), before any write can read them."""
        self._verified: dict[int, tuple[bytes, Delivery]] = {}
        """While a fetch is judged: the messages whose signature held, by ``id``, with the
        raw key it held under and the message's :func:`delivery`, read once (see
        :meth:`_verify_ahead`)."""

    def consumer(self, partition: int, start: int = 1) -> DurableConsumer:
        """The consumer of one partition (``<durable>-<P>``), as it is (re-)created,
        reading FLEET_HB from stream sequence ``start``. ``AckPolicy.ALL``: one ack on
        the last message of a fetch settles the fetch (see :func:`consume_in_batches`)."""
        return DurableConsumer(
            self.bus.js,
            self.subjects.stream_name(STREAM_HEARTBEATS),
            self.subjects.partition_heartbeats(partition),
            self.subjects.partition_consumer(self.config.durable, partition),
            ConsumerConfig(
                ack_policy=AckPolicy.ALL,
                deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
                opt_start_seq=max(1, start),
                ack_wait=30,
                max_ack_pending=max(10_000, 4 * self.config.fetch_batch),
                max_deliver=self.config.max_deliver,
            ),
        )

    def problem(self) -> str:
        """Why this aggregator is not doing its work while running ("" when it is): a
        partition's consumer is gone, or a partition is further behind the stream than
        ``max_lag``. An aggregator holding no partition is doing its work."""
        for partition, consumer in sorted(self._consumers.items()):
            if consumer.missing:
                return f"partition {partition}: {consumer.missing}"
            behind = self.metrics.oldest_unprocessed(partition)
            if behind > self.config.max_lag:
                return (
                    f"partition {partition}: heartbeats {behind:.0f}s behind FLEET_HB "
                    f"(max_lag {self.config.max_lag:g}s, "
                    f"{self.metrics.pending_now} pending)"
                )
        return ""

    def owns(self, node: str) -> bool:
        """Whether ``node``'s partition is one this aggregator holds. An aggregator that is
        not running (driven directly: tests, benchmarks) holds no leases and owns all."""
        return self.partitions is None or self.partitions.holds(
            partition_of(node, self.partition_count)
        )

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
        self.partition_count = await heartbeat_partitions(self.bus.js, self.subjects)
        if self.partition_count != self.config.partitions:
            log.warning(
                "partitions setting differs from FLEET_HB's; the stream's is used",
                extra={"partitions": self.config.partitions, "used": self.partition_count},
            )
        routes = {self.subjects.register(): self._on_register}
        bucket = self.subjects.bucket_name(BUCKET_LEASES)
        self.partitions = Partitions(
            self.bus,
            await self.bus.kv(bucket),
            bucket,
            holder_id(),
            self.config.lease_ttl,
            self.partition_count,
            self._gain,
            self._lose,
        )
        # Any task failing (a partition's consume loop included) ends them all and the
        # actor, so the supervisor restarts it; the leases are released on the way out.
        async with (
            listening(self.bus, routes, ready, queue="aggregators"),
            asyncio.TaskGroup() as group,
        ):
            self._group = group
            group.create_task(self.store.follow_trust(self._on_trust_change))
            group.create_task(self.partitions.run())
            group.create_task(self._sweep_forever())
            group.create_task(self._checkpoint_forever())
            group.create_task(self._reread_forever())

    async def _gain(self, partitions: set[int]) -> None:
        """Partitions just claimed: their records from fleet_nodes (one scan for all of
        them), each one's consumer from where that state ends, then its heartbeats. A
        partition that cannot be started is released (claimed again next round)."""
        assert self.partitions is not None and self._group is not None
        try:
            await self.load(partitions)
        except (nats.errors.Error, TimeoutError, kv.BatchError) as exc:
            log.warning("partitions not loaded; released", extra={"reason": str(exc)})
            await self.partitions.release(partitions)
            return
        # Set as the load ends (no await between): the API beside this owner starts no
        # watch it would stop again (see FleetApiActor._follow). A partition that cannot
        # be started is released below, which clears it (_lose).
        self.nodes.everything = all(map(self.partitions.holds, range(self.partition_count)))
        failed: set[int] = set()
        for partition in sorted(partitions):
            if not self.partitions.holds(partition):
                continue  # lost while loading (its nodes were dropped then)
            try:
                consumer = await self._open(partition)
            except (nats.errors.Error, TimeoutError) as exc:
                log.warning(
                    "partition not started", extra={"partition": partition, "reason": str(exc)}
                )
                failed.add(partition)
                continue
            if not self.partitions.holds(partition):
                await consumer.close()
                continue
            work = self._consume(partition, consumer)
            try:
                task = self._group.create_task(work)
            except RuntimeError:  # the actor is stopping: its task group takes no more
                work.close()
                await consumer.close()
                return
            self._consumers[partition] = consumer
            self._work[partition] = task
            self.metrics.owns(partition)
        if failed:
            await self.partitions.release(failed)

    async def _open(self, partition: int) -> DurableConsumer:
        start = await self._resume_point(partition)
        consumer = self.consumer(partition, start)
        with contextlib.suppress(nats.js.errors.NotFoundError):
            # The previous owner's consumer, at its ack floor: read again from ``start``.
            await self.bus.js.delete_consumer(consumer.stream, consumer.durable)
        await consumer.open()
        return consumer

    async def _consume(self, partition: int, consumer: DurableConsumer) -> None:
        """One partition's heartbeats, until its work is stopped (cancelled)."""
        puller = self._pullers[partition] = BatchPuller(self.bus, consumer)
        try:
            await consume_in_batches(
                puller,
                self.handle_batch,
                batch=self.config.fetch_batch,
                wait=1.0,
                what=f"heartbeat partition {partition}",
                dropped=self._count_drop,
                linger=self.config.fetch_linger,
            )
        finally:
            if self._pullers.get(partition) is puller:
                del self._pullers[partition]
            await puller.close()
            await consumer.close()

    async def _lose(self, partitions: set[int]) -> None:
        """Partitions lost, fenced or released: their consume loops cancelled and waited
        for, their nodes dropped from memory, and the record writes of those nodes still
        in flight (a sweep's, a checkpoint's) waited for, at most the fence's margin. When
        this returns nothing of theirs runs here any more."""
        self.nodes.everything = False
        tasks = [self._work.pop(p) for p in partitions if p in self._work]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for partition in partitions:
            consumer = self._consumers.pop(partition, None)
            if consumer is not None:
                await consumer.close()
            self.metrics.forget(partition)
            self._resume_floor.pop(partition, None)
        count = self.partition_count
        dropped = [node for node in self.nodes if partition_of(node, count) in partitions]
        for node in dropped:
            del self.nodes[node]
            self.stale.discard(node)
            self.refusals.forget(node)
        self.nodes.released += 1
        writing = [self._writing[node] for node in dropped if node in self._writing]
        if writing:
            await asyncio.wait(writing, timeout=self.config.lease_ttl / 4)
        log.info("partitions stopped", extra={"partitions": sorted(partitions)})

    async def _resume_point(self, partition: int) -> int:
        """The stream sequence the new owner reads a partition from: the oldest of the
        previous consumer's ack floor and every live record's checkpoint in it. Every
        heartbeat the previous owner accepted but did not checkpoint is after its node's
        checkpoint, so it is judged again (in stream order, from the checkpoint): the
        state is rebuilt exactly. Stale, offline and deregistered records were written
        when they changed, so nothing after them is missing."""
        stream = self.subjects.stream_name(STREAM_HEARTBEATS)
        durable = self.subjects.partition_consumer(self.config.durable, partition)
        try:
            info = await self.bus.js.consumer_info(stream, durable)
            floor = info.ack_floor.stream_seq if info.ack_floor else 0
            start = (floor or 0) + 1
        except nats.js.errors.NotFoundError:
            start = 1
        start = min(start, self._resume_floor.pop(partition, start))
        log.info("heartbeats resumed", extra={"partition": partition, "from_seq": start})
        return start

    async def load(self, partitions: set[int] | None = None) -> None:
        """The records of ``partitions`` (None: all) into memory with one scan of
        ``fleet_nodes`` (batched direct gets, one request per 1,000 records, no
        consumer), each page taken in as it comes (the bucket's bytes are never all held
        at once), keys of other partitions skipped before anything is decoded,
        checkpoints spread; each partition's resume floor noted."""
        count = self.partition_count
        wanted = set(range(count)) if partitions is None else partitions
        bucket = self.subjects.bucket_name(BUCKET_NODES)
        now = time.monotonic()
        interval = self.config.checkpoint_interval
        loaded = 0
        self.nodes.loading = True
        try:
            async for entries in kv.latest_pages(self.bus, bucket, LOAD_TIMEOUT):
                for node, value, revision in entries:
                    partition = partition_of(node, count)
                    if partition not in wanted:
                        continue
                    # A key rewritten during the scan comes again: its last value counts.
                    self.nodes.pop(node, None)
                    self.stale.discard(node)
                    if value is None or len(self.nodes) >= MAX_NODES:
                        continue
                    try:
                        state = hot_state.from_stored(
                            node, value, spread_written(now, interval), self.nodes.bodies
                        )
                    except DecodeError as exc:
                        self.metrics.records_unreadable.inc()
                        log.error(
                            "unreadable record skipped", extra={"node": node, "reason": str(exc)}
                        )
                        continue
                    state.revision = revision
                    self.nodes[node] = state
                    loaded += 1
                    record = state.record
                    if record.stale_since is not None and record.offline_since is None:
                        self.stale.add(node)
                    if record.last_stream_seq and record.state not in SETTLED:
                        # An earlier value of a key rewritten during the scan may lower
                        # the floor: judging more again is safe, less is not.
                        floor = self._resume_floor.get(partition, record.last_stream_seq + 1)
                        self._resume_floor[partition] = min(floor, record.last_stream_seq + 1)
        finally:
            self.nodes.loading = False
        if self.partitions is not None:
            lost = {p for p in wanted if not self.partitions.holds(p)}
            if lost:  # lost while reading: what was taken in of them goes again
                for node in [n for n in self.nodes if partition_of(n, count) in lost]:
                    del self.nodes[node]
                    self.stale.discard(node)
                wanted = wanted - lost
        log.info("records loaded", extra={"records": loaded, "partitions": sorted(wanted)})

    def _count_drop(self, reason: str) -> None:
        self.metrics.dropped.labels(reason).inc()

    async def handle_batch(self, messages: list[Msg]) -> list[Chain]:
        """Judge every message of a fetch in memory, in order; return the I/O left to do
        (alerts, record writes, KV reads a refusal needs), one chain per node. A node
        with a chain has its later messages of the fetch judged after the chain's steps.
        While the trust watch is behind (a bulk enrollment), the batch waits for it first,
        up to TRUST_WAIT (see :meth:`NodeStore.trust_caught_up`)."""
        await self.store.trust_caught_up(TRUST_WAIT)
        chains: dict[str, Chain] = {}
        self._verified = self._verify_ahead(messages)
        for msg in messages:
            chain = chains.get(msg.subject)
            if chain is not None:
                chain.append((msg, partial(self.handle, msg)))
                continue
            try:
                steps = self.judge(msg)
            except Exception as exc:
                # A message that breaks the judge (never raised for bad input: a bug) is
                # terminated alone; raising here would redeliver the batch forever.
                self._count_drop("handler_error")
                log.error(
                    "heartbeat broke its handler; terminated",
                    exc_info=True,
                    extra={"subject": msg.subject, "reason": repr(exc)},
                )
                steps = [msg.term]
            if steps:
                chains[msg.subject] = [(msg, step) for step in steps]
        self._verified = {}
        self._after_judging()
        return list(chains.values())

    def _verify_ahead(self, messages: list[Msg]) -> dict[int, tuple[bytes, Delivery]]:
        """Check the signatures of a fetch's heartbeats from known nodes, under the key
        their state keeps, all in one loop before any is judged: the ``id`` of each
        message whose signature held, with that key. The same checks interleaved with
        the Python of judging cost about 4 % more CPU a heartbeat (libsodium and the
        interpreter evict each other's code from the core's caches). :meth:`_verify` takes
        a result only for the same message and the same key (the check is a function of
        the two); it checks anything else itself, as it does every signature that failed
        here, to say why. A heartbeat judged before is skipped here as there (a cold start
        reads many again). The delivery read from the ack subject here is kept for the
        judge: reading it again cost about 0.5 % of a heartbeat's CPU side by side."""
        verified: dict[int, tuple[bytes, Delivery]] = {}
        for msg in messages:
            node = msg.subject.rpartition(".")[2]
            state = self.nodes.get(node)
            headers = msg.headers
            if state is None or state.verifier is None or headers is None:
                continue
            if not state.key == headers.get(signing.HEADER_KEY) == self.store.cached_key(node):
                continue
            try:
                read = delivery(msg)
                if record_rules.judged_before(state.record, read[0], read[1]):
                    continue
                signing.verify_with(state.verifier, state.key, headers, msg.data)
            except Exception:
                # Outside the judge's guard, which terminates a message that breaks it: a
                # fault here must not fail the batch. The judge checks it again, there.
                continue
            verified[id(msg)] = (state.verifier, read)
        return verified

    def _after_judging(self) -> None:
        """Pack the bodies of the heartbeats accepted since the last call, then hand the
        counts and the newest delivery to the metrics: once per batch, not per heartbeat.
        Packed in one loop, zstd's code and tables stay in the core's caches (about 2 % of
        a heartbeat's CPU); each metric update takes a lock."""
        pack = self.nodes.bodies.pack
        for state, body in self._to_pack:
            state.body = pack(body)
        self._to_pack.clear()
        if self._accepted:
            self.metrics.accepted.inc(self._accepted)
            self._accepted = 0
        if self._last_delivery is not None:
            self.metrics.processed(*self._last_delivery)
            self._last_delivery = None

    async def handle(self, msg: Msg) -> None:
        """Apply one message of FLEET_HB and do its I/O. Never raises for bad input: it
        alerts."""
        steps = self.judge(msg)
        self._after_judging()
        for step in steps:
            await step()

    def judge(self, msg: Msg, fetched: bool = False) -> list[Step]:
        """Apply one message of FLEET_HB to the in-memory state; return the I/O to do (in
        order). ``fetched``: the node's trusted key and record were just read afresh."""
        subject = msg.subject
        try:
            partition, cluster, node = self._split(subject)
        except InvalidToken:
            self.metrics.dropped.labels("malformed_subject").inc()
            log.warning("heartbeat on a malformed subject", extra={"subject": subject})
            return []
        ahead = self._verified.get(id(msg))
        stream_seq, stored, pending = delivery(msg) if ahead is None else ahead[1]
        self._last_delivery = (stored, pending, partition)
        headers = msg.headers or {}
        state = self.nodes.get(node)
        if (
            state is None
            and not fetched
            and (
                MARKER_REASON in headers
                or self.store.cached_key(node) != headers.get(signing.HEADER_KEY)
            )
        ):
            # A node with no record in memory is read afresh, unless it is one the trust
            # watch knows, signing with its approved key: every record was loaded when
            # this owner took over and it writes every new one itself, so there is none
            # to read (only a pending one a registration made, which accepting replaces).
            return [partial(self._fetch_and_judge, msg, node)]
        if MARKER_REASON in headers:
            return self._mark_stale(cluster, node, headers[MARKER_REASON], stored, msg.data)
        if state is not None and record_rules.judged_before(state.record, stream_seq, stored):
            self.metrics.dropped.labels("late_delivery").inc()
            return []
        try:
            heartbeat, public_key = self._verify(msg, headers, cluster, node, state, fetched)
            return self._accept(
                heartbeat, public_key, stream_seq, stored, partition, fetched, msg.data
            )
        except _NeedsFetch:
            return [partial(self._fetch_and_judge, msg, node)]
        except Refused as refusal:
            self.metrics.refused.labels(refusal.kind).inc()
            log.warning(
                "heartbeat refused",
                extra={"node": node, "kind": refusal.kind, "reason": refusal.message},
            )
            return self._on_refused(cluster, node, refusal, stream_seq)
        except LateDelivery:
            self.metrics.dropped.labels("late_delivery").inc()
            log.debug("older heartbeat delivered late; ignored", extra={"node": node})
            return []

    async def _fetch_and_judge(self, msg: Msg, node: str) -> None:
        """The slow path: read the node's trusted key and record afresh (an approval, a
        new key or an operator's ``reset-seq`` a moment ago), then judge again."""
        self._fresh_keys[node] = await self.store.trusted_key(node, fresh=True)
        nodes = await self.bus.kv(self.subjects.bucket_name(BUCKET_NODES))
        try:
            record = await kv.read(nodes, node, NodeRecord)
        except DecodeError as exc:
            # Never overwritten: a newer aggregator may know what this one cannot read.
            self.metrics.records_unreadable.inc()
            log.error("unreadable record skipped", extra={"node": node, "reason": str(exc)})
            return
        state = self.nodes.get(node)
        if state is None and record is not None:
            state = self.nodes[node] = hot_state.from_record(
                record, time.monotonic(), self.nodes.bodies
            )
        elif state is not None and record is not None:
            self._adopt(state, record)
            if record.seq_reset:
                state.record = msgspec.structs.replace(state.record, seq_reset=True)
        if state is not None:
            state.refreshed = time.monotonic()
        try:
            steps = self.judge(msg, fetched=True)
        finally:
            self._fresh_keys.pop(node, None)
            self._after_judging()
        for step in steps:
            await step()

    def _split(self, subject: str) -> tuple[int, str, str]:
        """(partition, cluster, node) of a stored heartbeat subject: the partition token
        must be the node's (only the stream's transform writes it), a 4-token subject of
        the old layout is refused. The subject of a node in memory, in its record's
        cluster, is checked against what its state holds (its partition, once checked in
        full): no cache of subjects, which cost ~170 bytes a node; any other subject is
        checked in full."""
        head, _, node = subject.rpartition(".")
        head, _, cluster = head.rpartition(".")
        base, _, token = head.rpartition(".")
        state = self.nodes.get(node)
        if (
            state is not None
            and state.partition >= 0
            and token == str(state.partition)
            and cluster == state.record.cluster
            and base == self._heartbeat_base
        ):
            return state.partition, state.record.cluster, state.record.node_id
        partition, cluster, node = self.subjects.split_stored_heartbeat(subject)
        if partition != partition_of(node, self.partition_count):
            raise InvalidToken("heartbeat partition", subject)
        if state is not None:
            state.partition = partition
        # Interned: kept per node, as the records and tables beside it keep the same.
        return partition, sys.intern(cluster), sys.intern(node)

    def _trusted(self, node: str, fetched: bool) -> str | None:
        if fetched:
            return self._fresh_keys.get(node)
        return self.store.cached_key(node)

    def _verify(
        self,
        msg: Msg,
        headers: dict[str, str],
        cluster: str,
        node: str,
        state: NodeState | None,
        fetched: bool,
    ) -> tuple[Heartbeat, str]:
        """The signature first (over the bytes received, with the node's verifier kept in
        memory), the body only then."""
        if ROLLUP in headers:
            raise Refused(
                "bad_signature",
                "heartbeat carries a Nats-Rollup header (it purged earlier heartbeats)",
                rollup=headers[ROLLUP][:16],
            )
        signer = headers.get(signing.HEADER_KEY)
        trusted = self._trusted(node, fetched)
        if (trusted is None or trusted != signer) and not fetched:
            # Refusing costs a fresh read: the node may have been approved (or given a
            # new key) a moment ago, before the trust watch delivered it.
            raise _NeedsFetch
        if trusted is None:
            raise Refused("unknown_node", f"node {node} has no approved key")
        try:
            if signer != trusted:
                signing.verify(headers, msg.data)
                raise Refused(
                    "unknown_node",
                    "signed by a key that is not the node's approved key",
                    key=signer or "",
                )
            if state is None or state.verifier is None or state.key != trusted:
                verifier = signing.verify_key(trusted)
                if state is not None:
                    state.key, state.verifier = trusted, verifier
                else:
                    # A node's first heartbeat: its state, made on accepting, keeps it.
                    self._new_verifier = (trusted, verifier)
            else:
                verifier = state.verifier
            ahead = self._verified.get(id(msg))
            if ahead is None or ahead[0] != verifier:
                signing.verify_with(verifier, trusted, headers, msg.data)
        except SignatureError as exc:
            raise Refused("bad_signature", exc.reason, key=exc.public_key) from None
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
        return heartbeat, trusted

    def _accept(
        self,
        heartbeat: Heartbeat,
        public_key: str,
        stream_seq: int,
        stored: float,
        partition: int,
        fetched: bool,
        body: bytes = b"",
    ) -> list[Step]:
        """Accept a verified ``heartbeat`` (its bytes: ``body``) into the node's state, or
        raise Refused (LateDelivery, _NeedsFetch); return the alerts and writes to do."""
        now = time.time()
        node = sys.intern(heartbeat.node_id)  # kept by the checkpoint queue: one per node
        state = self.nodes.get(node)
        fingerprint = record_rules.gpu_fingerprint(heartbeat)
        if state is not None and record_rules.is_steady(
            state.record, heartbeat, public_key, fingerprint
        ):
            # Most heartbeats: no alert, no transition, only the next checkpoint to make.
            state.record = record_rules.steady_beat(
                state.record,
                heartbeat,
                now,
                stream_seq,
                stored,
                hot_state.slim_heartbeat(heartbeat, state.record),
            )
            self._took(node, state, heartbeat, body)
            self.checkpoints.push(node, state)
            return []
        previous = (
            state.record
            if state is not None
            else record_rules.pending_record(node, heartbeat.cluster, public_key)
        )
        verdict = record_rules.judge_seq(
            previous, heartbeat.seq, self.config.max_seq_jump, public_key
        )
        if verdict != "next":
            if stream_seq <= previous.last_stream_seq:
                # Delivered again (a redelivery after a failover) or late: already seen.
                raise LateDelivery
            refreshed = state.refreshed if state is not None else 0.0
            if not fetched and time.monotonic() - refreshed > REFRESH_INTERVAL:
                raise _NeedsFetch  # an operator's reset-seq may be waiting in fleet_nodes
        elif not fetched and record_rules.new_key_epoch(previous, public_key):
            # A re-imaged node's first beat under its new key: the operator's reset-seq
            # that may come with it is in fleet_nodes only, and this beat uses it up.
            raise _NeedsFetch
        if verdict == "replay":
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
        # After the seq checks, so a late delivery stays one.
        left = record_rules.deregistered_refusal(previous, heartbeat)
        if left is not None:
            if not fetched:
                # Always read afresh (no REFRESH_INTERVAL): an operator may have re-admitted
                # the node a moment ago, and a deregistered node beats only a few times
                # (its agent exits on learning it).
                raise _NeedsFetch
            raise Refused(left.kind, left.message, **left.details)
        # The record kept in memory is slim; the heartbeat's bytes are kept beside it.
        after = record_rules.accepted(
            previous,
            heartbeat,
            public_key,
            now,
            stream_seq,
            stored,
            fingerprint,
            hot_state.slim_heartbeat(heartbeat, previous),
        )
        if state is None:
            state = self.nodes[node] = NodeState(after, time.monotonic())
            if self._new_verifier is not None and self._new_verifier[0] == public_key:
                state.key, state.verifier = self._new_verifier
            transition = True
        else:
            state.record = after
            transition = record_rules.is_transition(previous, after)
        if previous.seq_reset:
            state.reset_consumed = True
        # The first heartbeat after a load may follow heartbeats accepted but not yet
        # checkpointed by the previous owner: no gap to report.
        gaps = not state.fresh and (
            heartbeat.seq <= previous.last_seq + 1
            or self._read_in_time(partition, stored, heartbeat.interval)
        )
        self._took(node, state, heartbeat, body)
        steps: list[Step] = []
        hardware = record_rules.hardware_alert(previous, heartbeat, fingerprint)
        for kind, message, details, severity in record_rules.heartbeat_alerts(
            previous, after, heartbeat, gaps_are_news=gaps
        ) + ([hardware] if hardware else []):
            # Lifecycle alerts name their own event, so every aggregator derives one id.
            event = details.pop("event", f"q{heartbeat.seq}")
            steps.append(
                partial(
                    self.alerts.publish,
                    kind,
                    heartbeat.cluster,
                    node,
                    message,
                    event,
                    details,
                    severity,
                )
            )
        if transition or steps:
            # Alerts before the write: a crash between the two raises the alert again
            # (same id, dropped by JetStream), never loses it.
            steps.append(partial(self.write, node))
        else:
            self.checkpoints.push(node, state)
        return steps

    def _read_in_time(self, partition: int, stored: float, interval: float) -> bool:
        """Whether a gap before the heartbeat stored at ``stored`` is the node's: this
        owner had read the partition to its end within the half interval before. The
        beat before it, stored about an interval earlier, was then read had it been
        stored; FLEET_HB keeps one heartbeat per node, so behind the stream a beat not
        yet read is replaced by the next, and the gap is this owner's doing. (Beats
        stored closer together than half an interval, as a reconnecting agent may send
        them, can still look like a gap; server and aggregator clocks must agree to well
        within half an interval, as NTP keeps them.)"""
        puller = self._pullers.get(partition)
        return puller is not None and puller.caught_up.within(stored - interval / 2, stored)

    def _took(self, node: str, state: NodeState, heartbeat: Heartbeat, body: bytes) -> None:
        """What every accepted heartbeat does to its node's state, beside its record."""
        self.refusals.on_accepted(node)
        self._to_pack.append((state, body or codec.encode(heartbeat)))
        state.fresh = False
        state.dirty = True
        self._accepted += 1

    async def write(self, node: str) -> None:
        """Write the node's in-memory record to ``fleet_nodes`` (compare-and-set, read
        again on a conflict). The record written is the newest at the moment of writing.
        A record whose stored revision this owner knows goes out with every other such
        write of the moment, at once (:meth:`_write_known`); a conflict there, or a
        revision not known, takes the careful way (:meth:`_write`)."""
        state = self.nodes.get(node)
        if state is None:
            return  # not (or no longer) this aggregator's node
        writing = self._writing[node] = asyncio.get_running_loop().create_future()
        try:
            if not await self._write_known(node, state):
                await self._write(node, state)
        finally:
            writing.set_result(None)
            if self._writing.get(node) is writing:
                del self._writing[node]

    async def _write_known(self, node: str, state: NodeState) -> bool:
        """Write the record over the stored one this owner knows, in the batch of writes
        of this moment (one :func:`kv.update_many` per turn of the event loop: a publish
        each, where nats-py's ``update`` costs a request, a future and a timer). True if
        written; False if the revision is not known or the store holds another."""
        known, revision = state.stored, state.revision
        if known is None and revision is None:
            # A node this owner took in by accepting its heartbeat: every record of its
            # partitions was loaded or written here, so it has none (revision 0: the
            # write is refused if one came meanwhile, a registration's elsewhere).
            revision = 0
        elif known is None or revision is None:
            return False
        mine, kept = self._render(state, None, read=False)
        body = hot_state.encoded(kept, state.body, self.nodes.bodies)
        answer: asyncio.Future[int | None] = asyncio.get_running_loop().create_future()
        if not self._batch:
            asyncio.get_running_loop().call_soon(self._send_batch)
        self._batch.append((node, body, revision, answer))
        written = await answer
        if written is None:
            return False
        if self.nodes.get(node) is state:
            self._wrote(node, state, mine, known, None, kept, written)
        return True

    def _send_batch(self) -> None:
        batch, self._batch = self._batch, []
        task = asyncio.get_running_loop().create_task(self._send(batch))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _send(self, batch: list[tuple[str, bytes, int, asyncio.Future[int | None]]]) -> None:
        """One batch of writes; a write not done (or the batch failing) answers None, so
        its writer takes the careful way, which raises what is wrong."""
        revisions: list[int | None] = [None] * len(batch)
        try:
            revisions = await kv.update_many(
                self.bus,
                self.subjects.bucket_name(BUCKET_NODES),
                [(node, body, revision) for node, body, revision, _ in batch],
                WRITE_TIMEOUT,
            )
        except (nats.errors.Error, OSError) as exc:
            log.warning("batch of record writes failed", extra={"reason": str(exc)})
        finally:
            for (*_, answer), revision in zip(batch, revisions, strict=True):
                if not answer.done():
                    answer.set_result(revision)

    async def _write(self, node: str, state: NodeState) -> None:
        mine: NodeRecord | None = None
        kept: NodeRecord | None = None
        known = state.stored

        def change(stored: NodeRecord | None) -> NodeRecord:
            nonlocal mine, kept
            mine, kept = self._render(state, stored, read=True)
            return hot_state.full(kept, state.body, self.nodes.bodies)

        before, written, revision = await self.store.update(node, change)
        self._wrote(
            node, state, mine, known, before, kept if written is not None else None, revision
        )

    def _render(
        self, state: NodeState, stored: NodeRecord | None, read: bool
    ) -> tuple[NodeRecord, NodeRecord]:
        """(the in-memory record now, the record to write in its slim form): what to write
        over ``stored``, the record just read if ``read``, else over the one this owner
        last read or wrote. The slim form is most often the in-memory record itself, which
        then stays as it is once written; the whole record is the slim one with the kept
        heartbeat (:func:`hot_state.encoded`, :func:`hot_state.full`)."""
        mine = state.record
        stored_reset = state.stored_reset
        if read:
            # The rules compare slim records (as kept in memory); the whole one is written.
            stored = slim(stored) if stored is not None else None
            stored_reset = stored is not None and stored.seq_reset
            # An operator's forget or re-admission written since is kept, not undone.
            ours = record_rules.operator_changes(mine, stored, state.stored)
        else:
            ours = mine
        return mine, record_rules.checkpoint(stored_reset, ours, state.reset_consumed)

    def _wrote(
        self,
        node: str,
        state: NodeState,
        mine: NodeRecord | None,
        known: bytes | None,
        before: NodeRecord | None,
        kept: NodeRecord | None,
        revision: int | None,
    ) -> None:
        """The state after the record whose slim form is ``kept`` (rendered from
        ``mine``; None: nothing written) was written at ``revision`` over ``before``
        (read, or None: the one whose digest ``known`` was when the write started). The
        slim form is taken as it is, not made again from the whole record written: a
        checkpoint leaves the in-memory record the same object, and allocates nothing to
        keep (a checkpoint wave of 100,000 nodes otherwise replaced every record at once)."""
        state.revision = revision
        state.written = time.monotonic()
        if kept is not None:
            state.stored, state.stored_reset = record_rules.digest(kept), kept.seq_reset
        if state.record is mine:
            state.dirty = False
            state.reset_consumed = False
            if kept is not None:
                state.record = kept
        else:
            # Heartbeats judged while writing: they keep what the operator wrote too.
            before = slim(before) if before is not None else None
            state.record = record_rules.operator_changes(state.record, before, known)
            if state.dirty:
                self.checkpoints.push(node, state)
        self.metrics.record_writes.inc()

    async def _checkpoint_forever(self) -> None:
        """Write the records of nodes that only kept beating, each once per
        ``checkpoint_interval``, a bounded number of writes in flight."""
        while True:
            stop_if_cancelled()
            await asyncio.sleep(CHECKPOINT_TICK)
            due = self.checkpoints.due(time.monotonic(), CHECKPOINTS_PER_TICK, self.nodes)
            for start in range(0, len(due), CHECKPOINTS_IN_FLIGHT):
                chunk = due[start : start + CHECKPOINTS_IN_FLIGHT]
                results = await asyncio.gather(
                    *(self.write(node) for node in chunk), return_exceptions=True
                )
                for node, result in zip(chunk, results, strict=True):
                    if isinstance(result, BaseException):
                        if not isinstance(result, Exception):
                            raise result
                        log.warning(
                            "checkpoint failed; retried later",
                            extra={"node": node, "reason": str(result)},
                        )
                        state = self.nodes.get(node)
                        if state is not None:
                            self.checkpoints.push(node, state)

    def _mark_stale(
        self, cluster: str, node: str, reason: str, marked_at: float, body: bytes
    ) -> list[Step]:
        """A TTL marker makes the node stale, if it can be the server's (see
        :func:`record_rules.marker_is_real`); a forged one is counted and ignored."""
        state = self.nodes.get(node)
        record = state.record if state is not None else None
        if not record_rules.marker_is_real(record, marked_at, body):
            self.metrics.dropped.labels("forged_marker").inc()
            log.warning("forged TTL marker ignored", extra={"node": node, "reason": reason})
            return []
        self.metrics.markers.inc()
        if state is None or record is None or record.stale_since is not None or record.deregistered:
            return []
        stale = record_rules.with_state(record, stale_since=time.time())
        state.record = stale
        state.dirty = True
        self.stale.add(node)
        stale_after = stale.heartbeat.stale_after if stale.heartbeat else 0.0
        return [
            partial(
                self.alerts.publish,
                "stale",
                cluster,
                node,
                f"no heartbeat for {stale_after:g}s (server marker: {reason})",
                f"q{stale.last_seq}",
                # When the server stored its marker: how long after the TTL ran out the
                # server marked the node, and how long the alert took after that.
                {"last_seq": str(stale.last_seq), "marked_at": f"{marked_at:.3f}"},
            ),
            partial(self.write, node),
        ]

    async def sweep(self, everything: bool = False) -> None:
        """Stale records older than ``offline_after`` become offline. Only the nodes this
        aggregator saw go stale are checked, unless ``everything``: then every record is
        read (batched direct gets), records registered since are taken into memory, the
        silent nodes whose TTL marker never came are marked stale (see
        :func:`record_rules.silent_without_marker`), pending records older than
        ``pending_expire_after`` are deleted and the pending ones left counted (the cap on
        registrations). The rules run on the owner's in-memory records."""
        now = time.time()
        grace = self.config.full_sweep_interval

        def change(record: NodeRecord) -> NodeRecord | None:
            if record.offline_since:
                return None
            if record.stale_since is None:
                if everything and record_rules.silent_without_marker(record, now, grace):
                    return record_rules.with_state(record, stale_since=now)
                return None
            if now - record.stale_since < self.config.offline_after:
                return None
            return record_rules.with_state(record, offline_since=now)

        if everything and (self.partitions is None or self.partitions.held):
            await self._take_in_new_records()
        candidates = list(self.nodes) if everything else list(self.stale)
        expire_after = self.config.pending_expire_after
        pending = 0
        for node in candidates:
            state = self.nodes.get(node)
            if state is None:
                self.stale.discard(node)
                continue
            before = state.record
            if record_rules.pending_expired(before, now, expire_after):
                if await self.store.delete_if(
                    node, lambda record: record_rules.pending_expired(record, now, expire_after)
                ):
                    log.info("pending registration expired", extra={"node": node})
                    self.nodes.pop(node, None)
                    continue
            if before.state == "pending":
                pending += 1
            after = change(before)
            if after is not None:
                state.record = after
                state.dirty = True
            current = after or before
            if current.stale_since is not None and not current.offline_since:
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
            if after is not None:
                await self.write(node)
        if everything:
            self.pending = pending

    async def _take_in_new_records(self) -> None:
        """Records of this aggregator's partitions it has not in memory (registrations
        answered by another aggregator) are read and taken in."""
        bucket = self.subjects.bucket_name(BUCKET_NODES)
        now = time.monotonic()
        taken: set[str] = set()
        """Nodes taken in by this scan: a later value of theirs in it replaces them."""
        async for entries in kv.latest_pages(self.bus, bucket, LOAD_TIMEOUT):
            for node, value, _ in entries:
                if not self.owns(node) or (node in self.nodes and node not in taken):
                    continue
                if node in taken:
                    self.nodes.pop(node, None)
                    taken.discard(node)
                if value is None or len(self.nodes) >= MAX_NODES:
                    continue
                try:
                    self.nodes[node] = hot_state.from_stored(node, value, now, self.nodes.bodies)
                except DecodeError:
                    continue  # counted when it was loaded or fetched
                taken.add(node)

    async def _sweep_forever(self) -> None:
        last_full = 0.0
        while True:
            stop_if_cancelled()
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

    def _on_refused(self, cluster: str, node: str, refusal: Refused, stream_seq: int) -> list[Step]:
        """The I/O a refusal needs: the alert (``deregistered_node_beating`` once per
        boot, the rest through the publisher's rate limit), then the refusal kind noted in
        the node's in-memory record and written for the node to read (at most once per
        ``refused_note_every`` per kind). The node is remembered for :meth:`sweep_refused`."""
        if node not in self.stale:
            self.refusals.on_refused(node)
        steps: list[Step] = []
        if refusal.kind != "deregistered_node_beating" or self.refusals.first_of_boot(
            node, refusal.details.get("boot_id", "")
        ):
            steps.append(
                partial(
                    self.alerts.publish,
                    refusal.kind,
                    cluster,
                    node,
                    refusal.message,
                    refusal.details.pop("event", f"s{stream_seq}"),
                    refusal.details,
                )
            )
        state = self.nodes.get(node)
        if state is not None and self.refusals.should_note(node, refusal.kind, time.monotonic()):
            every = self.config.refused_note_every
            noted = record_rules.mark_refused(state.record, refusal.kind, time.time(), every)
            if noted is not None:
                # A state change the node reads: written now, not at a checkpoint.
                state.record = noted
                state.dirty = True
                steps.append(partial(self._write_quietly, node, "refusal not noted"))
        return steps

    async def _write_quietly(self, node: str, what: str) -> None:
        """:meth:`write`, a failure logged (the next checkpoint writes it again)."""
        try:
            await self.write(node)
        except (nats.errors.Error, RuntimeError) as exc:
            log.warning(what, extra={"node": node, "reason": str(exc)})
            state = self.nodes.get(node)
            if state is not None:
                self.checkpoints.push(node, state)

    async def sweep_refused(self) -> None:
        """Refused nodes whose last accepted heartbeat is older than its ``stale_after``
        become stale: their refused messages keep the TTL marker from firing. Judged on
        the owner's in-memory records, the stale state written at once."""
        now = time.time()
        for node in list(self.refusals.refused):
            state = self.nodes.get(node)
            if state is None:
                self.refusals.forget(node)
                continue
            record = state.record
            if not record_rules.refused_silent(record, now):
                if record.stale_since is not None or record.deregistered:
                    self.refusals.forget(node)
                continue
            stale = record_rules.with_state(record, stale_since=now)
            state.record = stale
            state.dirty = True
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
            await self.write(node)

    # Operator writes (forget, approve) ------------------------------------------------------

    def _adopt(self, state: NodeState, record: NodeRecord) -> None:
        """Take what an operator wrote into ``record`` (read afresh) into memory."""
        kept = slim(record)
        state.record = record_rules.operator_changes(state.record, kept, state.stored)
        state.stored, state.stored_reset = record_rules.digest(kept), kept.seq_reset

    def _on_trust_change(self, node: str) -> None:
        """The trust watch saw ``node``'s key approved or revoked: ``fleetctl forget`` and
        ``fleetctl approve`` do that beside their record writes, so the record is read
        again (:meth:`_reread_forever`) and a refusal reads it afresh at once."""
        state = self.nodes.get(node)
        if state is None:
            return
        state.refreshed = 0.0
        if len(self._reread) < MAX_NODES:
            self._reread.add(node)
            self._reread_due.set()

    async def _reread_forever(self) -> None:
        """Read the records of nodes whose trust changed, so a forgotten node that never
        beats again is not marked stale, checkpointed or alerted on from stale memory."""
        nodes = await self.bus.kv(self.subjects.bucket_name(BUCKET_NODES))
        while True:
            stop_if_cancelled()
            await self._reread_due.wait()
            self._reread_due.clear()
            while self._reread:
                node = self._reread.pop()
                try:
                    record = await kv.read(nodes, node, NodeRecord)
                except (DecodeError, nats.errors.Error) as exc:
                    log.warning("record not read again", extra={"node": node, "reason": str(exc)})
                    continue
                state = self.nodes.get(node)
                if state is not None and record is not None:
                    self._adopt(state, record)

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

        before, created, revision = await self.store.update(node, change)
        if created is not None:
            self.pending += 1
            if self.owns(node) and node not in self.nodes:
                # The node's first heartbeat comes here: its record is known, not read.
                state = self.nodes[node] = hot_state.from_record(
                    created, time.monotonic(), self.nodes.bodies
                )
                state.revision = revision
        elif before is None and status == "pending":
            return RegistrationReply(
                node_id=node, status="rejected", reason="too many pending registrations"
            )
        return RegistrationReply(
            node_id=node, status=status, reason=enrolled.reason if enrolled else ""
        )
