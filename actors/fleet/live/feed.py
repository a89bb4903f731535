"""The fleet process's live feed of node records: what the decisions that run every round
(the workload reconciler, the remediation policy) and the HTTP API read, kept in memory,
never read again from the server per round.

Two sources, each node from one:

- the nodes the aggregator in this process holds: its memory (:class:`Held`), current to
  the last heartbeat it judged;
- every other node: a KV watch of ``fleet_nodes``, kept as the bytes the bucket holds
  (:class:`EncodedRecords`) and decoded when read. The aggregator holding a node writes
  its record at once when its state or its *decision facts* change (a workload's state,
  what the node can run, a check not ok, Slurm's state, who set its schedulability, a
  lost GPU: ``record_rules.decision_facts``), so what decisions act on is here within
  a heartbeat; the rest (LAST SEEN, GPU readings) is as fresh as the node's checkpoint.

While the aggregator beside it holds every partition there is no watch at all: every
record is its own (or one it takes in at its next full sweep), and the watch would take
in each of its own writes only to drop it (1,667 a second at 100,000 nodes).

``complete`` says whether every node is there: false until the watch has delivered every
record once, while the aggregator beside it loads, and while a watch started again (a
partition let go) catches up; a decision that needs the whole fleet waits for it, so a
node missing for a moment is never taken for a node gone. :meth:`changed` wakes a reader
when one of the nodes it names was written (the reconciler's hand-offs at the speed of
a heartbeat). docs/live-reads.md says what each reader reads and how fresh it is.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import (
    AsyncIterator,
    Callable,
    Collection,
    Container,
    Iterable,
    Iterator,
    MutableMapping,
)

import msgspec
from nats.js.kv import KeyValue

from actors.fleet.live.held import Held
from actors.fleet.metrics import AggregatorMetrics
from actors.runtime import kv
from actors.runtime.bus import Bus
from schemas import codec
from schemas.base import OpenRecordState
from schemas.errors import DecodeError
from schemas.messages import NodeRecord
from schemas.subjects import BUCKET_NODES, Subjects

log = logging.getLogger(__name__)

RECENT_WRITES = 4096
"""Node writes remembered (the newest), so a reader that looks again finds those that came
while it was busy: about 2.5 s of them at 100,000 nodes; one that was busy longer is
answered at once."""
RESYNC_CHECK = 1.0
"""Seconds between checks whether the aggregator beside the feed let its nodes go (lost
the heartbeat lease): the records it held are then read from ``fleet_nodes`` again."""


class RecordSummary(msgspec.Struct, frozen=True, kw_only=True):
    """What /metrics counts of a record: decoding only this skips the rest fast (a view
    of a ``NodeRecord`` for reading, not a wire type)."""

    cluster: str
    state: OpenRecordState


class EncodedRecords(MutableMapping[str, NodeRecord]):
    """Records by node, kept as their JSON bytes (one object each, a third of the
    decoded record's memory) and decoded on access; ``raw`` is the bytes by node."""

    def __init__(self) -> None:
        self.raw: dict[str, bytes] = {}

    def __getitem__(self, node: str) -> NodeRecord:
        return codec.decode(self.raw[node], NodeRecord, node)

    def __setitem__(self, node: str, record: NodeRecord) -> None:
        self.raw[node] = codec.encode(record)

    def __delitem__(self, node: str) -> None:
        del self.raw[node]

    def __iter__(self) -> Iterator[str]:
        return iter(self.raw)

    def __len__(self) -> int:
        return len(self.raw)

    def readable(self, skip: Container[str]) -> dict[str, NodeRecord]:
        """Every record of a node not in ``skip``, decoded; an unreadable one left out
        (it was counted when it came)."""
        found: dict[str, NodeRecord] = {}
        for node in self.raw:
            if node not in skip:
                with contextlib.suppress(DecodeError):
                    found[node] = self[node]
        return found

    def summaries(self, skip: Container[str]) -> list[RecordSummary]:
        """:class:`RecordSummary` of every record of a node not in ``skip``."""
        found: list[RecordSummary] = []
        for node, value in self.raw.items():
            if node not in skip:
                with contextlib.suppress(DecodeError):
                    found.append(codec.decode(value, RecordSummary, node))
        return found


class NodeFeed:
    """Follows the ``fleet_nodes`` bucket (for the nodes the aggregator beside it does not
    hold) and that aggregator's writes; publishes nothing. Read by the HTTP API, the
    reconciler, the remediation policy and the Alertmanager forwarder of its process,
    which share its one copy (a reader given none makes and runs its own:
    :func:`followed`)."""

    name = "live/feed"

    def __init__(
        self,
        bus: Bus,
        subjects: Subjects,
        held: Held | None = None,
        metrics: AggregatorMetrics | None = None,
        lease_ttl: float = 0.0,
    ) -> None:
        self.bus = bus
        self.subjects = subjects
        self.held = held
        """The nodes the aggregator in this process holds (its ``view``), if there is one."""
        self.metrics = metrics or AggregatorMetrics()
        self.lease_ttl = lease_ttl
        """How long a standby's aggregator waits before it may take the lease: the watch
        waits that long for it to hold nodes before following without it."""
        self.records = EncodedRecords()
        """The records of the nodes ``held`` does not hold, from the watch."""
        self._caught_up = False
        self._watched_from = 0
        """How often the aggregator had let nodes go when the current watch started:
        once it lets more go, their records are missing until a new watch catches up."""
        self._skipped = False
        """A node was left out of ``records`` because ``held`` held it."""
        self._missed = False
        """A record was left out while the aggregator was loading."""
        self._waiting: list[tuple[Collection[str], asyncio.Future[None]]] = []
        """Readers waiting for a change of one of the nodes they name."""
        self.writes = 0
        """Node writes seen so far (a reader notes it before it reads, see :meth:`changed`)."""
        self._recent: deque[tuple[int, str]] = deque(maxlen=RECENT_WRITES)
        self._listeners: list[Callable[[str], None]] = []
        if held is not None:
            held.listen(self._notify)

    # ----------------------------------------------------------------- reading

    @property
    def complete(self) -> bool:
        """Every node's record is here: the watch delivered every record once (or none
        is needed: the aggregator beside it holds everything) and no load is under way."""
        if self.held is not None and self.held.loading:
            return False
        if self._everything():
            return True
        return self._caught_up and self._released() == self._watched_from

    def current(self) -> dict[str, NodeRecord]:
        """Every record: a held node's as the aggregator keeps it (slim: no heavy
        heartbeat parts; :meth:`record` answers it whole), every other one decoded."""
        held = self.held.items() if self.held is not None else []
        merged = self.records.readable(self.held or ())
        merged.update(held)
        return merged

    def kept(self, node: str) -> NodeRecord | None:
        """The node's record as :meth:`current` has it (a held node's slim, no heartbeat
        decoded; another's decoded); None if it has none here or it is unreadable."""
        kept = self.held.record(node) if self.held is not None else None
        return kept if kept is not None else self._watched(node)

    def record(self, node: str) -> NodeRecord | None:
        """The node's whole record (its latest heartbeat in it); None if it has none here."""
        whole = self.held.whole(node) if self.held is not None else None
        return whole if whole is not None else self._watched(node)

    def _watched(self, node: str) -> NodeRecord | None:
        """The record the watch delivered for ``node``, decoded; None if none came or it is
        unreadable."""
        try:
            return self.records.get(node)
        except DecodeError:
            return None

    def whole(self, nodes: Iterable[str] | None = None) -> dict[str, NodeRecord]:
        """The whole records of ``nodes`` (every node when None) that are here: a decode
        each, from memory (no read of the server)."""
        wanted = self.nodes() if nodes is None else nodes
        found: dict[str, NodeRecord] = {}
        for node in wanted:
            record = self.record(node)
            if record is not None:
                found[node] = record
        return found

    def nodes(self) -> list[str]:
        """Every node with a record here: the held ones, then the others (each told from
        the held by ``held`` itself: a list of 50,000 held names searched for each of
        50,000 others held the event loop for about 15 s)."""
        if self.held is None:
            return list(self.records.raw)
        held = self.held
        return [node for node, _ in held.items()] + [
            node for node in self.records.raw if node not in held
        ]

    def summaries(self) -> list[RecordSummary | NodeRecord]:
        """Each record's cluster and state, cheaply: the held nodes' records, the
        others' summaries (what /metrics counts)."""
        found: list[RecordSummary | NodeRecord] = [*self.records.summaries(self.held or ())]
        if self.held is not None:
            found += [record for _, record in self.held.items()]
        return found

    async def changed(self, nodes: Collection[str], timeout: float, since: int = -1) -> bool:
        """Wait until the record of one of ``nodes`` is written (by the aggregator beside
        the feed, or seen by its watch), at most ``timeout`` seconds; True if one was.
        With ``since`` (:attr:`writes` as the reader last read), a write after it is
        answered at once: what came while the reader was busy is not missed."""
        if since >= 0 and self._written_since(nodes, since):
            return True
        if not nodes:
            await asyncio.sleep(timeout)
            return False
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (nodes, waiter)
        self._waiting.append(entry)
        try:
            async with asyncio.timeout(timeout):
                await waiter
            return True
        except TimeoutError:
            return False
        finally:
            with contextlib.suppress(ValueError):
                self._waiting.remove(entry)

    def _written_since(self, nodes: Collection[str], since: int) -> bool:
        """Whether one of ``nodes`` was written after write number ``since`` (True too
        when that is older than what is remembered)."""
        if since >= self.writes:
            return False
        if not self._recent or self._recent[0][0] > since + 1:
            return True
        return any(number > since and node in nodes for number, node in self._recent)

    def listen(self, written: Callable[[str], None]) -> None:
        """Have ``written(node)`` called for each node write the feed sees (the
        aggregator's beside it and its watch's): how a reader keeps its own index of the
        fleet up to date by what changed."""
        self._listeners.append(written)

    def _notify(self, node: str) -> None:
        self.writes += 1
        self._recent.append((self.writes, node))
        for listener in self._listeners:
            listener(node)
        for nodes, waiter in self._waiting:
            if node in nodes and not waiter.done():
                waiter.set_result(None)

    # ----------------------------------------------------------------- following

    async def run(self, ready: Callable[[], None]) -> None:
        bucket = await self.bus.kv(self.subjects.bucket_name(BUCKET_NODES))
        ready()
        await self.follow(bucket)

    async def follow(self, bucket: KeyValue) -> None:
        """Mirror ``fleet_nodes`` into ``records``; a deleted or unreadable record drops
        out, and so does one of a node the aggregator beside it holds. When that
        aggregator lets its nodes go, the watch starts again (every current record).
        While it holds every partition there is no watch (see the module's docstring:
        without it the 100,000-node bench's lag peaked at 16 to 24 s, not 27 s;
        docs/performance.md, "The aggregator at fleet scale")."""
        if self.held is not None:
            # The aggregator beside the feed may be taking the lease and about to load
            # every record: the watch starts once the load is done, not during it, when
            # it would take in every record only to drop it (the load holds them) and
            # then start again (100,000 records read twice more in a cold start). A
            # standby's feed starts after the lease's wait.
            waits = round(10 * (self.lease_ttl + RESYNC_CHECK) / RESYNC_CHECK)
            while self._loading() or (not self._holding() and waits > 0):
                waits -= 1
                await asyncio.sleep(RESYNC_CHECK / 10)
        while True:
            if self._everything():
                self.records.raw.clear()
                self._caught_up = False
                await asyncio.sleep(RESYNC_CHECK)  # checked as often as a lost partition
                continue
            self._skipped = self._missed = False
            released = self._watched_from = self._released()
            follower = asyncio.create_task(self._follow_once(bucket), name="node-feed-watch")
            try:
                while not follower.done() and not (
                    (self._skipped and not self._holding())
                    or (self._missed and not self._loading())
                    or (self._released() != released and not self._loading())
                    or self._everything()
                ):
                    await asyncio.wait([follower], timeout=RESYNC_CHECK)
                    self._prune()
            finally:
                follower.cancel()
                results = await asyncio.gather(follower, return_exceptions=True)
            if isinstance(results[0], Exception):
                raise results[0]

    def _everything(self) -> bool:
        return self.held is not None and self.held.everything

    def _loading(self) -> bool:
        return self.held is not None and self.held.loading

    def _released(self) -> int:
        """How often the aggregator beside the feed let nodes go: the records it skipped
        of those nodes are read again (another aggregator holds them now)."""
        return self.held.released if self.held is not None else 0

    def _holding(self) -> bool:
        """Whether the aggregator beside the feed holds (or is loading) nodes: while it
        does, the records it skipped are its; once it does not, they are read again."""
        return bool(self.held) or self._loading()

    def _prune(self) -> None:
        """Drop the records of nodes the aggregator beside the feed took into memory
        since they came (a cold start loads them while the watch delivers them)."""
        held = self.held
        if held and self.records.raw:
            for node in [node for node in self.records.raw if node in held]:
                del self.records.raw[node]
            self._skipped = True

    async def _follow_once(self, bucket: KeyValue) -> None:
        """One watch from the bucket's current records on. Its records fill a fresh copy,
        which replaces the one before only once it has every current record: a reader
        never sees the fleet shrink while a watch starts again."""
        fresh: dict[str, bytes] = {}
        self._caught_up = False

        def on_change(node: str, value: msgspec.Raw | None) -> None:
            held = self.held
            if held is None or node not in held:
                self._notify(node)  # the held nodes' writes are told by the aggregator
            if value is None:
                fresh.pop(node, None)
            elif held is not None and node in held:
                # Not even decoded: the aggregator's own write of a node it holds.
                fresh.pop(node, None)
                self._skipped = True
            elif held is not None and held.loading:
                # The aggregator is loading every record: the watch starts again once it
                # is done (see follow), for the records it did not take.
                fresh.pop(node, None)
                self._missed = True
            else:
                body = bytes(value)
                try:
                    codec.decode(body, NodeRecord, node)
                except DecodeError:
                    on_unreadable(node)
                    fresh.pop(node, None)
                    return
                fresh[node] = body

        def on_current() -> None:
            self.records.raw = fresh
            self._caught_up = True

        def on_unreadable(node: str) -> None:
            self.metrics.records_unreadable.inc()

        try:
            await kv.follow(bucket, msgspec.Raw, on_change, on_current, on_unreadable=on_unreadable)
        finally:
            self._caught_up = False


@contextlib.asynccontextmanager
async def followed(feed: NodeFeed, own: bool) -> AsyncIterator[asyncio.Future[None]]:
    """Inside, ``feed`` is followed: by its caller, which made it (``own``), in a task
    that ends on the way out; else by the process, which runs it as an actor of its own.
    What it gives is done only when the caller's own watch failed (its ``result()``
    raises why): a reader awaiting it, or checking it each round, ends with it, so its
    supervisor starts it again."""
    if not own:
        yield asyncio.get_running_loop().create_future()
        return
    bucket = await feed.bus.kv(feed.subjects.bucket_name(BUCKET_NODES))
    task = asyncio.create_task(feed.follow(bucket), name="node-feed")
    try:
        yield task
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
