"""Live reads for the views: each node's latest *accepted* heartbeat, read from FLEET_HB.

``fleet_nodes`` is written on state changes and at checkpoints (``checkpoint_interval``),
so its ``last_seen``, ``last_seq`` and embedded heartbeat may be a minute old. FLEET_HB
keeps each node's latest message (one per subject); this module reads it and shows it
only if the aggregators accepted it (docs/live-reads.md). A message M on the node's
stored subject is the node's latest accepted heartbeat when all of these hold:

1. it is a heartbeat: a body, no ``Nats-Marker-Reason``, no ``Nats-Rollup``;
2. it is signed (``Fleet-Key``/``Fleet-Sig``, over the bytes stored) by the node's
   approved, unrevoked key in ``fleet_trust``;
3. its body is a Heartbeat naming the subject's node and cluster, its ``ts`` within
   MAX_SKEW of the time the stream stored it;
4. the record is not deregistered, and its seq is above the record's ``last_seq`` (or M
   is the very message the record holds; or the record carries an operator's
   ``reset-seq``);
5. its partition's owner has judged it: its stream seq is at or below the ack floor of
   the partition's durable consumer. An owner deletes every heartbeat it refuses from
   FLEET_HB before it acks it (:meth:`Ownership.drop`, the first step of a refusal), so
   a judged message still stored was accepted. A replay of a heartbeat newer than the
   last checkpoint passes 1 to 4 and is caught here.

The floors are read before a scan (once: it ends at the last message stored when it
began) and before each round of ``multi_last`` requests, so a message at or below them
was judged before it was read. A message not judged yet is waited for (its
partition's floor read again every FLOOR_POLL, up to JUDGE_WAIT from the end of the
first read), then read again. Where no accepted heartbeat can be
read (refused, not judged in time, expired, unreadable), the record's own checkpoint is
shown and marked: ``live`` false and ``live_note`` saying why. The node's state stays
the aggregator's verdict from ``fleet_nodes``; only the parts a heartbeat carries
(LAST SEEN from the store time, SEQ, health, GPUs, engines, workloads, jobs, latency,
spot) come from the live read.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable
from dataclasses import dataclass

import msgspec
import nats.errors
import nats.js.errors

from actors.fleet.live.workload_status import status as status_now
from actors.fleet.storage import records as stored
from actors.fleet.storage import registry
from actors.fleet.storage.policy_holds import read_policies
from actors.fleet.storage.streams import heartbeat_partitions
from actors.fleet.storage.windows import covers, read_windows
from actors.runtime import direct_get, heap
from actors.runtime.bus import Bus
from actors.runtime.direct_get import Stored
from actors.runtime.signature_helpers import (
    Checking,
    SignatureChecks,
    check,
    default_helpers,
)
from schemas import codec
from schemas.errors import DecodeError, FleetError
from schemas.messages import Heartbeat, NodeRecord, TrustEntry
from schemas.signing import HEADER_KEY, HEADER_SIG
from schemas.subjects import BUCKET_TRUST, STREAM_HEARTBEATS, Subjects

MAX_SKEW = 300.0
"""Seconds a heartbeat's ``ts`` may be off its store time (the aggregators' default
``max_skew``)."""
JUDGE_WAIT = 3.0
"""Seconds a read waits at most for the owners to judge the heartbeats it found."""
FLOOR_POLL = 0.1
READ_TIMEOUT = 300.0
"""Seconds a live read may take in all: a 100,000-node listing took about two minutes on
a 2-core machine shared with the load (docs/performance.md); one node, milliseconds."""
SCAN_ABOVE = 1000
"""A read of more nodes than this scans FLEET_HB and fleet_trust whole, page by page;
fewer are read subject by subject (``multi_last``)."""
SETTLED = ("stale", "offline", "stopped", "deregistered", "pending")
"""Record states written when entered: their record holds the latest accepted heartbeat."""
DURABLE = "aggregator"
"""The aggregators' default consumer base name (``durable``)."""


class LiveRecord(NodeRecord, frozen=True, kw_only=True):
    """A ``NodeRecord`` as a view shows it (not a wire type): the record from
    ``fleet_nodes`` with its heartbeat's parts from the latest accepted heartbeat."""

    live: bool = False
    """The heartbeat parts are the node's latest accepted heartbeat, read just now."""
    live_note: str = ""
    """Why they are not (the record's checkpoint is shown instead)."""
    maintenance: str = ""
    """The id of the maintenance window covering the node now ("" when none covers it:
    ``fleetctl maintenance``)."""
    policy_hold: str = ""
    """``cordon`` or ``drain`` while the remediation policy's own record (``fleet_policy``)
    holds the node: who set its state as the fleet itself knows it (``cordon refused:
    needs attention`` where the node never took it). ``heartbeat``'s
    ``schedulability_by`` is what the node says."""
    workload_status: dict[str, str] = {}
    """Each workload the heartbeat lists, by name, as it is now
    (:func:`actors.fleet.live.workload_status.status`): ``unknown (node stale 2m)`` on a
    node that does not report, ``orphaned (node forgotten)``, else what the node
    reported. The heartbeat's ``workloads`` are the node's claims as it sent them."""


