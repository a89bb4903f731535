"""The raw reader of ``fleet_nodes``: records as the aggregators last wrote them.

A record's ``state`` and lifecycle are written when they change, but its ``last_seen``,
``last_seq`` and embedded heartbeat only at the node's checkpoint (``checkpoint_interval``,
a minute by default): read raw, they may be a minute old. So nothing reads records here
but the live reader (:mod:`actors.fleet.live`), which says how fresh each part is; an
import-linter contract in pyproject.toml holds every other module to it.
"""

from __future__ import annotations

import logging
from typing import NamedTuple, TypeVar

import msgspec

from actors.fleet.packing import Bodies
from actors.fleet.storage.registry import NotFound
from actors.runtime import kv
from actors.runtime.bus import Bus
from schemas import codec
from schemas.errors import DecodeError
from schemas.messages import NodeRecord
from schemas.subjects import BUCKET_NODES, Subjects, check_token

log = logging.getLogger(__name__)
R = TypeVar("R", bound=NodeRecord)

RECORDS_LIMIT = 1_000_000
"""Records :func:`read_records` keeps at most: ten times the 100,000-node fleet the
aggregator is sized for, a bound on memory, not a limit any fleet meets."""
READ_TIMEOUT = 60.0
"""Seconds :func:`read_records` may take in all (100,000 records are about 100 pages)."""


async def read_records(bus: Bus, subjects: Subjects) -> list[NodeRecord]:
    """Every node record, sorted by node id, each exactly once.

    Read with paged batched direct gets (:func:`kv.latest_taken`), not a key listing and
    one get per key: under heartbeat load those raced the aggregators' writes and listed
    the fleet empty, or a node twice. Each page is decoded as it comes, while the server
    reads the next: the bucket's bytes are never all held beside the records (100,000
    records of 8 GPUs: 550 MiB of them, a third of the read's peak). A key rewritten
    during the scan comes again further on and its later value wins; one deleted ends
    with its delete marker. Unreadable records are skipped and logged, so one damaged
    or newer record never hides the rest of the fleet. At most RECORDS_LIMIT records
    (more are logged and left out)."""
    bucket = subjects.bucket_name(BUCKET_NODES)
    found = await kv.latest_taken(
        bus,
        bucket,
        RECORDS_LIMIT,
        READ_TIMEOUT,
        lambda node, value, _: _decoded_one(node, value, NodeRecord),
    )
    return _readable(found)


class Shelf:
    """The records' own heartbeats, by node, as :func:`read_records_shelved` read them:
    packed (:class:`~actors.fleet.packing.Bodies`: an 8-GPU heartbeat of 4.6 KB keeps
    about 500 bytes), so that a listing holds neither every record's heartbeat decoded
    nor the bucket's stored bytes while it reads FLEET_HB."""

    def __init__(self) -> None:
        self._bodies = Bodies()
        self._packed: dict[str, bytes] = {}

    def put(self, node: str, heartbeat: bytes | None) -> None:
        """Keep ``heartbeat`` as ``node``'s record's (None: it holds none), in place of
        one kept before (the key rewritten during the scan)."""
        if heartbeat is None:
            self._packed.pop(node, None)
        else:
            self._packed[node] = self._bodies.pack(heartbeat)

    def take(self, node: str, keep: bool = False) -> bytes | None:
        """The bytes of ``node``'s record's heartbeat (None: it holds none, or they were
        taken), let go of unless ``keep``."""
        packed = self._packed.get(node) if keep else self._packed.pop(node, None)
        return None if packed is None else self._bodies.unpack(packed)

    def drop(self, node: str) -> None:
        """Let go of ``node``'s record's heartbeat: it will not be shown."""
        self._packed.pop(node, None)


