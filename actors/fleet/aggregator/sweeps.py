"""The owner's sweeps: what changes about its nodes when no heartbeat comes.

Every ``sweep_interval``: stale records older than ``offline_after`` become offline (the
nodes seen going stale only), and refused nodes silent for their ``stale_after`` become
stale (their refused messages keep the TTL marker from firing; not while the whole stream
is silent, which may be the bus's silence), and the TTL markers held
through a silence of the stream (:mod:`~actors.fleet.aggregator.silence`) are believed
once it is over and their node has not beaten. Every
``full_sweep_interval``, the full sweep: every record, the silent nodes whose TTL marker
never came marked stale, records registered elsewhere taken in, pending registrations
expired and the pending ones counted, and nodes offline past ``retire_offline_after``
retired (:mod:`~actors.fleet.aggregator.retirement`). The rules run on the owner's in-memory records
(:mod:`actors.fleet.aggregator.record_rules`); the changes are written
(:mod:`~actors.fleet.aggregator.writes`), with their alerts. Owns the sweep schedule;
does not judge heartbeats.
"""

from __future__ import annotations

import asyncio
import logging
import time

import nats.errors
from nats.aio.msg import Msg

from actors.fleet import record_state
from actors.fleet.aggregator import judge
from actors.fleet.aggregator.judge import Moment, Stored
from actors.fleet.aggregator.ledger import Ledger
from actors.fleet.aggregator.lost_markers import CHECKS_PER_SWEEP, LeaderChanges
from actors.fleet.aggregator.ownership import Ownership
from actors.fleet.aggregator.reads import RecordReads
from actors.fleet.aggregator.retirement import Retirement
from actors.fleet.aggregator.silence import StreamPulse
from actors.fleet.aggregator.sweep_queue import SweepQueue, due
from actors.fleet.aggregator.writes import RecordWrites
from actors.fleet.alerts.publisher import AlertPublisher
from actors.fleet.config import AggregatorConfig
from actors.fleet.storage.node_store import NodeStore
from actors.runtime import heap
from actors.runtime.schedule import stop_if_cancelled, take_turn
from actors.runtime.spans import span
from actors.runtime.subscriptions import unsubscribe_quietly
from schemas.base import MAX_STALE_AFTER
from schemas.messages import NodeRecord
from schemas.subjects import STREAM_HEARTBEATS

log = logging.getLogger(__name__)

BUS_CLUSTER, BUS_NODE = "_fleet", "_bus"
"""What a ``bus_outage`` alert names for cluster and node: the bus, not one node."""
LEADER_ELECTED = "$JS.EVENT.ADVISORY.STREAM.LEADER_ELECTED"
"""JetStream's advisory of a stream's new leader (``.<stream>`` after it)."""
LOST_MARKER = "lost in a leader change: FLEET_HB_IN no longer holds its heartbeat"
"""The reason a lost marker's ``stale`` alert gives (lost_markers module)."""
SWEPT_PER_TURN = 1000
"""Nodes a sweep takes in one round of the event loop (a full sweep passes over every
held node: 0.8 s in one go at 100,000 nodes on a loaded machine)."""


def silent_without_marker(record: NodeRecord, now: float, grace: float, bound: float) -> bool:
    """A live record whose node has sent nothing for twice its ``stale_after`` (at most
    ``bound``, the aggregator's ``max_stale_after``) plus ``grace``, though no TTL marker
    came: the marker was lost (purged: a ``Nats-Rollup: all`` heartbeat did that before
    FLEET_HB_IN refused rollups), or never comes (no ``Nats-TTL``, or one longer than the
    node claims). Twice, and the grace, so a slow aggregator behind the stream does not
    call a live node stale."""
    if record.heartbeat is None or record.stale_since is not None or record.deregistered:
        return False
    if record.stopped_since is not None:
        return False  # it said goodbye: silence is expected
    return now - record.last_seen > 2 * min(record.heartbeat.stale_after, bound) + grace


def pending_expired(record: NodeRecord, now: float, after: float) -> bool:
    """A registration nobody approved (no heartbeat ever accepted) older than ``after``."""
    return (
        record.state == "pending"
        and record.last_seq == 0
        and record.pending_since is not None
        and now - record.pending_since > after
    )


