"""Writes of the ledger's records to ``fleet_nodes``, by compare-and-set: those whose
stored revision the owner knows batched per turn of the event loop, the others read and
written the careful way, the steady ones once per ``checkpoint_interval``. An operator's
change written meanwhile (a forget, a re-admission) is kept, never undone. A record another
owner judged further is never written back: this owner's view is dropped, or its stale
verdict carried onto that record (:func:`judge.stale_carried`).
"""

from __future__ import annotations

import asyncio
import logging
import time

import nats.errors

from actors.fleet.aggregator import hot_state, judge
from actors.fleet.aggregator.hot_state import NodeState
from actors.fleet.aggregator.ledger import Ledger
from actors.fleet.storage.node_store import NodeStore
from actors.runtime import kv
from actors.runtime.bus import Bus
from actors.runtime.schedule import stop_if_cancelled
from schemas.messages import NodeRecord
from schemas.subjects import BUCKET_NODES, Subjects

log = logging.getLogger(__name__)

CHECKPOINT_TICK = 0.5
CHECKPOINTS_PER_TICK = 4096
CHECKPOINTS_IN_FLIGHT = 256
WRITE_TIMEOUT = 5.0
"""Seconds a batch of record writes waits for the server's answers (then each is written
the careful way)."""

Write = tuple[str, bytes, int, asyncio.Future[int | None]]


def judged_past(stored: NodeRecord, mine: NodeRecord) -> bool:
    """Whether ``stored`` was written from a heartbeat later than ``mine``'s, both in the
    stream and in the node's sequence: another owner judged past this one."""
    return stored.last_stream_seq > mine.last_stream_seq and stored.last_seq > mine.last_seq


