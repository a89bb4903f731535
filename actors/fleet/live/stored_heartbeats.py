"""What the servers hold beside a node's record, as a live read needs it: the latest
message on each node's ``FLEET_HB`` subject (a scan of the stream, or ``multi_last``
requests), the approved keys of the nodes in ``fleet_trust``, and the ack floors of the
partitions' consumers (read, and waited for until they pass a message). Judges nothing:
:mod:`actors.fleet.live.reader` does, with what these return."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable

import nats.errors
import nats.js.errors

from actors.fleet.storage import registry
from actors.runtime import direct_get
from actors.runtime.bus import Bus
from actors.runtime.direct_get import Stored
from schemas import codec
from schemas.errors import DecodeError
from schemas.messages import NodeRecord, TrustEntry
from schemas.subjects import BUCKET_TRUST, STREAM_HEARTBEATS, Subjects

FLOOR_POLL = 0.1
"""Seconds between two reads of a partition's ack floor while a message waits for it."""
READ_TIMEOUT = 300.0
"""Seconds a live read may take in all: a 100,000-node listing took about two minutes on
a 2-core machine shared with the load (docs/performance.md); one node, milliseconds."""
SCAN_ABOVE = 1000
"""A read of more nodes than this scans FLEET_HB and fleet_trust whole, page by page;
fewer are read subject by subject (``multi_last``)."""


async def keys_needed(
    bus: Bus, subjects: Subjects, page: list[Stored], by_subject: dict[str, NodeRecord]
) -> dict[str, str]:
    """The approved keys of the nodes whose message in ``page`` is newer than the one
    their record holds (only those are verified: the record's own was, by the aggregator
    that wrote it), read after the page. Read later than the message, a key can only
    refuse more (revoked or replaced since): an accepted message was judged, before it
    was read, with the key approved then (check 5)."""
    nodes = [
        by_subject[message.subject].node_id
        for message in page
        if message.seq > by_subject[message.subject].last_stream_seq
    ]
    return await approved_keys(bus, subjects, nodes) if nodes else {}


async def approved_keys(bus: Bus, subjects: Subjects, nodes: list[str]) -> dict[str, str]:
    """The approved, unrevoked key of each of ``nodes`` that has one."""
    bucket = subjects.bucket_name(BUCKET_TRUST)
    wanted = set(nodes)
    prefix = f"$KV.{bucket}."
    keys: dict[str, str] = {}
    for message in await latest_messages(bus, f"KV_{bucket}", [prefix + n for n in nodes], prefix):
        node = message.subject.removeprefix(prefix)
        if node not in wanted or not message.data:
            continue
        try:
            key = registry.approved_key(codec.decode(message.data, TrustEntry, node))
        except DecodeError:
            key = None
        if key is None:
            keys.pop(node, None)
        else:
            keys[node] = key
    return keys


async def stored_messages(
    bus: Bus,
    subjects: Subjects,
    wanted: list[str],
    scan: bool,
    read_floors: Callable[[], Awaitable[dict[int, int]]],
) -> AsyncGenerator[tuple[dict[int, int], list[Stored]]]:
    """The messages FLEET_HB holds on ``wanted`` (stored subjects; at most one each), page
    by page, each with the partitions' ack floors read before it was asked for: a scan of
    the stream (then ``multi_last`` requests for the subjects it did not meet), or
    ``multi_last`` requests. The floors are read once before the scan, not per page: the
    scan ends at the last message stored when it began, so every message it meets was
    stored before it began and is judged by floors read then (a consumer info costs the
    server a pass over the partition's subjects: read per page, they were most of a
    listing's time)."""
    stream = subjects.stream_name(STREAM_HEARTBEATS)
    wanted_set = set(wanted)
    if scan:
        floors = await read_floors()
        # Up to the last message stored when the scan starts: one stored later replaced
        # a node's message the scan may have passed, and is read on its own below.
        info = await bus.js.stream_info(stream)
        up_to = info.state.last_seq
        # Every subject (">"), not the heartbeats' "<prefix>.hb.>": FLEET_HB holds nothing
        # else (what is not wanted is left out below), and the server pays for a filter
        # that is not the whole stream on every message (100,000 nodes: 14 s of its CPU
        # against 9).
        scanned = direct_get.pages(bus, stream, ">", READ_TIMEOUT, up_to=up_to)
        async with contextlib.aclosing(scanned) as pages:  # closed with this generator, as it stops
            async for page in pages:
                found = [message for message in page if message.subject in wanted_set]
                wanted_set.difference_update(message.subject for message in found)
                yield floors, found
        if not wanted_set:
            return
        wanted = sorted(wanted_set)
    floors = await read_floors()
    found = await direct_get.last_of(bus, stream, wanted, READ_TIMEOUT)
    yield floors, [message for message in found if message.subject in wanted_set]


async def latest_messages(bus: Bus, stream: str, wanted: list[str], prefix: str) -> list[Stored]:
    """The latest message of each of ``wanted``: a scan above SCAN_ABOVE subjects."""
    if len(wanted) <= SCAN_ABOVE:
        return await direct_get.last_of(bus, stream, wanted, READ_TIMEOUT)
    latest: dict[str, Stored] = {}
    scan = direct_get.pages(bus, stream, f"{prefix}>", READ_TIMEOUT)
    async with contextlib.aclosing(scan) as pages:  # closed as the loop stops, even by a raise
        async for page in pages:
            latest.update((message.subject, message) for message in page)
    return list(latest.values())


async def read_floors(
    bus: Bus, subjects: Subjects, durable: str, partitions: Iterable[int]
) -> dict[int, int]:
    stream = subjects.stream_name(STREAM_HEARTBEATS)

    async def floor(partition: int) -> int:
        name = subjects.partition_consumer(durable, partition)
        try:
            info = await bus.js.consumer_info(stream, name, timeout=2.0)
        except (nats.js.errors.NotFoundError, nats.errors.TimeoutError):
            return 0
        return info.ack_floor.stream_seq if info.ack_floor else 0

    wanted = sorted(set(partitions))
    return dict(zip(wanted, await asyncio.gather(*(floor(p) for p in wanted)), strict=True))


async def judged_past(
    bus: Bus, subjects: Subjects, durable: str, waiting: dict[str, int], deadline: float
) -> None:
    """Wait until every partition's floor has passed its waited-for messages (subject:
    stream seq), or the deadline."""
    need: dict[int, int] = {}
    for subject, seq in waiting.items():
        partition = int(subject.split(".")[-3])
        need[partition] = max(need.get(partition, 0), seq)
    loop = asyncio.get_running_loop()
    while loop.time() < deadline:
        floors = await read_floors(bus, subjects, durable, need)
        if all(floors.get(p, 0) >= seq for p, seq in need.items()):
            return
        await asyncio.sleep(min(FLOOR_POLL, max(deadline - loop.time(), 0.0)))