SHOWN_LIVE = frozenset(
    {
        "heartbeat",
        "last_seq",
        "last_seen",
        "health_status",
        "health_score",
        "gpus_total",
        "agent_version",
        "last_stream_seq",
        "last_stored",
    }
    | (set(LiveRecord.__struct_fields__) - set(NodeRecord.__struct_fields__))
)
"""The fields of a record that :func:`overlay` sets (from the latest accepted heartbeat,
or the fleet's facts): a listing sorted by one of them is sorted after the overlay, by
any other before it."""


class _Refused(Exception):
    """The stored message is not an accepted heartbeat: why."""


class _Pending(Exception):
    """The stored message passes every check but its owner has not judged it yet."""


def as_live(record: NodeRecord, live: bool = False, note: str = "") -> LiveRecord:
    """``record`` as a :class:`LiveRecord` (not read live, unless ``live``)."""
    return LiveRecord(**msgspec.structs.asdict(record) | {"live": live, "live_note": note})


async def read_fleet(bus: Bus, subjects: Subjects) -> list[LiveRecord]:
    """Every record of ``fleet_nodes``, sorted by node id, each with its node's latest
    accepted heartbeat (see the module's docstring): a command line's read of the whole
    fleet, its signatures checked by helper processes beside it
    (:func:`signature_helpers.default_helpers`). The records are read shelved
    (:func:`stored_records_shelved`): a record's own heartbeat is decoded only where it
    is the one shown."""
    shelved = await stored_records_shelved(bus, subjects)
    return await overlay(
        bus, subjects, shelved.records, shelf=shelved.heartbeats, helpers=default_helpers()
    )


async def read_node(bus: Bus, subjects: Subjects, node: str) -> LiveRecord:
    """The record of ``node`` with its latest accepted heartbeat; NotFound without one."""
    record = await stored.read_record(bus, subjects, node)
    return (await overlay(bus, subjects, [record]))[0]


async def stored_records(bus: Bus, subjects: Subjects) -> list[NodeRecord]:
    """Every record as ``fleet_nodes`` holds it, sorted by node id: for what a record says
    beyond its heartbeat (its cluster, key, state, lifecycle, registrations), written when
    it changes. Its heartbeat's parts (LAST SEEN, SEQ, health, GPUs, workloads) may be a
    checkpoint old: :func:`overlay` them (or :func:`read_fleet`) before showing or acting
    on them. The garbage collector is paused while they are decoded
    (:func:`heap.collector_paused`)."""
    with heap.collector_paused():
        return await stored.read_records(bus, subjects)


async def stored_records_shelved(bus: Bus, subjects: Subjects) -> stored.Shelved:
    """:func:`stored_records` with each record's heartbeat None and its bytes beside
    (:func:`actors.fleet.storage.records.read_records_shelved`), for a listing that
    :func:`overlay` s them at once (given that shelf as ``shelf``): between a node's
    checkpoints FLEET_HB holds a newer heartbeat than its record, and the record's own is
    then never decoded. Filter them on what a record says beyond its heartbeat only."""
    with heap.collector_paused():
        return await stored.read_records_shelved(bus, subjects)


async def stored_records_of(bus: Bus, subjects: Subjects, nodes: list[str]) -> list[NodeRecord]:
    """The records of ``nodes`` as ``fleet_nodes`` holds them (those that have one),
    sorted by node id: :func:`stored_records` for a few nodes named (by the state index),
    without a scan of the bucket."""
    return await stored.read_records_of(bus, subjects, nodes)


async def stored_record(bus: Bus, subjects: Subjects, node: str) -> NodeRecord:
    """The record of ``node`` as ``fleet_nodes`` holds it (see :func:`stored_records`);
    NotFound without one."""
    return await stored.read_record(bus, subjects, node)


