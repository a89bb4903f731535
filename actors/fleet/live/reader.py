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
from dataclasses import dataclass

import msgspec
import nats.errors
import nats.js.errors

from actors.fleet.live import stored_heartbeats
from actors.fleet.live.fleet_facts import fleet_facts
from actors.fleet.storage import records as stored
from actors.fleet.storage.streams import heartbeat_partitions
from actors.runtime import heap
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
from schemas.messages import Heartbeat, NodeRecord
from schemas.signing import HEADER_KEY, HEADER_SIG
from schemas.subjects import Subjects

MAX_SKEW = 300.0
"""Seconds a heartbeat's ``ts`` may be off its store time (the aggregators' default
``max_skew``)."""
JUDGE_WAIT = 3.0
"""Seconds a read waits at most for the owners to judge the heartbeats it found."""
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
    ``stored_heartbeats.SCAN_ABOVE`` records) beside this one
    (:mod:`actors.runtime.signature_helpers`; a command line's read, never a service's).
    The garbage collector is paused meanwhile (:func:`heap.collector_paused`)."""
    with heap.collector_paused():
        try:
            async with asyncio.timeout(stored_heartbeats.READ_TIMEOUT):
                shown = await _overlay(bus, subjects, records, durable, shelf, helpers)
        except (nats.errors.Error, TimeoutError, FleetError) as exc:
            note = f"heartbeats not readable: {str(exc) or type(exc).__name__}"
            shown = [_marked(record, note, shelf) for record in records]
        return await fleet_facts(bus, subjects, shown)


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
        return await stored_heartbeats.read_floors(bus, subjects, durable, range(partitions))

    found: dict[str, LiveRecord] = {}
    waiting: dict[str, int] = {}
    """Subjects whose message was not judged yet, with that message's stream seq."""
    wanted = list(by_subject)
    scan = len(records) > stored_heartbeats.SCAN_ABOVE
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
            stored = stored_heartbeats.stored_messages(bus, subjects, wanted, scan, read_floors)
            async with contextlib.aclosing(stored) as pages:
                # A page's signatures are checked (by the helpers, in a scan) while the
                # page before it is judged here and the next one is read.
                held: _Page | None = None
                async for floors, messages in pages:
                    keys = await stored_heartbeats.keys_needed(bus, subjects, messages, by_subject)
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
            await stored_heartbeats.judged_past(bus, subjects, durable, waiting, deadline)
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