def refused_silent(record: NodeRecord, now: float, bound: float = MAX_STALE_AFTER) -> bool:
    """A live record whose last accepted heartbeat is older than its ``stale_after`` (at
    most ``bound``): the node is stale even though messages (refused ones) keep arriving
    on its subject and so the server's TTL marker never fires."""
    if record.heartbeat is None or record.stale_since is not None or record.deregistered:
        return False
    return now - record.last_seen >= min(record.heartbeat.stale_after, bound)


def bus_silent(
    record: NodeRecord, pulse: StreamPulse, now: float, bound: float, outage_max: float
) -> bool:
    """Whether a refused node's silence may be the bus's: the stream stored nothing for
    half its ``stale_after`` (at most ``bound``) in one stretch of the ``stale_after``
    before ``now``, and its last accepted heartbeat is less than ``stale_after`` plus
    ``outage_max`` (the aggregator's ``bus_outage_max``) old. Its judgement then waits, as
    a TTL marker after such a silence is held (:mod:`~actors.fleet.aggregator.silence`):
    a replay refused just before a stall (an old heartbeat a frozen server stored late)
    must not make a node whose newer heartbeats are stuck behind the stall stale."""
    span = min(record.heartbeat.stale_after if record.heartbeat else bound, bound)
    return now < record.last_seen + span + outage_max and pulse.silent(now, span)


