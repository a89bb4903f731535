"""Records of ``fleet_nodes`` read into the ledger's table: a cold start's scan of the
partitions gained, the records of nodes registered through another aggregator, the slow
path's fresh read of one node, and the records of nodes whose trust an operator changed
(seen through the trust watch). Reads never overwrite memory with what they cannot read.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import msgspec
import nats.errors

from actors.fleet.aggregator import hot_state
from actors.fleet.aggregator.hot_state import NodeState, spread_written
from actors.fleet.aggregator.ledger import Ledger
from actors.fleet.storage.streams import MAX_NODES
from actors.runtime import kv
from actors.runtime.bus import Bus
from actors.runtime.schedule import stop_if_cancelled, take_turn
from schemas.errors import DecodeError
from schemas.messages import NodeRecord
from schemas.subjects import BUCKET_NODES, Subjects, partition_of

log = logging.getLogger(__name__)

LOAD_TIMEOUT = 120.0
"""Seconds to read every record of fleet_nodes at a cold start (100,000 in a few)."""
SETTLED = ("stale", "offline", "deregistered", "pending", "stopped")
"""Record states written when entered: no heartbeat after their checkpoint is missing."""
TAKEN_PER_TURN = 100
"""Records a load decodes in one round of the event loop (about 20 ms of CPU at 8 GPUs
a record), out of a page of 1,000: the lease renewals and the connection's reader run
between (see ``aggregator.actor.JUDGED_PER_TURN``)."""


class RecordReads:
    """Reads of ``fleet_nodes`` into ``ledger``'s table (an unreadable record counted in
    the ledger's metrics)."""

    def __init__(self, ledger: Ledger, bus: Bus, subjects: Subjects) -> None:
        self.ledger = ledger
        self.nodes = ledger.nodes
        self.metrics = ledger.metrics
        self.bus = bus
        self.bucket = subjects.bucket_name(BUCKET_NODES)
        self._reread: set[str] = set()
        """Nodes whose trust entry changed: their records are read again."""
        self._reread_due = asyncio.Event()
        self._scanned = 0
        """The last revision of fleet_nodes :meth:`take_in_new` read (0: none yet)."""

    async def load(self, wanted: set[int], count: int) -> tuple[int, dict[int, int]]:
        """The records of partitions ``wanted`` (of ``count``) into memory with one scan
        of ``fleet_nodes`` (batched direct gets, one request per 1,000 records, no
        consumer), each page taken in as it comes (the bucket's bytes are never all held
        at once), keys of other partitions skipped before anything is decoded,
        checkpoints spread. Returns the records loaded and each partition's resume floor:
        the oldest stream seq its live records' checkpoints need."""
        now = time.monotonic()
        interval = self.ledger.checkpoints.interval
        loaded = 0
        floors: dict[int, int] = {}
        self.nodes.loading = True
        try:
            # Closed as the loop stops, even by a raise: no page's inbox left subscribed.
            scan = kv.latest_pages(self.bus, self.bucket, LOAD_TIMEOUT)
            async with contextlib.aclosing(scan) as pages:
                async for entries in pages:
                    for taken, (node, value, revision) in enumerate(entries, 1):
                        await take_turn(taken, TAKEN_PER_TURN)
                        partition = partition_of(node, count)
                        if partition not in wanted:
                            continue
                        # A key rewritten during the scan comes again: its last value counts.
                        self.nodes.pop(node, None)
                        self.ledger.stale.discard(node)
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
                            self.ledger.stale.add(node)
                        if record.last_stream_seq and record.state not in SETTLED:
                            # An earlier value of a key rewritten during the scan may lower
                            # the floor: judging more again is safe, less is not.
                            floor = floors.get(partition, record.last_stream_seq + 1)
                            floors[partition] = min(floor, record.last_stream_seq + 1)
        finally:
            self.nodes.loading = False
            self.nodes.loads += 1
        return loaded, floors

    async def take_in_new(self, owns: Callable[[str], bool]) -> None:
        """Records of nodes this owner ``owns`` and has not in memory (registrations
        answered by another aggregator) are read and taken in: only those written since
        the last scan (the first scan reads every record). A record written before then
        whose partition this owner did not hold was read with the partition's load when
        it was gained; one left out for the cap on nodes is read again at the next."""
        now = time.monotonic()
        taken: set[str] = set()
        """Nodes taken in by this scan: a later value of theirs in it replaces them."""
        scanned, full = self._scanned, False
        scan = kv.latest_pages(self.bus, self.bucket, LOAD_TIMEOUT, since=scanned)
        async with contextlib.aclosing(scan) as pages:  # closed as the loop stops (see load)
            async for entries in pages:
                for node, value, revision in entries:
                    scanned = max(scanned, revision)
                    if not owns(node) or (node in self.nodes and node not in taken):
                        continue
                    if node in taken:
                        self.nodes.pop(node, None)
                        taken.discard(node)
                    if value is None:
                        continue
                    if len(self.nodes) >= MAX_NODES:
                        full = True  # not taken in: read again at the next scan
                        continue
                    try:
                        self.nodes[node] = hot_state.from_stored(
                            node, value, now, self.nodes.bodies
                        )
                    except DecodeError:
                        continue  # counted when it was loaded or fetched
                    taken.add(node)
        self._scanned = 0 if full else scanned

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
                state.keep(msgspec.structs.replace(state.record, seq_reset=True))
        if state is not None:
            state.refreshed = time.monotonic()
        return True

    def _adopt(self, state: NodeState, record: NodeRecord) -> None:
        """Take what an operator wrote into ``record`` (read afresh) into memory."""
        state.keep(hot_state.operator_changes(state.record, record, state.stored))
        state.stored, state.stored_reset = hot_state.stored_digest(record), record.seq_reset

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
