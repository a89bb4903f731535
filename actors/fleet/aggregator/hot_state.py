"""The partition owner's in-memory acceptance state: one :class:`NodeState` per node and
the queue of checkpoints due.

The aggregator that consumes a node's heartbeats judges each one against this state alone
(no KV round trip), and writes the node's record to ``fleet_nodes`` only when its state
changes (at once) or, for a node that merely keeps beating, once per
``checkpoint_interval`` (spread: each node's checkpoint falls due on its own schedule,
so 100,000 nodes cost ``100_000 / checkpoint_interval`` writes a second, evenly).

Memory: the record kept per node is *slim* (:func:`slim`): its embedded heartbeat keeps
only what the rules read again (seq, ts, boot, intervals, spot notice, labels), and the
whole last accepted heartbeat is kept as the bytes it came in (``NodeState.body``, already
verified and validated), compressed (:class:`Bodies`), spliced undecoded into the record
written (:func:`encoded`) and decoded only to answer the HTTP API (:func:`full`). A
decoded heartbeat is several KB of Python objects; its bytes are 2-4 KB, and compressed
a few hundred: one object, which the garbage collector never walks. The record's GPU
fingerprint is kept apart and packed the same way (``NodeState.gpus``: a node of eight
GPUs holds 384 bytes, not a list of eight 96-byte strings), put back wherever the whole
record is read or written.
"""

from __future__ import annotations

import hashlib
import heapq
import math
import random
import sys
from collections import deque
from collections.abc import Callable
from typing import TypeVar

import msgspec

from actors.fleet import record_state
from actors.fleet.aggregator import record_rules
from actors.fleet.packing import Bodies
from actors.fleet.shared_values import SharedByKey, SharedValues
from schemas import codec
from schemas.events import SpotStatus
from schemas.messages import Heartbeat, NodeRecord
from schemas.settings import SettingsStatus

V = TypeVar("V")

APART: list[str] = []
"""The GPU fingerprint of every record kept in memory (never changed in place): the
node's own is kept packed beside it (``NodeState.gpus``). A GPU's uuid is a 96-byte
string and the list 64 bytes more: 160 bytes a node of one GPU and 900 of eight, where
packed they are 80 and 384."""
NO_GPUS = b"[]"
"""The packed fingerprint of no GPU (none seen yet, or a sample that listed none)."""


def packed_gpus(fingerprint: list[str]) -> bytes:
    """``fingerprint`` packed as :attr:`NodeState.gpus` holds it: its JSON, exact for any
    uuid (what a steady beat's GPUs are compared as)."""
    return msgspec.json.encode(fingerprint) if fingerprint else NO_GPUS


def kept_gpus(fingerprint: list[str]) -> bytes:
    """:func:`packed_gpus` to keep: a copy of its bytes alone (msgspec's buffer keeps
    room beyond them: 549 bytes held for eight GPUs' 345)."""
    return memoryview(packed_gpus(fingerprint)).tobytes() if fingerprint else NO_GPUS


def unpacked_gpus(gpus: bytes) -> list[str]:
    """The fingerprint :func:`packed_gpus` packed, as a list of its own."""
    return msgspec.json.decode(gpus, type=list[str]) if gpus != NO_GPUS else []


def together(record: NodeRecord, gpus: bytes) -> NodeRecord:
    """A record kept (its fingerprint :data:`APART`) with the fingerprint ``gpus``
    back in it, as the rules that compare fingerprints and every reader of
    ``fleet_nodes`` read it."""
    return msgspec.structs.replace(record, gpu_fingerprint=unpacked_gpus(gpus))


