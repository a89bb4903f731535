"""The fleet's state index (``fleet_index``, :mod:`schemas.fleet_index`): what a listing
reads instead of every record when it needs only counts and the nodes that are not
active.

Written by :class:`StateIndexActor` in each aggregator process, one value per partition
the aggregator beside it holds, from that aggregator's own record writes (``Held.listen``:
a name noted per write, nothing else on the write's path). Once a second the nodes
written since are looked at (their cluster, state and health, from memory); a partition
whose counts or listed nodes changed is written again, and every partition held is
written again every REWRITE_EVERY seconds, so a reader can tell an index nobody keeps
(its holder gone) from a quiet one. A fleet with nothing changing costs a dictionary
lookup per checkpoint write.

Read by :func:`read_index`: every partition's value in one scan of the small bucket; the
index is used only when every partition has one written within FRESH_FOR seconds and
all agree on the partition count, else the caller reads the records as before. The
index says what the records say (a node's state is written at once when it changes,
docs/live-reads.md); it holds no reading: a view that shows one reads it live.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import nats.errors

from actors.fleet.changed_nodes import WRITES, ChangedNodes
from actors.fleet.live.held import Held
from actors.fleet.record_state import KNOWN_NOW
from actors.fleet.shared_values import SharedValues
from actors.runtime import kv
from actors.runtime.bus import Bus
from schemas import codec
from schemas.errors import DecodeError, FleetError
from schemas.fleet_index import MAX_LISTED, IndexedNode, PartitionIndex
from schemas.messages import NodeRecord
from schemas.subjects import BUCKET_INDEX, Subjects, partition_of

log = logging.getLogger(__name__)

INDEX_TICK = 1.0
"""Seconds between two looks at the nodes written (and writes of the partitions changed)."""
REWRITE_EVERY = 30.0
"""Seconds after which a partition's index is written again though nothing changed."""
FRESH_FOR = 3 * REWRITE_EVERY + 10.0
"""A partition's index older than this (by its ``written``) is not used."""
READ_TIMEOUT = 5.0
WRITE_TIMEOUT = 5.0

Key = tuple[str, str, str]
"""A node as the index counts it: (cluster, state, health)."""
Ownership = Callable[[], tuple[int, list[int], str]]
"""The partition count, the partitions the aggregator beside the writer holds now, and
its holder id."""


KEYS: SharedValues[Key] = SharedValues(4096)
"""The keys counted, one tuple each (a 3-tuple is 64 bytes: 6 MB at 100,000 nodes held one
each); clusters times states times health, bounded against a fleet of many clusters."""


def key_of(record: NodeRecord) -> Key:
    health = (record.health_status or "") if record.state in KNOWN_NOW else ""
    return KEYS.one((record.cluster, record.state, health))


def index_key(partition: int) -> str:
    return f"part.{partition}"


@dataclass
class PartitionCounts:
    """One partition's nodes counted by key, and its nodes that are not active."""

    counts: Counter[Key] = field(default_factory=Counter)
    listed: dict[str, Key] = field(default_factory=dict)
    changed: bool = True
    written: float = 0.0
    """When it was last written (monotonic); 0 for never."""

    def add(self, node: str, key: Key, sign: int) -> None:
        self.counts[key] += sign
        if not self.counts[key]:
            del self.counts[key]
        if key[1] != "active":
            if sign > 0:
                self.listed[node] = key
            else:
                self.listed.pop(node, None)
        self.changed = True

    def value(self, partition: int, partitions: int, holder: str) -> PartitionIndex:
        counts: dict[str, dict[str, int]] = {}
        health: Counter[str] = Counter()
        for (cluster, state, status), count in self.counts.items():
            row = counts.setdefault(cluster, {})
            row[state] = row.get(state, 0) + count
            if status:
                health[status] += count
        listed_all = len(self.listed) <= MAX_LISTED
        return PartitionIndex(
            partition=partition,
            partitions=partitions,
            holder=holder,
            written=time.time(),
            counts=counts,
            health=dict(health),
            listed={
                node: IndexedNode(cluster=key[0], state=key[1], health=key[2])
                for node, key in (self.listed.items() if listed_all else ())
            },
            listed_all=listed_all,
        )


