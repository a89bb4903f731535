"""The owner's ledger: the in-memory table of its nodes and the writes that keep
``fleet_nodes`` in step with it.

Holds every owned node's :class:`NodeState` (:mod:`actors.fleet.hot_state`), the nodes
seen going stale, the refused ones (:class:`RefusalTracker`), the count of pending
records, and when the stream stored what was judged with the TTL markers held through a
silence of it (:mod:`actors.fleet.silence`); applies verdicts to the table
(:meth:`Ledger.accept`); writes records by compare-and-set (:meth:`Ledger.write`), those
whose stored revision it knows batched per turn of the event loop, the steady ones once
per ``checkpoint_interval``; reads records into the table (a cold start's scan, the slow
path's fresh read, an operator's change seen through the trust watch). Judges nothing
and raises no alert.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from collections.abc import Callable

import msgspec
import nats.errors

from actors.fleet import hot_state
from actors.fleet.config import AggregatorConfig
from actors.fleet.hot_state import CheckpointQueue, NodeState, NodeTable, slim, spread_written
from actors.fleet.judge import Verdict
from actors.fleet.metrics import AggregatorMetrics
from actors.fleet.node_store import NodeStore
from actors.fleet.pending import PendingCounts
from actors.fleet.refusals import RefusalTracker, mark_refused
from actors.fleet.silence import HeldMarkers, StreamPulse
from actors.fleet.streams import MAX_NODES
from actors.runtime import kv
from actors.runtime.bus import Bus
from actors.runtime.schedule import stop_if_cancelled
from schemas import codec
from schemas.errors import DecodeError
from schemas.messages import Heartbeat, NodeRecord
from schemas.subjects import BUCKET_NODES, Subjects, partition_of

log = logging.getLogger(__name__)

LOAD_TIMEOUT = 120.0
"""Seconds to read every record of fleet_nodes at a cold start (100,000 in a few)."""
CHECKPOINT_TICK = 0.5
CHECKPOINTS_PER_TICK = 4096
CHECKPOINTS_IN_FLIGHT = 256
WRITE_TIMEOUT = 5.0
"""Seconds a batch of record writes waits for the server's answers (then each is written
the careful way)."""
SETTLED = ("stale", "offline", "deregistered", "pending", "stopped")
"""Record states written when entered: no heartbeat after their checkpoint is missing."""

Write = tuple[str, bytes, int, asyncio.Future[int | None]]


def judged_past(stored: NodeRecord, mine: NodeRecord) -> bool:
    """Whether ``stored`` was written from a heartbeat later than ``mine``'s, both in the
    stream and in the node's sequence: another owner judged past this one."""
    return stored.last_stream_seq > mine.last_stream_seq and stored.last_seq > mine.last_seq