async def overlay(
    bus: Bus,
    subjects: Subjects,
    records: list[NodeRecord],
    durable: str = DURABLE,
    shelf: stored.Shelf | None = None,
    helpers: int = 0,
) -> list[LiveRecord]:
    """``records`` (in their order) with each node's latest accepted heartbeat where one
    can be read, else the record as it is, marked; each names the maintenance window
    covering it. Never raises for what it reads: a failed read marks every record it
    concerns. ``shelf``: the records' own heartbeats, for records read without them
    (:func:`stored_records_shelved`), decoded where shown and taken off the shelf as the
    read goes. ``helpers``: processes that check the signatures of a scan (more than
    SCAN_ABOVE records) beside this one (:mod:`actors.runtime.signature_helpers`; a
    command line's read, never a service's). The garbage collector is paused meanwhile
    (:func:`heap.collector_paused`)."""
    with heap.collector_paused():
        try:
            async with asyncio.timeout(READ_TIMEOUT):
                shown = await _overlay(bus, subjects, records, durable, shelf, helpers)
        except (nats.errors.Error, TimeoutError, FleetError) as exc:
            note = f"heartbeats not readable: {str(exc) or type(exc).__name__}"
            shown = [_marked(record, note, shelf) for record in records]
        return await fleet_facts(bus, subjects, shown)


async def fleet_facts(bus: Bus, subjects: Subjects, records: list[LiveRecord]) -> list[LiveRecord]:
    """``records`` with what the fleet knows of each beside its heartbeat: the
    maintenance window covering it, the remediation policy's hold and what its workloads
    are now."""
    marked = await held_by_policy(bus, subjects, await in_maintenance(bus, subjects, records))
    return [with_workload_status(record, time.time()) for record in marked]


def with_workload_status(record: LiveRecord, now: float) -> LiveRecord:
    """``record`` with each listed workload's status now (``workload_status``)."""
    beat = record.heartbeat
    if beat is None or not beat.workloads:
        return record
    shown = {w.name: status_now(record, w, (), now) for w in beat.workloads}
    return msgspec.structs.replace(record, workload_status=shown)


async def held_by_policy(
    bus: Bus, subjects: Subjects, records: list[LiveRecord]
) -> list[LiveRecord]:
    """``records`` with the remediation policy's hold of each (``policy_hold``); as they
    are where the policy's records cannot be read."""
    if not records:
        return records
    try:
        policies = await read_policies(bus, subjects)
    except (nats.errors.Error, TimeoutError, FleetError):
        return records
    holds = {
        (p.cluster, node): f"{hold.action} refused: needs attention"
        if hold.refused
        else hold.action
        for p in policies
        for node, hold in p.holds.items()
    }
    return [
        msgspec.structs.replace(record, policy_hold=action)
        if (action := holds.get((record.cluster, record.node_id)))
        else record
        for record in records
    ]


async def in_maintenance(
    bus: Bus, subjects: Subjects, records: list[LiveRecord]
) -> list[LiveRecord]:
    """``records`` with the maintenance window covering each (``maintenance``); as they
    are where the windows cannot be read (no bucket yet: an older aggregator)."""
    if not records:
        return records
    try:
        windows = await read_windows(bus, subjects)
    except (nats.errors.Error, TimeoutError, FleetError):
        return records
    now = time.time()
    marked = []
    for record in records:
        window = next(
            (w for w in windows if covers(w, record.node_id, record.cluster, record.labels, now)),
            None,
        )
        if window is not None:
            record = msgspec.structs.replace(record, maintenance=window.id)
        marked.append(record)
    return marked