class NodeState(msgspec.Struct, gc=False):
    """What the owner knows of one node; ``record`` is always the newest (possibly
    newer than what ``fleet_nodes`` holds: ``dirty``). Never tracked by the garbage
    collector (``gc=False``): it holds values and records, never a container that could
    lead back to it, and a full collection of a 100,000-node owner walked every one of
    them (16 bytes more each, too)."""

    record: NodeRecord
    written: float
    """Monotonic time the record was last written; once loaded, a time spread over the
    checkpoint interval before (:func:`spread_written`)."""
    dirty: bool = False
    """The record changed since it was last written."""
    queued: bool = False
    """A checkpoint of this node is in the queue."""
    reset_consumed: bool = False
    """A heartbeat used up an operator's ``reset-seq`` since the last write: the write
    clears the flag in ``fleet_nodes`` (otherwise a flag set there is kept)."""
    key: str = ""
    """The public key ``verifier`` was built from."""
    verifier: bytes | None = None
    """``key`` decoded for the signature check (:func:`signing.verify_key`)."""
    fresh: bool = False
    """Loaded from fleet_nodes and no heartbeat accepted since."""
    refreshed: float = 0.0
    """Monotonic time the record was last read afresh for a refusal."""
    stored: int | None = None
    """The :func:`digest` of the record (slim, as ``record``) this owner last
    read from or wrote to ``fleet_nodes``: a stored record that differs was written by an
    operator since (forget, approve; see :func:`operator_changes`)."""
    stored_reset: bool = False
    """That record's ``seq_reset`` (an operator's reset-seq, kept by the next write)."""
    body: bytes | None = None
    """The encoded heartbeat whose slim form ``record.heartbeat`` is, packed by the
    table's :class:`Bodies` (None without one)."""
    gpus: bytes = NO_GPUS
    """The node's GPU fingerprint (the record's ``gpu_fingerprint``), packed
    (:func:`packed_gpus`): the record kept holds :data:`APART` instead (see
    :meth:`keep`)."""
    partition: int = -1
    """The node's partition, once a heartbeat subject of it was checked in full (the
    ``Ownership.split``); -1 before."""
    revision: int | None = None
    """The KV revision of ``stored`` when this owner wrote it (None: unknown, so the
    next write reads the record first; a write knowing it costs no read)."""
    facts: int = 0
    """:func:`record_rules.decision_facts` of the last accepted heartbeat: a heartbeat
    that changes them is written at once (0: none known yet)."""
    due: int = 0
    """The second the full sweep next looks at the node for its time rules
    (:mod:`~actors.fleet.aggregator.sweep_queue`); 0: not queued."""

    def __post_init__(self) -> None:
        self.keep(self.record)

    def keep(self, record: NodeRecord) -> None:
        """Make ``record`` the node's: one holding :data:`APART` is slim already (made
        from the record kept: the fingerprint is still :attr:`gpus`); any other list is
        the node's fingerprint now, packed into :attr:`gpus`. Every record the state
        takes comes through here (its construction too)."""
        if record.gpu_fingerprint is not APART:
            self.gpus = kept_gpus(record.gpu_fingerprint)
            record = msgspec.structs.replace(record, gpu_fingerprint=APART)
        self.record = record


class NodeTable(dict[str, NodeState]):
    """The owner's :class:`NodeState` by node, which the HTTP API beside it reads;
    ``loading`` while a cold start fills it (the API then keeps no copy of the records
    coming in: the owner is about to hold them); ``released`` counts the times the owner
    let nodes go (a partition lost or handed on: the API reads their records again),
    ``loads`` the times it took nodes in without writing them (partitions loaded);
    ``everything`` while the owner holds every partition, each claimed and loaded (every
    node's record is its own: the API follows no watch of ``fleet_nodes`` then);
    ``bodies`` packs the heartbeats its states keep."""

    loading: bool = False
    released: int = 0
    loads: int = 0
    everything: bool = False

    def __init__(self) -> None:
        super().__init__()
        self.bodies = Bodies()
        self.listeners: list[Callable[[str], None]] = []
        """Called with a node's name each time its record was written (the views'
        ``Held.listen``)."""
        self.followers: list[Callable[[str], None]] = []
        """Called with a node's name each time it is taken in or let go, or a heartbeat
        of it accepted (:meth:`changed`; the views' ``Held.follow``)."""

    def __setitem__(self, node: str, state: NodeState) -> None:
        # Interned, as the record's node_id (:func:`slim`), the trust cache's keys and the
        # subjects judged are: one string per node, not one per table holding it.
        node = sys.intern(node)
        super().__setitem__(node, state)
        self.changed(node)

    def __delitem__(self, node: str) -> None:
        super().__delitem__(node)
        self.changed(node)

    # Every caller passes a default; dict's overloads for the other forms are not needed.
    def pop(self, node: str, default: NodeState | None = None) -> NodeState | None:  # type: ignore[override]
        state = super().pop(node, default)
        if state is not None:
            self.changed(node)
        return state

    def changed(self, node: str) -> None:
        """Tell the followers that ``node`` changed: taken in, let go or beaten."""
        for follower in self.followers:
            follower(node)

    def whole(self, state: NodeState) -> NodeRecord:
        """The node's whole current record (see :func:`full`)."""
        return full(state.record, state.body, state.gpus, self.bodies)


