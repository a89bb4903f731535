"""Which heartbeats are this aggregator's: the partitions of ``FLEET_HB`` it holds, each
one's consumer and the stream sequence it resumes from, and whose a heartbeat is.

Leases and their balance are :mod:`actors.fleet.aggregator.partitions` (one lease:
:mod:`actors.fleet.aggregator.lease`); this module is what holding a partition means. A partition
gained has its records loaded into the ledger (one scan for all gained at once), its
consumer opened from its resume point and its heartbeats handed, a fetch at a time, to
the aggregator's handler. A partition lost has its consume loop stopped, its nodes let
go and their writes in flight waited for. Owns the consumers and consume loops; judges
nothing and writes no record.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Awaitable, Callable

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, RawStreamMsg

from actors.fleet.aggregator.lease import holder_id
from actors.fleet.aggregator.ledger import Ledger
from actors.fleet.aggregator.partitions import Partitions
from actors.fleet.aggregator.reads import RecordReads
from actors.fleet.aggregator.silence import Held
from actors.fleet.aggregator.writes import RecordWrites
from actors.fleet.config import AggregatorConfig
from actors.fleet.metrics import AggregatorMetrics
from actors.fleet.storage.streams import heartbeat_partitions
from actors.runtime import heap, kv
from actors.runtime.batch_pull import BatchPuller, CaughtUp, Chain, consume_in_batches
from actors.runtime.bus import Bus
from actors.runtime.consumer import DurableConsumer, without_leader
from schemas import signing
from schemas.errors import InvalidToken, SignatureError
from schemas.messages import NodeRecord
from schemas.subjects import (
    BUCKET_LEASES,
    STREAM_HEARTBEAT_INTAKE,
    STREAM_HEARTBEATS,
    Subjects,
    partition_of,
)

log = logging.getLogger(__name__)

NO_MESSAGE_FOUND = 10057
"""JetStream's error code for deleting a message that is not (or no longer) stored."""

GONE = RawStreamMsg()
"""What :meth:`Ownership._intake_latest` answers for a node FLEET_HB_IN holds nothing of."""
Handler = Callable[[list[Msg]], Awaitable[list[Chain]]]
UPSTREAM_TIMEOUT = 2.0
"""Seconds a read of a node's latest heartbeat in FLEET_HB_IN may take."""
FETCHES_IN_FLIGHT = 2
"""Partitions whose fetch is on its way or being judged at once (the others wait their
turn): what the connection holds ahead of a lease renewal's reply while behind is two
fetches (about 2 MB of 8-GPU heartbeats), not one per partition. One judges while the
next one's heartbeats arrive; the process judges one turn at a time anyway
(``aggregator.actor.JUDGED_PER_TURN``)."""


class _Seq(msgspec.Struct):
    """The one field of a heartbeat :meth:`Ownership.beating_upstream` reads."""

    seq: int