async def _overlay(
    bus: Bus,
    subjects: Subjects,
    records: list[NodeRecord],
    durable: str,
    shelf: stored.Shelf | None,
    helpers: int,
) -> list[LiveRecord]:
    """Each message is judged as its page comes (only the decoded heartbeats are kept,
    never the fleet's bytes), against the floors read before it was asked for; those
    above them are waited for, read again and judged again (see the module's
    docstring)."""
    if not records:
        return []
    partitions = await heartbeat_partitions(bus.js, subjects)
    by_subject = {
        subjects.stored_heartbeat(record.cluster, record.node_id, partitions): record
        for record in records
    }

    async def read_floors() -> dict[int, int]:
        return await _read_floors(bus, subjects, durable, range(partitions))

    found: dict[str, LiveRecord] = {}
    waiting: dict[str, int] = {}
    """Subjects whose message was not judged yet, with that message's stream seq."""
    wanted = list(by_subject)
    scan = len(records) > SCAN_ABOVE
    loop = asyncio.get_running_loop()
    deadline: float | None = None

    async def judge(page: _Page) -> None:
        signatures = await page.signatures()
        for message in page.messages:
            record = by_subject[message.subject]
            key = page.keys.get(record.node_id)
            shown = _judged(record, message, key, page.floors, shelf, signatures)
            found[record.node_id] = shown
            if shown.live_note == _PENDING:
                waiting[message.subject] = message.seq

    async with SignatureChecks(helpers if scan else 0) as checks:
        while True:
            stored = _stored(bus, subjects, wanted, scan, read_floors)
            async with contextlib.aclosing(stored) as pages:
                # A page's signatures are checked (by the helpers, in a scan) while the
                # page before it is judged here and the next one is read.
                held: _Page | None = None
                async for floors, messages in pages:
                    keys = await _keys_needed(bus, subjects, messages, by_subject)
                    page = _page(checks, floors, messages, keys, by_subject)
                    if held is not None:
                        await judge(held)
                    held = page
                if held is not None:
                    await judge(held)
            for subject in wanted:
                record = by_subject[subject]
                if record.node_id not in found:  # nothing stored on its subject
                    found[record.node_id] = _judged(record, None, None, {}, shelf, {})
            # The wait for judgements starts once they are known (a scan may take long).
            deadline = loop.time() + JUDGE_WAIT if deadline is None else deadline
            if not waiting or loop.time() >= deadline:
                break
            await _judged_past(bus, subjects, durable, waiting, deadline)
            # Read again: each waited-for message is still there (then judged and not
            # refused), or a newer one replaced it (judged or not, as the floors say).
            wanted, scan, waiting = list(waiting), False, {}
            for subject in wanted:
                del found[by_subject[subject].node_id]
    return [found[record.node_id] for record in records]


@dataclass(frozen=True)
class _Page:
    """A page of messages read, with what judging it takes: the ack floors read before
    it, its nodes' approved keys, and the checks of its signatures (answered later)."""

    floors: dict[int, int]
    messages: list[Stored]
    keys: dict[str, str]
    checked: list[int]
    """The stream seqs of the messages whose signatures are checked, in order."""
    checking: Checking

    async def signatures(self) -> dict[int, str]:
        """By stream seq, each checked message's answer (:func:`signature_helpers.check`)."""
        return dict(zip(self.checked, await self.checking.answers(), strict=True))


def _page(
    checks: SignatureChecks,
    floors: dict[int, int],
    messages: list[Stored],
    keys: dict[str, str],
    by_subject: dict[str, NodeRecord],
) -> _Page:
    """``messages`` with their signatures handed to ``checks``: those of the messages newer
    than their record's own whose node has an approved key (every one :func:`_accepted`
    checks; a message it meets unchecked all the same is checked there)."""
    checked = [
        message
        for message in messages
        if message.seq > by_subject[message.subject].last_stream_seq
        and message.data
        and by_subject[message.subject].node_id in keys
    ]
    items = [(m.headers.get(HEADER_KEY), m.headers.get(HEADER_SIG), m.data) for m in checked]
    checking = checks.submit(items)
    return _Page(floors, messages, keys, [message.seq for message in checked], checking)


_PENDING = "latest heartbeat not judged by an aggregator yet"


def _judged(
    record: NodeRecord,
    message: Stored | None,
    key: str | None,
    floors: dict[int, int],
    shelf: stored.Shelf | None,
    signatures: dict[int, str],
) -> LiveRecord:
    """The record with ``message`` as its heartbeat if that was accepted, else marked;
    ``signatures``: the answers of the checks of signatures made already, by stream seq."""
    try:
        heartbeat = _accepted(record, message, key, floors, signatures)
    except _Pending:
        return _marked(record, _PENDING, shelf)
    except _Refused as refused:
        return _marked(record, str(refused), shelf)
    if heartbeat is None or message is None:
        return _marked(record, "", shelf)
    if shelf is not None:
        shelf.drop(record.node_id)  # a node shown a newer heartbeat is not read again
    health = heartbeat.health
    return LiveRecord(
        **msgspec.structs.asdict(record)
        | {
            "last_seq": heartbeat.seq,
            "last_seen": message.stored,
            "heartbeat": heartbeat,
            "health_status": health.status if health else record.health_status,
            "health_score": health.score if health else record.health_score,
            "gpus_total": len(heartbeat.sample.gpus) if heartbeat.sample else 0,
            "agent_version": heartbeat.agent_version,
            "last_stream_seq": message.seq,
            "last_stored": message.stored,
            "live": True,
        }
    )