class CheckpointQueue:
    """Nodes by the whole second their checkpoint falls due (``written + interval``,
    rounded down: a checkpoint may come up to a second early). One deque of nodes per
    second and a heap of those seconds: a node queued after others but due before them
    (its ``written`` spread over the interval before: a cold start's load) is written
    on time, not held behind them."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        # The node's interned name per second, not a (due, node) pair per node: a pair
        # is a 56-byte tuple per node (5.6 MB at 100,000 nodes).
        self._due: dict[int, deque[str]] = {}
        self._seconds: list[int] = []
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def _second(self, state: NodeState) -> int:
        return math.floor(state.written + self.interval)

    def push(self, node: str, state: NodeState) -> None:
        if not state.queued:
            state.queued = True
            second = self._second(state)
            queued = self._due.get(second)
            if queued is None:
                queued = self._due[second] = deque()
                heapq.heappush(self._seconds, second)
            queued.append(node)
            self._count += 1

    def due(self, now: float, limit: int, nodes: dict[str, NodeState]) -> list[str]:
        """Up to ``limit`` dirty nodes whose checkpoint is due at monotonic ``now``."""
        found: list[str] = []
        while self._seconds and len(found) < limit and self._seconds[0] <= now:
            second = self._seconds[0]
            queued = self._due[second]
            while queued and len(found) < limit:
                node = queued.popleft()
                self._count -= 1
                state = nodes.get(node)
                if state is None:
                    continue
                state.queued = False
                if self._second(state) > second:  # written since (a transition): due later
                    if state.dirty:
                        self.push(node, state)
                    continue
                if state.dirty:
                    found.append(node)
            if not queued:
                del self._due[second]
                heapq.heappop(self._seconds)
        return found


def spread_written(now: float, interval: float) -> float:
    """A loaded record's ``written``: random within the last ``interval``, so the
    checkpoints of a fleet loaded at once fall due evenly, not all together."""
    return now - random.uniform(0.0, interval)


HEAVY_FIELDS: dict[str, object] = {
    "sample": None,
    "health": None,
    "latency": None,
    "engine": None,
    "jobs": None,
    "workloads": [],
    "scheduler": None,
    "previous_ts": None,
    "started": None,
}
"""The heartbeat fields no rule reads from a record's last heartbeat (the new heartbeat's
own are read while judging it), nor a view from a record as kept (``fleetctl describe``
reads ``started`` from the whole record): left out of the slim record, kept in ``body``."""


ALIKE_FIELDS = ("cluster", "agent_version", "schedulability", "state", "health_status")
"""A record's strings most nodes of a fleet hold alike: one object for the fleet each
(:data:`ALIKE`)."""
OWN_FIELDS = ("node_id", "public_key")
"""A record's strings of its node alone, which the owner's tables hold too: interned,
one object per node (as the table's keys and the trust watch's keys are)."""
SHARED_STRINGS = 4096
"""Distinct alike strings kept as one object each (:data:`ALIKE`): far more clusters,
versions and states than a fleet has at once."""
ALIKE: SharedValues[str] = SharedValues(SHARED_STRINGS)
"""The fleet's alike strings. Bounded, where ``sys.intern`` is not everywhere (CPython
3.12.0 to 3.12.5 keep every interned string for good): a node that sends a new version
in every heartbeat keeps its own strings once this is full, as before, and costs no more."""


NO_LABELS: dict[str, str] = {}
"""The one empty labels every slim record and kept heartbeat without labels holds
(never changed in place, as :data:`HEAVY_FIELDS`' workloads): an empty dict a node is
64 bytes, 6.4 MB at 100,000 nodes; the empty candidates are
:data:`record_rules.NO_CANDIDATES`."""
SHARED_FLOATS = 256
"""Distinct durations kept as one object each (:func:`shared_duration`): enough for
every interval and ``stale_after`` a fleet configures, bounded against a node that
sends a new one each heartbeat."""
DURATIONS: SharedValues[float] = SharedValues(SHARED_FLOATS)
FACTS: SharedValues[int] = SharedValues(4096)
""":func:`record_rules.decision_facts`' numbers kept (``NodeState.facts``), one int object
each for the nodes alike (36 bytes a node otherwise); a node's number is replaced only
when its facts change (:class:`ledger.Ledger`)."""
SPOTS: SharedValues[SpotStatus] = SharedValues(16)
"""Spot statuses without a notice: one per provider (four)."""
SHARED_SETS = 512
"""Distinct label sets, capabilities and settings statuses kept as one object each: a
fleet's nodes differ by zone, GPU model, instance type and engines, a few hundred sets."""
SHARED_BYTES = 1024
"""The longest value shared, encoded: an agent's 9 labels are about 250 bytes. Longer
ones stay the node's own, so that nodes that each send their own (a label naming the
host, a status of 64 settings) fill a table with at most about 3 MB (a set of 32 labels
of the longest keys and values is 12 KB of objects, a status of 64 settings 120 KB)."""
LABELS: SharedByKey[dict[str, str]] = SharedByKey(SHARED_SETS)
"""The labels nodes send alike (an agent's own: GPU product, count and memory, driver,
provider, region, zone, instance type, lifecycle): one dict of them for the fleet, not
one a node (9 labels: 1.3 KB a node)."""
CAPABILITIES: SharedByKey[list[str]] = SharedByKey(SHARED_SETS)
"""The engines nodes can run, alike (a list of strings: 200 bytes a node)."""
SETTINGS: SharedByKey[SettingsStatus] = SharedByKey(SHARED_SETS)
"""What nodes made of the fleet's settings, alike for the nodes the same entries reach
(a struct of dicts: 470 bytes a node)."""


def shared_duration(value: float) -> float:
    """One float object for a heartbeat interval or ``stale_after`` most nodes send alike
    (24 bytes each a node otherwise). Only positive values: ``-0.0`` equals ``0.0`` but
    encodes otherwise (the slim record's digest must stay its own)."""
    return DURATIONS.one(value) if value > 0 else value


def shared_spot(spot: SpotStatus | None) -> SpotStatus | None:
    """One object for each provider's spot status without a notice (a struct and its
    provider string, about 110 bytes a node otherwise); a notice stays the node's own."""
    if spot is None or spot.notice is not None:
        return spot
    return SPOTS.one(spot)


def shared(table: SharedByKey[V], value: V) -> V:
    """The object ``table`` keeps for a value equal to ``value`` (told by its encoded
    bytes, which keep a dict's order), else ``value``; one longer than
    :data:`SHARED_BYTES` encoded is its own."""
    key = msgspec.json.encode(value)
    return value if len(key) > SHARED_BYTES else table.one_by(key, value)


def shared_labels(labels: dict[str, str]) -> dict[str, str]:
    """The fleet's one dict for labels equal to ``labels`` (:data:`LABELS`),
    :data:`NO_LABELS` for none."""
    return shared(LABELS, labels) if labels else NO_LABELS


def shared_capabilities(capabilities: list[str] | None) -> list[str] | None:
    """The fleet's one list for capabilities equal to ``capabilities``
    (:data:`CAPABILITIES`)."""
    return None if capabilities is None else shared(CAPABILITIES, capabilities)


def shared_settings(settings: SettingsStatus | None) -> SettingsStatus | None:
    """The fleet's one status for settings equal to ``settings`` (:data:`SETTINGS`)."""
    return None if settings is None else shared(SETTINGS, settings)


def slim_heartbeat(heartbeat: Heartbeat, record: NodeRecord | None = None) -> Heartbeat:
    """``heartbeat`` without its :data:`HEAVY_FIELDS`; where it holds what ``record`` (the
    node's record it was judged against) holds, the record's objects instead of equal
    copies: a heartbeat decodes into new strings every time, and a node's steady beats
    would otherwise keep one more copy of its name, boot, version and labels. Where it
    differs (a first heartbeat, an upgrade), its cluster, version and schedulability are
    the fleet's :data:`ALIKE` ones (64 bytes each a node otherwise); its labels,
    capabilities and settings status the fleet's shared ones (:func:`shared_labels`,
    :func:`shared_capabilities`, :func:`shared_settings`; empty labels are
    :data:`NO_LABELS`, a pending record's too); its spot status and durations too
    (:func:`shared_spot`, :func:`shared_duration`)."""
    if record is None:
        return msgspec.structs.replace(heartbeat, **HEAVY_FIELDS)
    last = record.heartbeat
    # Written out, not a loop over names: this runs for every heartbeat (2 µs, not 3.5).
    return msgspec.structs.replace(
        heartbeat,
        **HEAVY_FIELDS,
        node_id=_same(heartbeat.node_id, record.node_id),
        cluster=_alike(heartbeat.cluster, record.cluster),
        boot_id=_same(heartbeat.boot_id, record.boot_id),
        agent_version=_alike(heartbeat.agent_version, record.agent_version),
        schedulability=_alike(heartbeat.schedulability, record.schedulability),
        labels=(record.labels or NO_LABELS)
        if heartbeat.labels == record.labels
        else shared_labels(heartbeat.labels),
        capabilities=last.capabilities
        if last is not None and heartbeat.capabilities == last.capabilities
        else shared_capabilities(heartbeat.capabilities),
        settings=last.settings
        if last is not None and heartbeat.settings == last.settings
        else shared_settings(heartbeat.settings),
        spot=last.spot
        if last is not None and heartbeat.spot == last.spot
        else shared_spot(heartbeat.spot),
        # The kept object when equal (a compare, not a lookup: every heartbeat), positive
        # only (see shared_duration).
        interval=last.interval
        if last is not None and heartbeat.interval == last.interval and last.interval > 0
        else shared_duration(heartbeat.interval),
        stale_after=last.stale_after
        if last is not None and heartbeat.stale_after == last.stale_after and last.stale_after > 0
        else shared_duration(heartbeat.stale_after),
    )


def _same(new: str, kept: str) -> str:
    """``kept`` if it equals ``new`` (the object already held), else ``new``."""
    return kept if new == kept else new


def _alike(new: str, kept: str) -> str:
    """``kept`` if it equals ``new``, else the fleet's one object for ``new`` (a string
    most nodes hold alike: :data:`ALIKE`)."""
    return kept if new == kept else ALIKE.one(new)


def slim(record: NodeRecord) -> NodeRecord:
    """``record`` as kept in memory: its embedded heartbeat slim, its GPU fingerprint
    :data:`APART` (the whole record's is :func:`packed_gpus` of its own)."""
    record = msgspec.structs.replace(record, gpu_fingerprint=APART)
    beat = record.heartbeat
    if beat is None:
        return record
    # A health status or key may be None.
    alike = {
        name: ALIKE.one(value)
        for name in ALIKE_FIELDS
        if isinstance(value := getattr(record, name), str)
    }
    own = {
        name: sys.intern(value)
        for name in OWN_FIELDS
        if isinstance(value := getattr(record, name), str)
    }
    record = msgspec.structs.replace(
        record,
        **alike,
        **own,
        labels=shared_labels(record.labels),
        candidates=record.candidates or record_rules.NO_CANDIDATES,
    )
    # Judged as against a record with no heartbeat kept yet: the beat's own spot status
    # is then the fleet's shared one, not the one decoded with this record.
    unbeaten = msgspec.structs.replace(record, heartbeat=None)
    kept = slim_heartbeat(beat, unbeaten)
    if kept.seq == record.last_seq:
        # Decoded apart, equal: one int object for both, as an accepted beat leaves them
        # (32 bytes a node loaded otherwise).
        kept = msgspec.structs.replace(kept, seq=record.last_seq)
    return msgspec.structs.replace(record, heartbeat=kept)


def full(record: NodeRecord, body: bytes | None, gpus: bytes, bodies: Bodies) -> NodeRecord:
    """The whole record of a slim ``record`` whose heartbeat was encoded and packed by
    ``bodies`` as ``body`` and whose GPU fingerprint is ``gpus``: what the HTTP API
    answers (:func:`encoded` writes the same to ``fleet_nodes`` without decoding).
    ``body`` was verified and decoded (validated) when it was accepted, or encoded from a
    stored record."""
    record = together(record, gpus)
    if body is None or record.heartbeat is None:
        return record
    heartbeat = codec.decode(bodies.unpack(body), Heartbeat)
    return msgspec.structs.replace(record, heartbeat=heartbeat)


def encoded(record: NodeRecord, body: bytes | None, gpus: bytes, bodies: Bodies) -> bytes:
    """The bytes of :func:`full`'s record, made without decoding the heartbeat: its own
    bytes go into the record as they came (``msgspec.Raw``), as verified and validated
    when it was accepted (or encoded from a stored record). What the owner writes to
    ``fleet_nodes``: decoding a heartbeat only to encode it again cost 15 µs a write
    with one GPU and 27 µs with eight (3 µs this way), and filled the memory of a
    checkpoint wave with short-lived objects.
    Fields of a newer agent's heartbeat that this version does not know stay in the
    record, as its readers ignore them; ``fleet_nodes`` makes room for any heartbeat
    ``FLEET_HB`` stores."""
    if gpus != NO_GPUS:
        record = together(record, gpus)
    if body is None or record.heartbeat is None:
        return codec.encode(record)
    return codec.encode(msgspec.structs.replace(record, heartbeat=msgspec.Raw(bodies.unpack(body))))


def from_record(record: NodeRecord, written: float, bodies: Bodies) -> NodeState:
    """The state of a node whose whole record was read from ``fleet_nodes``: slim, its
    heartbeat kept encoded and packed by ``bodies``, ``written`` (monotonic) as its last
    write."""
    kept = slim(record)
    gpus = kept_gpus(record.gpu_fingerprint)
    beat = record.heartbeat
    body = bodies.pack(codec.encode(beat)) if beat is not None else None
    stored = digest(kept, gpus)
    facts = FACTS.one(record_rules.decision_facts(beat)) if beat is not None else 0
    return NodeState(
        kept,
        written,
        fresh=True,
        stored=stored,
        stored_reset=kept.seq_reset,
        body=body,
        gpus=gpus,
        facts=facts,
    )


def from_stored(node: str, value: bytes, written: float, bodies: Bodies) -> NodeState:
    """The state of ``node`` from its stored record ``value`` (the one way a cold start
    takes a record into memory); raises DecodeError if ``value`` is not a NodeRecord."""
    return from_record(codec.decode(value, NodeRecord, node), written, bodies)


# The owner's record against the stored one ---------------------------------------------

DEREGISTRATION_FIELDS = (
    "deregistered",
    "deregistered_by",
    "deregistered_reason",
    "deregistered_at",
)


DIGEST_BITS = 60
"""A record's :func:`digest` is this many bits of its BLAKE2b hash: two digits of a
CPython int, a 32-byte object (16 bytes of ``bytes`` took a 64-byte block: 3 MB more at
100,000 nodes). Two records told apart but for one chance in 2**60."""


def digest(record: NodeRecord, gpus: bytes) -> int:
    """What the partition owner keeps of the record it last read or wrote, slim
    ``record`` and its packed fingerprint ``gpus`` (a :data:`DIGEST_BITS`-bit number, not
    a second record): enough to tell whether a record read later is that one."""
    hashed = hashlib.blake2b(codec.encode(record) + gpus, digest_size=8).digest()
    return int.from_bytes(hashed, "little") >> (64 - DIGEST_BITS)


def stored_digest(record: NodeRecord) -> int:
    """The :func:`digest` of a whole record read from ``fleet_nodes``."""
    return digest(slim(record), packed_gpus(record.gpu_fingerprint))


def operator_changes(mine: NodeRecord, stored: NodeRecord | None, known: int | None) -> NodeRecord:
    """``mine`` (the owner's in-memory record) with the deregistration an operator wrote
    into ``fleet_nodes`` (``stored``, whole) since the owner last read or wrote it
    (``known``, its :func:`digest`): ``fleetctl forget`` deregisters, ``fleetctl approve``
    of a deregistered node re-admits it (and clears the refusal noted). ``stored``
    digesting to ``known`` means nobody else wrote: ``mine`` wins. Heartbeat facts and
    ``reset-seq`` are not taken from here (see :func:`checkpoint`)."""
    if stored is None or known is None or stored_digest(stored) == known:
        return mine
    if all(getattr(stored, name) == getattr(mine, name) for name in DEREGISTRATION_FIELDS):
        return mine
    changes: dict[str, object] = {name: getattr(stored, name) for name in DEREGISTRATION_FIELDS}
    if mine.deregistered and not stored.deregistered:
        changes["refused"], changes["refused_at"] = stored.refused, stored.refused_at
    return record_state.with_state(mine, **changes)


def checkpoint(stored_reset: bool, mine: NodeRecord, reset_consumed: bool) -> NodeRecord:
    """What the partition owner writes over the record in ``fleet_nodes`` from its
    in-memory ``mine``: its own, except that an operator's ``reset-seq`` written since
    (``stored_reset``: the stored record's ``seq_reset``) is kept unless a heartbeat
    already used it up."""
    if stored_reset and not mine.seq_reset and not reset_consumed:
        return msgspec.structs.replace(mine, seq_reset=True)
    return mine