class Sweeps:
    """The sweeps of the nodes in ``ledger``, which ``ownership`` says are whose."""

    def __init__(
        self,
        config: AggregatorConfig,
        ledger: Ledger,
        reads: RecordReads,
        writes: RecordWrites,
        ownership: Ownership,
        store: NodeStore,
        alerts: AlertPublisher,
        retirement: Retirement,
    ) -> None:
        self.config = config
        self.ledger = ledger
        self.reads = reads
        self.writes = writes
        self.ownership = ownership
        self.store = store
        self.alerts = alerts
        self.retirement = retirement
        self.queue = SweepQueue(ledger.nodes, self._due)
        self.sweeps_done = 0
        """Sweeps that ran to their end (what a test waits for)."""
        self.leader_changes = LeaderChanges()
        """FLEET_HB's leader elections heard (:mod:`~actors.fleet.aggregator.lost_markers`)."""

    def _due(self, record: NodeRecord) -> float | None:
        config = self.config
        return due(
            record, config.full_sweep_interval, config.max_stale_after, config.pending_expire_after
        )

    async def run(self) -> None:
        """Sweep every ``sweep_interval`` (in full every ``full_sweep_interval``) until
        cancelled; a sweep the server fails is tried again at the next. FLEET_HB's leader
        elections are heard meanwhile, for :meth:`sweep_lost_markers`."""
        stream = self.ownership.subjects.stream_name(STREAM_HEARTBEATS)

        async def elected(msg: Msg) -> None:
            self.leader_changes.elected(time.time())

        subscription = await self.ownership.bus.subscribe(f"{LEADER_ELECTED}.{stream}", elected)
        try:
            await self._sweep_forever()
        finally:
            await unsubscribe_quietly(subscription)

    async def _sweep_forever(self) -> None:
        last_full = 0.0
        while True:
            stop_if_cancelled()
            await asyncio.sleep(self.config.sweep_interval)
            everything = time.monotonic() - last_full >= self.config.full_sweep_interval
            stored = await self.ownership.intake_stored()
            if stored is not None:
                self.ledger.pulse.stored(stored)
            try:
                await self.sweep(everything)
                await self.sweep_refused()
                await self.sweep_held()
                await self.sweep_lost_markers()
                await self.sweep_outages()
                if everything:
                    await self.retirement.sweep(time.time())
                await self.alerts.flush()
            except nats.errors.Error as exc:
                log.warning("offline sweep failed", extra={"reason": str(exc)})
                self.retirement.interrupted(time.time(), f"a sweep failed: {exc}")
                continue
            self.sweeps_done += 1
            if everything:
                last_full = time.monotonic()
                heap.give_back()  # what the heartbeats and writes since left free

    async def sweep(self, everything: bool = False) -> None:
        """Stale records older than ``offline_after`` become offline. Only the nodes this
        aggregator saw go stale are checked, unless ``everything``: then records
        registered elsewhere since the last are taken into memory, and of the nodes
        changed since or due (:class:`SweepQueue`: every node at the first) the
        silent ones whose TTL marker never came are marked stale (see
        :func:`silent_without_marker`), pending records older than
        ``pending_expire_after`` are deleted and the pending ones left counted (the cap on
        registrations). The rules run on the owner's in-memory records."""
        now = time.time()
        grace = self.config.full_sweep_interval

        def change(record: NodeRecord) -> NodeRecord | None:
            if record.offline_since:
                return None
            if record.stale_since is None:
                bound = self.config.max_stale_after
                if everything and silent_without_marker(record, now, grace, bound):
                    return record_state.with_state(record, stale_since=now)
                return None
            if now - record.stale_since < self.config.offline_after:
                return None
            return record_state.with_state(record, offline_since=now)

        ledger = self.ledger
        if everything and self.ownership.working():
            await self.reads.take_in_new(self.ownership.owns)
        candidates = self.queue.take(now) if everything else list(ledger.stale)
        expire_after = self.config.pending_expire_after
        for step, node in enumerate(candidates, 1):
            await take_turn(step, SWEPT_PER_TURN)
            state = ledger.nodes.get(node)
            if state is None:
                ledger.stale.discard(node)
                if everything:
                    self.queue.put(node)
                continue
            before = state.record
            if pending_expired(before, now, expire_after):
                if await self.store.delete_if(
                    node, lambda record: pending_expired(record, now, expire_after)
                ):
                    log.info("pending registration expired", extra={"node": node})
                    ledger.nodes.pop(node, None)
                    self.queue.put(node)
                    continue
            after = change(before)
            if after is not None:
                state.keep(after)
                state.dirty = True
            current = after or before
            if current.stale_since is not None and not current.offline_since:
                ledger.stale.add(node)  # stale, not offline yet: check again at the next sweep
            else:
                ledger.stale.discard(node)
            if after is not None and after.offline_since:
                await self.alerts.publish(
                    "offline",
                    after.cluster,
                    node,
                    f"stale for more than {span(self.config.offline_after)}",
                    f"q{after.last_seq}",
                )
            elif after is not None:
                silent = now - after.last_seen
                log.warning("node silent but no TTL marker came", extra={"node": node})
                await self.alerts.publish(
                    "stale",
                    after.cluster,
                    node,
                    f"no heartbeat for {span(silent)} and no server marker (lost or purged)",
                    f"q{after.last_seq}",
                    {"last_seq": str(after.last_seq)},
                )
            if after is not None:
                await self.writes.write(node)
            if everything:
                self.queue.put(node)
        if everything and candidates:
            # With no node changed or due since the last count, it would count the same.
            ledger.pending.recount(self.queue.pending_records())

    async def sweep_refused(self) -> None:
        """Refused nodes whose last accepted heartbeat is older than its ``stale_after``
        become stale: their refused messages keep the TTL marker from firing. Not while
        the stream was silent (:func:`bus_silent`). Judged on the owner's in-memory
        records, the stale state written at once."""
        now = time.time()
        ledger = self.ledger
        for node in list(ledger.refusals.refused):
            state = ledger.nodes.get(node)
            if state is None:
                ledger.refusals.forget(node)
                continue
            record = state.record
            if not refused_silent(record, now, self.config.max_stale_after):
                if record.stale_since is not None or record.deregistered:
                    ledger.refusals.forget(node)
                continue
            bound, outage_max = self.config.max_stale_after, self.config.bus_outage_max
            if bus_silent(record, ledger.pulse, now, bound, outage_max):
                continue  # judged once heartbeats flow again (or the outage bound passed)
            if await self._beats_past_a_replay(record, now):
                continue
            stale = record_state.with_state(record, stale_since=now)
            ledger.mark_stale(node, state, stale)
            ledger.refusals.forget(node)
            stale_after = stale.heartbeat.stale_after if stale.heartbeat else 0.0
            await self.alerts.publish(
                "stale",
                stale.cluster,
                node,
                f"no accepted heartbeat for {span(stale_after)} (its heartbeats are refused: "
                f"{stale.refused or 'unknown'})",
                f"q{stale.last_seq}",
                {"last_seq": str(stale.last_seq), "refused": stale.refused},
            )
            await self.writes.write(node)

    async def _beats_past_a_replay(self, record: NodeRecord, now: float) -> bool:
        """Whether a node refused for a ``replay`` (an old heartbeat stored late, say
        through a server that was paused) beats on: FLEET_HB_IN holds a heartbeat of it
        newer than its last accepted one, signed by its trusted key, or cannot be read
        (:meth:`Ownership.beating_upstream`; the owner's consumer or FLEET_HB is behind).
        Asked for ``stale_after`` plus ``bus_outage_max`` after its last accepted beat at
        most; never for the other refusals (a revoked key, a clock off: their newer beats
        are refused too)."""
        beat = record.heartbeat
        if record.refused != "replay" or beat is None:
            return False
        span = min(beat.stale_after, self.config.max_stale_after)
        if now >= record.last_seen + span + self.config.bus_outage_max:
            return False
        key = await self.store.trusted_key(record.node_id)
        if key is None:
            return False
        return await self.ownership.beating_upstream(record, key) is not False

    async def sweep_outages(self) -> None:
        """Each silence of the stream the nodes have beaten again after, once settled: one
        ``bus_outage`` alert (the outage module). Its id is the silence's start, so the
        aggregators that saw the same one raise it once."""
        for outage in self.ledger.outages.due(time.time()):
            log.warning("bus outage over", extra=outage.details())
            await self.alerts.publish(
                "bus_outage",
                BUS_CLUSTER,
                BUS_NODE,
                outage.message(),
                f"silence-{outage.start:.0f}",
                outage.details(),
            )

    async def sweep_held(self) -> None:
        """TTL markers held through a silence of the stream (the silence module) whose
        node has not beaten since the stream stored heartbeats again: stale now, with the
        marker's alert, written at once; unless FLEET_HB_IN holds a newer heartbeat of
        the node (FLEET_HB fell behind its source) or cannot tell: then held on, within
        ``bus_outage_max`` of the marker (:meth:`Ownership.hold_on`)."""
        ledger = self.ledger
        for node, held in ledger.held.due(ledger.pulse, time.time()):
            state = ledger.nodes.get(node)
            if state is None:
                continue
            key = await self.store.trusted_key(node)
            if await self.ownership.hold_on(node, state.record, key, held):
                # Its heartbeats reach the intake (FLEET_HB is what fell behind), or the
                # intake cannot tell: not stale on what nobody can tell.
                log.info("marker still held", extra={"node": node})
                continue
            await self._stale_by_marker(node, held.reason, held.stream_seq, held.marked_at)

    async def sweep_lost_markers(self) -> None:
        """While an election of FLEET_HB's leader is recent, the live nodes whose TTL
        marker fell due near it and has not come: stale with the marker's alert if
        FLEET_HB_IN no longer holds their heartbeat, unless the whole stream was silent
        (that is the held markers' case: :meth:`sweep_held`). See the lost_markers module."""
        now = time.time()
        changes = self.leader_changes
        if not changes.looking(now, self.config.sweep_interval):
            return
        ledger, bound = self.ledger, self.config.max_stale_after
        asked = 0
        for step, (node, state) in enumerate(list(ledger.nodes.items()), 1):
            await take_turn(step, SWEPT_PER_TURN)
            record = state.record
            if node in ledger.held.held or not changes.lost(record, now, bound):
                continue
            assert record.heartbeat is not None  # lost() says it is live
            if ledger.pulse.silent(now, min(record.heartbeat.stale_after, bound)):
                continue
            if asked == CHECKS_PER_SWEEP:
                break
            asked += 1
            if await self.ownership.intake_forgot(record):
                log.warning("TTL marker lost in a leader change; node stale", extra={"node": node})
                await self._stale_by_marker(node, LOST_MARKER, 0, time.time())

    async def _stale_by_marker(
        self, node: str, reason: str, stream_seq: int, marked_at: float
    ) -> None:
        """``node`` stale as a TTL marker (held, or lost) says, with its alert, written at
        once; nothing if a heartbeat of it was accepted since (judge.marker)."""
        state = self.ledger.nodes.get(node)
        if state is None:
            return
        try:
            verdict = judge.marker(
                state.record,
                reason,
                b"",
                Stored(stream_seq=stream_seq, at=marked_at),
                Moment(
                    now=time.time(),
                    monotonic=time.monotonic(),
                    max_skew=self.config.max_skew,
                    max_jump=self.config.max_seq_jump,
                ),
            )
        except judge.Forged:
            return  # a heartbeat was accepted since: nothing to mark
        if verdict is None:
            return
        self.ledger.mark_stale(node, state, verdict.record)
        for alert in verdict.alerts:
            details = dict(alert.details)
            event = details.pop("event")
            await self.alerts.publish(
                alert.kind, verdict.record.cluster, node, alert.message, event, details
            )
        await self.writes.write(node)