class StateIndexActor:
    """Keeps ``fleet_index``'s value of every partition the aggregator beside it holds."""

    name = "live/state_index"

    def __init__(self, bus: Bus, subjects: Subjects, held: Held, ownership: Ownership) -> None:
        self.bus = bus
        self.bucket = subjects.bucket_name(BUCKET_INDEX)
        self.held = held
        self.ownership = ownership
        self.keys: dict[str, Key] = {}
        """Each held node's key as last counted."""
        self.parts: dict[int, PartitionCounts] = {}
        self.count = 0
        """The partition count ``parts`` were made for."""
        self._released = -1
        self._touched = ChangedNodes(held.__len__, WRITES)
        held.listen(self._touched.note)

    async def run(self, ready: Callable[[], None]) -> None:
        ready()
        while True:
            await asyncio.sleep(INDEX_TICK)
            await self.tick()

    async def tick(self) -> None:
        """Take in the nodes written since the last tick; write what changed."""
        if self.held.loading:
            return
        count, holding, holder = self.ownership()
        touched = self._touched.take()
        if count != self.count or self.held.released != self._released or touched is None:
            self._recount(count)
        else:
            self._take(touched)
        if len(self.keys) != len(self.held):
            self._recount(count)  # a node dropped without a write (another owner's now)
        await self._write(holding, holder)

    def _recount(self, count: int) -> None:
        """Every held node counted again (a partition gained or lost)."""
        self.count, self._released = count, self.held.released
        self.keys.clear()
        self.parts = {}
        for node, record in self.held.items():
            self._put(node, key_of(record))

    def _take(self, nodes: Iterable[str]) -> None:
        for node in nodes:
            record = self.held.record(node)
            old = self.keys.get(node)
            new = None if record is None else key_of(record)
            if old == new:
                continue
            if old is not None:
                self._part(node).add(node, old, -1)
                del self.keys[node]
            if new is not None:
                self._put(node, new)

    def _put(self, node: str, key: Key) -> None:
        self.keys[node] = key
        self._part(node).add(node, key, 1)

    def _part(self, node: str) -> PartitionCounts:
        partition = partition_of(node, self.count)
        part = self.parts.get(partition)
        if part is None:
            part = self.parts[partition] = PartitionCounts()
        return part

    async def _write(self, holding: list[int], holder: str) -> None:
        now = time.monotonic()
        for partition in holding:
            part = self.parts.get(partition)
            if part is None:
                part = self.parts[partition] = PartitionCounts()
            if not part.changed and now - part.written < REWRITE_EVERY:
                continue
            value = part.value(partition, self.count, holder)
            try:
                await self.bus.js.publish(
                    f"$KV.{self.bucket}.{index_key(partition)}",
                    codec.encode(value),
                    timeout=WRITE_TIMEOUT,
                )
            except (nats.errors.Error, OSError) as exc:
                log.warning(
                    "state index not written; again next tick",
                    extra={"partition": partition, "reason": str(exc)},
                )
                continue
            part.changed, part.written = False, now


@dataclass
class FleetIndex:
    """Every partition's index, merged: what a summary or a short listing needs."""

    counts: dict[str, dict[str, int]]
    """Nodes by cluster and state (deregistered ones included)."""
    health: dict[str, int]
    listed: dict[str, IndexedNode]
    """Every node not active, by node id."""
    listed_all: bool
    oldest: float
    """When the oldest partition's index was written (wall clock)."""


async def read_index(bus: Bus, subjects: Subjects) -> FleetIndex | None:
    """The fleet's index, or None when it cannot stand for the records (a partition's
    missing, old or unreadable; the bucket missing or not readable): the caller reads
    the records instead."""
    bucket = subjects.bucket_name(BUCKET_INDEX)
    try:
        values = await kv.latest_values(bus, bucket, 1024, READ_TIMEOUT)
    except (nats.errors.Error, TimeoutError, FleetError, kv.BatchError) as exc:
        log.info("state index not readable", extra={"reason": str(exc) or type(exc).__name__})
        return None
    found: dict[int, PartitionIndex] = {}
    for key, value in values.items():
        try:
            part = codec.decode(value, PartitionIndex, f"index {key}")
        except DecodeError:
            return None
        found[part.partition] = part
    return merged(found, time.time())


def merged(found: dict[int, PartitionIndex], now: float) -> FleetIndex | None:
    """The partitions' indexes as one; None unless there is a fresh one for each."""
    if not found:
        return None
    count = max(part.partitions for part in found.values())
    wanted = [found.get(partition) for partition in range(count)]
    parts = [part for part in wanted if part is not None and part.partitions == count]
    if len(parts) != count or any(now - part.written > FRESH_FOR for part in parts):
        return None
    counts: dict[str, dict[str, int]] = {}
    health: Counter[str] = Counter()
    listed: dict[str, IndexedNode] = {}
    for part in parts:
        for cluster, row in part.counts.items():
            into = counts.setdefault(cluster, {})
            for state, number in row.items():
                into[state] = into.get(state, 0) + number
        health.update(part.health)
        listed.update(part.listed)
    return FleetIndex(
        counts=counts,
        health=dict(health),
        listed=listed,
        listed_all=all(part.listed_all for part in parts),
        oldest=min(part.written for part in parts),
    )