class RecordWrites:
    """``ledger``'s records written to ``fleet_nodes`` (through ``store`` and batched KV
    updates; each write counted in the ledger's metrics)."""

    def __init__(self, ledger: Ledger, bus: Bus, subjects: Subjects, store: NodeStore) -> None:
        self.ledger = ledger
        self.nodes = ledger.nodes
        self.checkpoints = ledger.checkpoints
        self.metrics = ledger.metrics
        self.bus = bus
        self.bucket = subjects.bucket_name(BUCKET_NODES)
        self.store = store
        self._writing: dict[str, asyncio.Future[None]] = {}
        """Record writes in flight, by node: a lost partition waits for its nodes' ones."""
        self._batch: list[Write] = []
        """Writes of this turn of the event loop, sent together (see :meth:`write`)."""
        self._sending: set[asyncio.Task[None]] = set()
        """The batches being sent (kept referenced until done)."""

    async def writes_done(self, nodes: list[str], timeout: float) -> None:
        """Wait, at most ``timeout``, for the record writes of ``nodes`` in flight."""
        writing = [self._writing[node] for node in nodes if node in self._writing]
        if writing:
            await asyncio.wait(writing, timeout=timeout)

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
        gpus = state.gpus
        body = hot_state.encoded(kept, state.body, gpus, self.nodes.bodies)
        answer: asyncio.Future[int | None] = asyncio.get_running_loop().create_future()
        if not self._batch:
            asyncio.get_running_loop().call_soon(self._send_batch)
        self._batch.append((node, body, revision, answer))
        written = await answer
        if written is None:
            return False
        if self.nodes.get(node) is state:
            self._wrote(node, state, mine, known, None, kept, gpus, written)
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
        gpus = hot_state.NO_GPUS
        known = state.stored
        superseded = False
        unchanged = False
        carried: NodeRecord | None = None

        def change(stored: NodeRecord | None) -> NodeRecord | None:
            nonlocal mine, kept, gpus, superseded, unchanged, carried
            superseded = stored is not None and judged_past(stored, state.record)
            if stored is not None and superseded:
                # A stale verdict (its alert raised) stands for the stored record too when
                # that one's heartbeat ran out as well: written stale, so the node's return
                # raises its `recovered`.
                mine = state.record
                carried = judge.stale_carried(mine, stored)
                return carried
            mine, kept = self._render(state, stored, read=True)
            gpus = state.gpus
            # Stored already (a batched write whose answer was lost, then taken the
            # careful way): writing it again would change nothing but the revision.
            unchanged = stored is not None and hot_state.digest(
                kept, gpus
            ) == hot_state.stored_digest(stored)
            return None if unchanged else hot_state.full(kept, state.body, gpus, self.nodes.bodies)

        before, written, revision = await self.store.update(node, change)
        if superseded and carried is not None and written is not None:
            log.warning(
                "record judged further by another owner; its stale state carried onto it",
                extra={"node": node, "last_seq": state.record.last_seq, "stored": carried.last_seq},
            )
            self._took_stored(node, state, mine, carried, revision)
            return
        if superseded:
            # Another owner judged later heartbeats of this node (this one was paused or
            # cut off past its lease, and its write came late): writing would put the
            # record back to an older heartbeat. This view is dropped.
            log.warning(
                "record judged further by another owner; this owner's view dropped",
                extra={"node": node, "last_seq": state.record.last_seq},
            )
            self.ledger.superseded(node)
            return
        self._wrote(
            node,
            state,
            mine,
            known,
            before,
            kept if written is not None or unchanged else None,
            gpus,
            revision,
        )

    def _took_stored(
        self,
        node: str,
        state: NodeState,
        mine: NodeRecord | None,
        record: NodeRecord,
        revision: int | None,
    ) -> None:
        """``record``, written at ``revision`` over the record judged further than the
        view ``mine`` of ``state``, is the view now (the node's next heartbeat is judged
        on it). A view that changed meanwhile (a heartbeat judged on it while writing) is
        dropped instead: the next heartbeat reads the record afresh."""
        self.metrics.record_writes.inc()
        for listener in self.nodes.listeners:
            listener(node)
        if self.nodes.get(node) is not state:
            return  # let go meanwhile (its partition lost)
        if state.record is not mine:
            self.ledger.superseded(node)
            return
        taken = hot_state.from_record(record, time.monotonic(), self.nodes.bodies)
        taken.revision = revision
        self.nodes[node] = taken

    def _render(
        self, state: NodeState, stored: NodeRecord | None, read: bool
    ) -> tuple[NodeRecord, NodeRecord]:
        """(the in-memory record now, the record to write in its slim form): what to write
        over ``stored``, the record just read if ``read``, else over the one this owner
        last read or wrote. The slim form is most often the in-memory record itself, which
        then stays as it is once written; the whole record is the slim one with the kept
        heartbeat and GPU fingerprint (:func:`hot_state.encoded`, :func:`hot_state.full`)."""
        mine = state.record
        stored_reset = state.stored_reset
        if read:
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
        known: int | None,
        before: NodeRecord | None,
        kept: NodeRecord | None,
        gpus: bytes,
        revision: int | None,
    ) -> None:
        """The state after the record whose slim form is ``kept`` and fingerprint ``gpus``
        (rendered from ``mine``; None: nothing written) was written at ``revision`` over ``before``
        (read, or None: the one whose digest ``known`` was when the write started). The
        slim form is taken as it is, not made again from the whole record written: a
        checkpoint leaves the in-memory record the same object, and allocates nothing to
        keep (a checkpoint wave of 100,000 nodes otherwise replaced every record at once)."""
        state.revision = revision
        state.written = time.monotonic()
        if kept is not None:
            state.stored, state.stored_reset = hot_state.digest(kept, gpus), kept.seq_reset
        if state.record is mine:
            state.dirty = False
            state.reset_consumed = False
            if kept is not None:
                state.keep(kept)
        else:
            # Heartbeats judged while writing: they keep what the operator wrote too.
            state.keep(hot_state.operator_changes(state.record, before, known))
            if state.dirty:
                self.checkpoints.push(node, state)
        self.metrics.record_writes.inc()
        for listener in self.nodes.listeners:
            listener(node)

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