class Ownership:
    """One aggregator's partitions of FLEET_HB and their consumers; ``ledger`` holds the
    nodes of those partitions (read in by ``reads``, written by ``writes``)."""

    def __init__(
        self,
        config: AggregatorConfig,
        bus: Bus,
        subjects: Subjects,
        metrics: AggregatorMetrics,
        ledger: Ledger,
        reads: RecordReads,
        writes: RecordWrites,
    ) -> None:
        self.config = config
        self.bus = bus
        self.subjects = subjects
        self.metrics = metrics
        self.ledger = ledger
        self.reads = reads
        self.writes = writes
        self.partition_count = config.partitions
        """N of FLEET_HB (the stream's, once :meth:`prepare`\\ d)."""
        self.partitions: Partitions | None = None
        self.consumers: dict[int, DurableConsumer] = {}
        """The consumer of every partition this aggregator works on."""
        self.work: dict[int, asyncio.Task[None]] = {}
        self.since: dict[int, float] = {}
        """When this aggregator started consuming each partition it works on (wall clock):
        it has watched that partition's nodes since then."""
        self._pullers: dict[int, BatchPuller] = {}
        """Each consumed partition's puller: when it had read its partition to the end."""
        self._fetching = asyncio.Semaphore(FETCHES_IN_FLIGHT)
        """Shared by the partitions' consume loops (:data:`FETCHES_IN_FLIGHT`)."""
        self._resume_floor: dict[int, int] = {}
        """Per partition gained: the oldest stream seq its live records' checkpoints need."""
        self._group: asyncio.TaskGroup | None = None
        self._handle: Handler | None = None
        self._intake = subjects.stream_name(STREAM_HEARTBEAT_INTAKE)
        self._intake_seq = 0
        self._heartbeat_base = f"{subjects.prefix}.hb"

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
        for partition, consumer in sorted(self.consumers.items()):
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

    def holds_first(self) -> bool:
        """Whether this aggregator holds partition 0 (the duty of watching FLEET_HB's
        source: :mod:`actors.fleet.aggregator.source_watch`)."""
        return self.partitions is not None and self.partitions.holds(0)

    def owns(self, node: str) -> bool:
        """Whether ``node``'s partition is one this aggregator holds. An aggregator that is
        not running (driven directly: tests, benchmarks) holds no leases and owns all."""
        return self.partitions is None or self.partitions.holds(
            partition_of(node, self.partition_count)
        )

    def watched_since(self, node: str) -> float | None:
        """Since when this aggregator has consumed ``node``'s partition (None: it does not;
        driven directly, holding no leases, since it started: 0)."""
        if self.partitions is None:
            return 0.0
        return self.since.get(partition_of(node, self.partition_count))

    def working(self) -> bool:
        """Whether this aggregator holds a partition (or, driven directly, all)."""
        return self.partitions is None or bool(self.partitions.held)

    def split(self, subject: str) -> tuple[int, str, str]:
        """(partition, cluster, node) of a stored heartbeat subject: the partition token
        must be the node's (only the stream's transform writes it), a 4-token subject of
        the old layout is refused. The subject of a node in memory, in its record's
        cluster, is checked against what its state holds (its partition, once checked in
        full): no cache of subjects, which cost ~170 bytes a node; any other subject is
        checked in full."""
        head, _, node = subject.rpartition(".")
        head, _, cluster = head.rpartition(".")
        base, _, token = head.rpartition(".")
        state = self.ledger.nodes.get(node)
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

    async def drop(self, node: str, stream_seq: int) -> None:
        """Delete a refused heartbeat from FLEET_HB, before its fetch is acked: a judged
        heartbeat still stored was then accepted, which is how the views' live reads tell
        (actors/fleet/live/reader.py). Gone already if a newer one replaced it; a failure is
        logged (the views' own checks still refuse most such messages)."""
        stream = self.subjects.stream_name(STREAM_HEARTBEATS)
        try:
            await self.bus.js.delete_msg(stream, stream_seq)
        except nats.js.errors.APIError as exc:
            if exc.err_code != NO_MESSAGE_FOUND:
                log.warning(
                    "refused heartbeat not deleted", extra={"node": node, "reason": str(exc)}
                )
        except nats.errors.Error as exc:
            log.warning("refused heartbeat not deleted", extra={"node": node, "reason": str(exc)})

    async def beating_upstream(self, record: NodeRecord, key: str) -> bool | None:
        """Whether FLEET_HB_IN, which FLEET_HB sources, holds a heartbeat of ``record``'s
        node newer than its last accepted one, signed by ``key`` (its trusted key): the
        node beats, and FLEET_HB is behind its source (nats-server re-establishes a
        source whose stream changed leader only at its next 10 s stall check, sometimes
        tens of seconds later). None when the intake cannot be read (it has no leader
        either), or when its latest heartbeat of the node is older than the last one
        accepted: it lost heartbeats FLEET_HB stored (its leader is a server restarted
        empty), so it cannot tell either; nobody is accused on what nobody can tell."""
        msg = await self._intake_latest(record)
        if msg is None:
            return None
        if msg is GONE:
            return False  # its last heartbeat expired in the intake too
        try:
            if signing.verify(msg.headers, msg.data or b"") != key:
                return False
            beat = msgspec.json.decode(msg.data or b"", type=_Seq)
        except (SignatureError, msgspec.DecodeError):
            return False
        if beat.seq < record.last_seq:
            return None
        return beat.seq > record.last_seq

    async def hold_on(self, node: str, record: NodeRecord, key: str | None, held: Held) -> bool:
        """Whether a TTL marker due for ``node`` is held on instead of making it stale, and
        if so held again: FLEET_HB_IN says the node beats or cannot tell
        (:meth:`beating_upstream`, asked only of a node with a trusted ``key``), within
        ``bus_outage_max`` of the marker (:meth:`HeldMarkers.may_hold`)."""
        markers = self.ledger.held
        if key is None or not markers.may_hold(held, time.time()):
            return False
        if await self.beating_upstream(record, key) is False:
            return False
        markers.hold(node, held)
        return True

    async def intake_forgot(self, record: NodeRecord) -> bool:
        """Whether FLEET_HB_IN holds no heartbeat of ``record``'s node: its last one, kept
        with the same TTL as in FLEET_HB, expired there (the node sent nothing for its
        ``stale_after``). False when the intake holds one or cannot be read."""
        return await self._intake_latest(record) is GONE

    async def _intake_latest(self, record: NodeRecord) -> RawStreamMsg | None:
        """The latest heartbeat of ``record``'s node in FLEET_HB_IN; :data:`GONE` when it
        holds none, None when it cannot be read."""
        subject = self.subjects.heartbeat(record.cluster, record.node_id)
        try:
            async with asyncio.timeout(UPSTREAM_TIMEOUT):
                return await self.bus.js.get_msg(self._intake, subject=subject)
        except nats.js.errors.NotFoundError:
            return GONE
        except (nats.errors.Error, TimeoutError):
            return None

    async def intake_stored(self) -> float | None:
        """When FLEET_HB_IN last stored a heartbeat, if it stored one since the last call
        (None: nothing new, or unreadable): what the pulse learns of the nodes the other
        aggregators own, so one node dying alone in this owner's partitions is not taken
        for a silence of the whole stream."""
        try:
            async with asyncio.timeout(UPSTREAM_TIMEOUT):
                info = await self.bus.js.stream_info(self._intake)
                last = info.state.last_seq
                if last == self._intake_seq:
                    return None
                self._intake_seq = last
                msg = await self.bus.js.get_msg(self._intake, seq=last)
        except (nats.errors.Error, TimeoutError):
            return None
        return msg.time.timestamp() if msg.time is not None else None

    def caught_up(self, partition: int) -> CaughtUp | None:
        """When this owner had read ``partition`` to its end (None: not consuming it)."""
        puller = self._pullers.get(partition)
        return puller.caught_up if puller is not None else None

    async def prepare(self) -> None:
        """N from FLEET_HB (provisioned), and the leases of its partitions."""
        self.partition_count = await heartbeat_partitions(self.bus.js, self.subjects)
        self.metrics.partitions.set(self.partition_count)
        if self.partition_count != self.config.partitions:
            log.warning(
                "partitions setting differs from FLEET_HB's; the stream's is used",
                extra={"partitions": self.config.partitions, "used": self.partition_count},
            )
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

    async def run(self, group: asyncio.TaskGroup, handle: Handler) -> None:
        """Hold and balance leases until cancelled (then every partition is released),
        each held partition's heartbeats handed to ``handle`` by a task of ``group``."""
        assert self.partitions is not None
        self._group, self._handle = group, handle
        await self.partitions.run()

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
        everything = all(map(self.partitions.holds, range(self.partition_count)))
        self.ledger.nodes.everything = everything
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
            self.consumers[partition] = consumer
            self.work[partition] = task
            self.since[partition] = time.time()
            self.metrics.owns(partition)
        if failed:
            await self.partitions.release(failed)

    async def load(self, partitions: set[int]) -> None:
        """The records of ``partitions`` into the ledger (:meth:`RecordReads.load`), each
        partition's resume floor noted; what was taken in of a partition lost meanwhile
        goes again."""
        count = self.partition_count
        loaded, floors = await self.reads.load(partitions, count)
        for partition, floor in floors.items():
            self._resume_floor[partition] = min(floor, self._resume_floor.get(partition, floor))
        wanted = partitions
        if self.partitions is not None:
            lost = {p for p in partitions if not self.partitions.holds(p)}
            if lost:  # lost while reading: what was taken in of them goes again
                nodes = self.ledger.nodes
                self.ledger.drop([n for n in nodes if partition_of(n, count) in lost])
                wanted = partitions - lost
        log.info("records loaded", extra={"records": loaded, "partitions": sorted(wanted)})
        heap.give_back()  # the pages of the records read whole, and their messages

    async def _open(self, partition: int) -> DurableConsumer:
        start = await self._resume_point(partition)
        consumer = self.consumer(partition, start)
        # The previous owner's consumer, at its ack floor (or without a leader): read
        # again from ``start``.
        await consumer.drop()
        await consumer.open()
        return consumer

    async def _consume(self, partition: int, consumer: DurableConsumer) -> None:
        """One partition's heartbeats, until its work is stopped (cancelled)."""
        assert self._handle is not None
        # A partition its consumer leaves unread for a lease ttl is made again, from the
        # heartbeat after the last judged: an owner that cannot read it is no better
        # than one that died, whose partition another takes over after a ttl. Only while
        # its lease is not fenced: a fenced owner (paused past its ttl) may be looking at
        # the next owner's consumer.
        assert self.partitions is not None
        lease = self.partitions.leases[partition]
        puller = BatchPuller(
            self.bus,
            consumer,
            replace_after=self.config.lease_ttl,
            may_replace=lambda: not lease.fenced(),
        )
        self._pullers[partition] = puller
        try:
            await consume_in_batches(
                puller,
                self._handle,
                batch=self.config.fetch_batch,
                wait=1.0,
                what=f"heartbeat partition {partition}",
                dropped=self._count_drop,
                linger=self.config.fetch_linger,
                share=self._fetching,
            )
        finally:
            if self._pullers.get(partition) is puller:
                del self._pullers[partition]
            await puller.close()
            await consumer.close()

    def _count_drop(self, reason: str) -> None:
        self.metrics.dropped.labels(reason).inc()

    async def _lose(self, partitions: set[int]) -> None:
        """Partitions lost, fenced or released: their consume loops cancelled and waited
        for, their nodes dropped from memory, and the record writes of those nodes still
        in flight (a sweep's, a checkpoint's) waited for, at most the fence's margin. When
        this returns nothing of theirs runs here any more."""
        self.ledger.nodes.everything = False
        tasks = [self.work.pop(p) for p in partitions if p in self.work]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for partition in partitions:
            consumer = self.consumers.pop(partition, None)
            if consumer is not None:
                await consumer.close()
            self.since.pop(partition, None)
            self.metrics.forget(partition)
            self._resume_floor.pop(partition, None)
        count = self.partition_count
        nodes = self.ledger.nodes
        dropped = [node for node in nodes if partition_of(node, count) in partitions]
        self.ledger.drop(dropped)
        nodes.released += 1
        await self.writes.writes_done(dropped, self.config.lease_ttl / 4)
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
        except nats.js.errors.APIError as exc:
            if not without_leader(exc):
                raise
            # The consumer has no leader to tell its ack floor: the records' checkpoints
            # are where the state ends (judging more again is safe, less is not).
            log.warning(
                "ack floor unreadable; resuming from the records",
                extra={"partition": partition, "reason": str(exc) or "no responders"},
            )
            start = 1
        start = min(start, self._resume_floor.pop(partition, start))
        log.info("heartbeats resumed", extra={"partition": partition, "from_seq": start})
        return start