class Ledger:
    """One aggregator's node table and record writes (``fleet_nodes``, through
    ``store`` and batched KV updates)."""

    def __init__(
        self,
        config: AggregatorConfig,
        bus: Bus,
        subjects: Subjects,
        metrics: AggregatorMetrics,
        store: NodeStore,
    ) -> None:
        self.config = config
        self.bus = bus
        self.metrics = metrics
        self.store = store
        self.bucket = subjects.bucket_name(BUCKET_NODES)
        self.nodes = NodeTable()
        """The acceptance state of every node this aggregator owns (see hot_state)."""
        self.stale: set[str] = set()
        """Nodes this aggregator saw go stale: the offline sweep checks these often."""
        self.refusals = RefusalTracker(config.refused_note_every)
        self.checkpoints = CheckpointQueue(config.checkpoint_interval)
        self.pending = PendingCounts()
        """Pending records, in all and per key, as of the last full sweep plus those
        registered since."""
        self._accepted = 0
        self._to_pack: list[tuple[NodeState, bytes]] = []
        """The bodies of the heartbeats accepted while judging, packed once it is done
        (:meth:`settle`), before any write can read them."""
        self._writing: dict[str, asyncio.Future[None]] = {}
        """Record writes in flight, by node: a lost partition waits for its nodes' ones."""
        self._batch: list[Write] = []
        """Writes of this turn of the event loop, sent together (see :meth:`write`)."""
        self._sending: set[asyncio.Task[None]] = set()
        """The batches being sent (kept referenced until done)."""
        self._reread: set[str] = set()
        """Nodes whose trust entry changed: their records are read again."""
        self._reread_due = asyncio.Event()
        self.pulse = StreamPulse()
        """When FLEET_HB stored the heartbeats judged here (see actors.fleet.silence)."""
        self.held = HeldMarkers()
        """TTL markers that came after a silence of the whole stream, not yet believed."""

    # Verdicts into the table ----------------------------------------------------------------

    def accept(
        self,
        state: NodeState | None,
        verdict: Verdict,
        heartbeat: Heartbeat,
        body: bytes,
        key: str,
        verifier: bytes,
    ) -> None:
        """Take an accepted ``heartbeat`` (its bytes: ``body``, signed by ``key``) into
        the node's state (made, with the key's ``verifier``, for a node with none);
        queue its checkpoint unless ``verdict`` writes the record at once."""
        node = sys.intern(heartbeat.node_id)  # kept by the checkpoint queue: one per node
        if state is None:
            state = self.nodes[node] = NodeState(verdict.record, time.monotonic())
            state.key, state.verifier = key, verifier
        else:
            if state.record.seq_reset:
                state.reset_consumed = True
            state.record = verdict.record
        self.refusals.on_accepted(node)
        self.held.release(node)
        self._to_pack.append((state, body or codec.encode(heartbeat)))
        state.fresh = False
        state.dirty = True
        self._accepted += 1
        if not verdict.write:
            self.checkpoints.push(node, state)

    def mark_stale(self, node: str, state: NodeState, record: NodeRecord) -> None:
        """The node's ``record`` gone stale (its write follows)."""
        state.record = record
        state.dirty = True
        self.stale.add(node)

    def refused(self, node: str, kind: str, boot_id: str) -> tuple[bool, bool]:
        """A heartbeat of ``node`` refused as ``kind``: (whether to raise its alert:
        ``deregistered_node_beating`` once per boot, the rest always; whether the kind
        was noted in the node's record, to write for the node to read: at most once per
        ``refused_note_every`` per kind). The node is remembered for the refused sweep."""
        if node not in self.stale:
            self.refusals.on_refused(node)
        alert = kind != "deregistered_node_beating" or self.refusals.first_of_boot(node, boot_id)
        state = self.nodes.get(node)
        if state is None or not self.refusals.should_note(node, kind, time.monotonic()):
            return alert, False
        every = self.config.refused_note_every
        noted = mark_refused(state.record, kind, time.time(), every)
        if noted is None:
            return alert, False
        # A state change the node reads: written now, not at a checkpoint.
        state.record = noted
        state.dirty = True
        return alert, True

    def settle(self) -> None:
        """Pack the bodies of the heartbeats accepted since the last call and count them:
        once per batch, not per heartbeat. Packed in one loop, zstd's code and tables stay
        in the core's caches (about 2 % of a heartbeat's CPU); a metric update takes a
        lock."""
        pack = self.nodes.bodies.pack
        for state, body in self._to_pack:
            state.body = pack(body)
        self._to_pack.clear()
        if self._accepted:
            self.metrics.accepted.inc(self._accepted)
            self._accepted = 0

    def drop(self, nodes: list[str]) -> None:
        """Let ``nodes`` go (their partitions are no longer this owner's)."""
        for node in nodes:
            self.nodes.pop(node, None)
            self.stale.discard(node)
            self.refusals.forget(node)

    async def writes_done(self, nodes: list[str], timeout: float) -> None:
        """Wait, at most ``timeout``, for the record writes of ``nodes`` in flight."""
        writing = [self._writing[node] for node in nodes if node in self._writing]
        if writing:
            await asyncio.wait(writing, timeout=timeout)

    # Reading records into the table ------------------------------------------------------------

    async def load(self, wanted: set[int], count: int) -> tuple[int, dict[int, int]]:
        """The records of partitions ``wanted`` (of ``count``) into memory with one scan
        of ``fleet_nodes`` (batched direct gets, one request per 1,000 records, no
        consumer), each page taken in as it comes (the bucket's bytes are never all held
        at once), keys of other partitions skipped before anything is decoded,
        checkpoints spread. Returns the records loaded and each partition's resume floor:
        the oldest stream seq its live records' checkpoints need."""
        now = time.monotonic()
        interval = self.config.checkpoint_interval
        loaded = 0
        floors: dict[int, int] = {}
        self.nodes.loading = True
        try:
            # Closed as the loop stops, even by a raise: no page's inbox left subscribed.
            scan = kv.latest_pages(self.bus, self.bucket, LOAD_TIMEOUT)
            async with contextlib.aclosing(scan) as pages:
                async for entries in pages:
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
                                "unreadable record skipped",
                                extra={"node": node, "reason": str(exc)},
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
                            floor = floors.get(partition, record.last_stream_seq + 1)
                            floors[partition] = min(floor, record.last_stream_seq + 1)
        finally:
            self.nodes.loading = False
        return loaded, floors

    async def take_in_new(self, owns: Callable[[str], bool]) -> None:
        """Records of nodes this owner ``owns`` and has not in memory (registrations
        answered by another aggregator) are read and taken in."""
        now = time.monotonic()
        taken: set[str] = set()
        """Nodes taken in by this scan: a later value of theirs in it replaces them."""
        scan = kv.latest_pages(self.bus, self.bucket, LOAD_TIMEOUT)
        async with contextlib.aclosing(scan) as pages:  # closed as the loop stops (see load)
            async for entries in pages:
                for node, value, _ in entries:
                    if not owns(node) or (node in self.nodes and node not in taken):
                        continue
                    if node in taken:
                        self.nodes.pop(node, None)
                        taken.discard(node)
                    if value is None or len(self.nodes) >= MAX_NODES:
                        continue
                    try:
                        self.nodes[node] = hot_state.from_stored(
                            node, value, now, self.nodes.bodies
                        )
                    except DecodeError:
                        continue  # counted when it was loaded or fetched
                    taken.add(node)

    async def refresh(self, node: str) -> bool:
        """The slow path's read: the node's record afresh (an approval or an operator's
        ``reset-seq`` a moment ago) into memory. False if it cannot be read (never
        overwritten: a newer aggregator may know what this one cannot read)."""
        nodes = await self.bus.kv(self.bucket)
        try:
            record = await kv.read(nodes, node, NodeRecord)
        except DecodeError as exc:
            self.metrics.records_unreadable.inc()
            log.error("unreadable record skipped", extra={"node": node, "reason": str(exc)})
            return False
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
        return True

    def _adopt(self, state: NodeState, record: NodeRecord) -> None:
        """Take what an operator wrote into ``record`` (read afresh) into memory."""
        kept = slim(record)
        state.record = hot_state.operator_changes(state.record, kept, state.stored)
        state.stored, state.stored_reset = hot_state.digest(kept), kept.seq_reset

    def on_trust_change(self, node: str) -> None:
        """The trust watch saw ``node``'s key approved or revoked: ``fleetctl forget`` and
        ``fleetctl approve`` do that beside their record writes, so the record is read
        again (:meth:`reread_forever`) and a refusal reads it afresh at once."""
        state = self.nodes.get(node)
        if state is None:
            return
        state.refreshed = 0.0
        if len(self._reread) < MAX_NODES:
            self._reread.add(node)
            self._reread_due.set()

    async def reread_forever(self) -> None:
        """Read the records of nodes whose trust changed, so a forgotten node that never
        beats again is not marked stale, checkpointed or alerted on from stale memory."""
        nodes = await self.bus.kv(self.bucket)
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

    # Writes -------------------------------------------------------------------------------------

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

    async def write_quietly(self, node: str, what: str) -> None:
        """:meth:`write`, a failure logged (the next checkpoint writes it again)."""
        try:
            await self.write(node)
        except (nats.errors.Error, RuntimeError) as exc:
            log.warning(what, extra={"node": node, "reason": str(exc)})
            state = self.nodes.get(node)
            if state is not None:
                self.checkpoints.push(node, state)

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

    async def _send(self, batch: list[Write]) -> None:
        """One batch of writes; a write not done (or the batch failing) answers None, so
        its writer takes the careful way, which raises what is wrong."""
        revisions: list[int | None] = [None] * len(batch)
        try:
            revisions = await kv.update_many(
                self.bus,
                self.bucket,
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
        superseded = False

        def change(stored: NodeRecord | None) -> NodeRecord | None:
            nonlocal mine, kept, superseded
            superseded = stored is not None and judged_past(stored, state.record)
            if superseded:
                return None
            mine, kept = self._render(state, stored, read=True)
            return hot_state.full(kept, state.body, self.nodes.bodies)

        before, written, revision = await self.store.update(node, change)
        if superseded:
            # Another owner judged later heartbeats of this node (this one was paused or
            # cut off past its lease, and its write came late): writing would put the
            # record back to an older heartbeat. This view is dropped; the node's next
            # heartbeat, if it is still ours, reads the record afresh.
            log.warning(
                "record judged further by another owner; this owner's view dropped",
                extra={"node": node, "last_seq": state.record.last_seq},
            )
            self.nodes.pop(node, None)
            self.stale.discard(node)
            self.held.release(node)
            return
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
            ours = hot_state.operator_changes(mine, stored, state.stored)
        else:
            ours = mine
        return mine, hot_state.checkpoint(stored_reset, ours, state.reset_consumed)

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
            state.stored, state.stored_reset = hot_state.digest(kept), kept.seq_reset
        if state.record is mine:
            state.dirty = False
            state.reset_consumed = False
            if kept is not None:
                state.record = kept
        else:
            # Heartbeats judged while writing: they keep what the operator wrote too.
            before = slim(before) if before is not None else None
            state.record = hot_state.operator_changes(state.record, before, known)
            if state.dirty:
                self.checkpoints.push(node, state)
        self.metrics.record_writes.inc()

    async def checkpoint_forever(self) -> None:
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