class Shelved(NamedTuple):
    """Records read with their heartbeats left undecoded (:func:`read_records_shelved`):
    ``records`` as :func:`read_records` gives them but each ``heartbeat`` None, and
    ``heartbeats`` the bytes of each one's heartbeat."""

    records: list[NodeRecord]
    heartbeats: Shelf


NO_HEARTBEAT = msgspec.Raw(b"null")


class _HeartbeatShelved(NodeRecord, frozen=True, kw_only=True):
    """A record as :func:`read_records_shelved` decodes it: its heartbeat a view of the
    bytes stored, not decoded. Never handed out: each is made a plain ``NodeRecord``
    with no heartbeat, its heartbeat's bytes put on the shelf."""

    heartbeat: msgspec.Raw = NO_HEARTBEAT  # type: ignore[assignment]


async def read_records_shelved(bus: Bus, subjects: Subjects) -> Shelved:
    """:func:`read_records`, each record's heartbeat left undecoded and packed aside: for
    a live listing, which shows most nodes' newer heartbeat from FLEET_HB between
    checkpoints and decodes a record's own only where it shows that. The rest of each
    record is read and checked as :func:`read_records` does; its heartbeat is checked
    when decoded (:func:`actors.fleet.live.reader.overlay`)."""
    bucket = subjects.bucket_name(BUCKET_NODES)
    shelf = Shelf()

    def take(node: str, value: bytes, _: int) -> NodeRecord | DecodeError:
        record = _decoded_one(node, value, _HeartbeatShelved)
        if isinstance(record, DecodeError):
            return record
        shelf.put(node, None if record.heartbeat == NO_HEARTBEAT else bytes(record.heartbeat))
        return NodeRecord(**(msgspec.structs.asdict(record) | {"heartbeat": None}))

    found = await kv.latest_taken(bus, bucket, RECORDS_LIMIT, READ_TIMEOUT, take)
    return Shelved(_readable(found), shelf)


async def read_records_of(bus: Bus, subjects: Subjects, nodes: list[str]) -> list[NodeRecord]:
    """The records of ``nodes`` that have one (deleted ones left out), sorted by node id:
    batched direct gets of their keys (``multi_last``, 1,000 a request), never a scan of
    the bucket. Unreadable ones are skipped and logged, as in :func:`read_records`."""
    bucket = subjects.bucket_name(BUCKET_NODES)
    keys = [check_token("node id", node) for node in nodes]
    return _decoded(await kv.values_of(bus, bucket, keys, READ_TIMEOUT))


def _decoded(values: dict[str, bytes]) -> list[NodeRecord]:
    """The records of ``values`` (node -> stored bytes), sorted by node id; unreadable ones
    skipped and logged (:func:`_readable`)."""
    return _readable(
        {node: _decoded_one(node, value, NodeRecord) for node, value in values.items()}
    )


def _decoded_one(node: str, value: bytes, kind: type[R]) -> R | DecodeError:
    """The record ``node``'s stored bytes hold, decoded as ``kind``, or why they do not
    (without its traceback, whose frames would keep the bytes until the read ends)."""
    try:
        return codec.decode(value, kind, f"key {node}")
    except DecodeError as exc:
        return exc.with_traceback(None)


def _readable(found: dict[str, NodeRecord | DecodeError]) -> list[NodeRecord]:
    """The records of ``found``, sorted by node id; each unreadable one logged and left
    out, so one damaged or newer record never hides the rest."""
    records = []
    for node, record in sorted(found.items()):
        if isinstance(record, DecodeError):
            log.warning("unreadable record skipped", extra={"node": node, "reason": str(record)})
        else:
            records.append(record)
    return records


async def read_record(bus: Bus, subjects: Subjects, node: str) -> NodeRecord:
    """The record of ``node``; NotFound when it has none."""
    check_token("node id", node)
    bucket = await bus.kv(subjects.bucket_name(BUCKET_NODES))
    current = await kv.read(bucket, node, NodeRecord)
    if current is None:
        raise NotFound(f"node {node}")
    return current