def _accepted(
    record: NodeRecord,
    message: Stored | None,
    key: str | None,
    floors: dict[int, int],
    signatures: dict[int, str],
) -> Heartbeat | None:
    """The heartbeat of ``message`` if it is the node's latest accepted one; None when
    the record's own is (it was written with it, or in a settled state nothing came
    since); _Refused or _Pending otherwise. Its signature's check is taken from
    ``signatures`` (by stream seq), or made here."""
    if message is None or message.seq <= record.last_stream_seq:
        if record.state in SETTLED or (
            message is not None and message.seq == record.last_stream_seq
        ):
            return None
        raise _Refused("no heartbeat in FLEET_HB (expired or deleted)")
    headers = message.headers
    if "Nats-Marker-Reason" in headers or not message.data:
        if record.state in SETTLED:
            return None
        raise _Refused("latest heartbeat expired (stale marker)")
    if "Nats-Rollup" in headers:
        raise _Refused("latest message refused: carries Nats-Rollup")
    if key is None:
        raise _Refused("latest heartbeat refused: the node has no approved key")
    signer = headers.get(HEADER_KEY)
    refusal = signatures.get(message.seq)
    if refusal is None:
        refusal = check((signer, headers.get(HEADER_SIG), message.data))
    if refusal:
        raise _Refused(f"latest heartbeat refused: {refusal}")
    if signer != key:
        raise _Refused("latest heartbeat refused: not signed by the node's approved key")
    try:
        heartbeat = codec.decode(message.data, Heartbeat, message.subject)
    except DecodeError as exc:
        raise _Refused(f"latest heartbeat refused: {exc.reason}") from None
    if heartbeat.node_id != record.node_id or heartbeat.cluster != record.cluster:
        raise _Refused("latest heartbeat refused: names another node or cluster")
    if record.deregistered:
        raise _Refused("latest heartbeat refused: the node is deregistered")
    if heartbeat.seq <= record.last_seq and not record.seq_reset:
        raise _Refused(f"latest heartbeat refused: seq {heartbeat.seq} is a replay")
    if abs(heartbeat.ts - message.stored) > MAX_SKEW:
        raise _Refused("latest heartbeat refused: its clock is off")
    partition = int(message.subject.split(".")[-3])
    if message.seq > floors.get(partition, 0):
        raise _Pending
    return heartbeat


def _marked(record: NodeRecord, note: str, shelf: stored.Shelf | None) -> LiveRecord:
    """The record as stored, its own heartbeat taken from ``shelf`` where it was read
    without (let go of there unless the node is read again after its judgement):
    ``live`` when that heartbeat is the latest accepted. One that does not decode is
    shown without, and says so (read whole, the record was left out as unreadable)."""
    node = record.node_id
    body = shelf.take(node, keep=note == _PENDING) if shelf is not None else None
    if body is None:
        return as_live(record, live=not note, note=note)
    try:
        heartbeat = codec.decode(body, Heartbeat, f"key {node}")
    except DecodeError as exc:
        return as_live(record, note=f"its record's heartbeat is unreadable: {exc.reason}")
    return LiveRecord(
        **msgspec.structs.asdict(record)
        | {"heartbeat": heartbeat, "live": not note, "live_note": note}
    )


async def _keys_needed(
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
    return await _approved_keys(bus, subjects, nodes) if nodes else {}


async def _approved_keys(bus: Bus, subjects: Subjects, nodes: list[str]) -> dict[str, str]:
    """The approved, unrevoked key of each of ``nodes`` that has one."""
    bucket = subjects.bucket_name(BUCKET_TRUST)
    wanted = set(nodes)
    prefix = f"$KV.{bucket}."
    keys: dict[str, str] = {}
    for message in await _messages(bus, f"KV_{bucket}", [prefix + n for n in nodes], prefix):
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


async def _stored(
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


async def _messages(bus: Bus, stream: str, wanted: list[str], prefix: str) -> list[Stored]:
    """The latest message of each of ``wanted``: a scan above SCAN_ABOVE subjects."""
    if len(wanted) <= SCAN_ABOVE:
        return await direct_get.last_of(bus, stream, wanted, READ_TIMEOUT)
    latest: dict[str, Stored] = {}
    scan = direct_get.pages(bus, stream, f"{prefix}>", READ_TIMEOUT)
    async with contextlib.aclosing(scan) as pages:  # closed as the loop stops, even by a raise
        async for page in pages:
            latest.update((message.subject, message) for message in page)
    return list(latest.values())


async def _read_floors(
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


async def _judged_past(
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
        floors = await _read_floors(bus, subjects, durable, need)
        if all(floors.get(p, 0) >= seq for p, seq in need.items()):
            return
        await asyncio.sleep(min(FLOOR_POLL, max(deadline - loop.time(), 0.0)))
