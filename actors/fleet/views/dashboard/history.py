"""The dashboard's charts' memory: the last hour of a few figures per node, bounded.

Every ``interval`` seconds the sampler takes one point of every node it is given (the
nodes this aggregator holds): health score, hottest GPU temperature, mean GPU
utilisation, GPU power in all, and the heartbeat interval seen since the last point:
the time between the two heartbeats over the beats between them, counting at most one
beat per configured ``interval`` (an agent beats at once after a health change: such a
beat is not a shorter cadence, and a silence still shows as a longer one). Points of all nodes share
one clock (:attr:`History.times`), so a node keeps only its values, packed as
:data:`POINT` says (7 bytes a point, each figure at the precision its source has: NVML
reads whole degrees, percent and watts), in one ``bytearray`` used as a ring, behind the
(ts, seq) of the heartbeat its last point came from and that heartbeat's share of the
fleet's totals (so a node that sent nothing since costs no decode). With the default 60
points that is 448 bytes a node (about 510 with the bytearray and its dict entry): 51 MB
at 100,000 nodes, reported by ``bytes_per_node`` and measured in
``tests/bench/bench_dashboard.py``.
"""

from __future__ import annotations

import array
import math
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from actors.fleet.views.dashboard.fleet_history import Share, share_of
from schemas.messages import Heartbeat

SERIES = (
    "health score",
    "hottest GPU °C",
    "GPU utilisation %",
    "GPU power W",
    "heartbeat interval s",
)
"""What each point holds, in order."""


@dataclass(frozen=True)
class Packing:
    """How one figure is kept: an unsigned integer of ``bits`` bits in units of ``1 /
    scale``; its largest value means "not said", values above the next are kept as it."""

    bits: int
    scale: float

    @property
    def missing(self) -> int:
        return (1 << self.bits) - 1

    def pack(self, value: float | None) -> int:
        if value is None or math.isnan(value):
            return self.missing
        return round(min(max(value * self.scale, 0.0), self.missing - 1))

    def unpack(self, raw: int) -> float | None:
        return None if raw == self.missing else raw / self.scale


PACKINGS = (Packing(8, 1.0), Packing(8, 1.0), Packing(8, 1.0), Packing(16, 1.0), Packing(16, 10.0))
"""Per :data:`SERIES`: score 0-100, °C 0-254, % 0-100 and W 0-65,534 in whole units (what
NVML reports), the interval in tenths of a second up to 6,553.4 s."""
POINT = struct.Struct("<" + "".join("B" if p.bits == 8 else "H" for p in PACKINGS))
"""One point's bytes."""
LAST = struct.Struct("<dQ")
"""The (ts, seq) of the heartbeat a node's last point came from, ahead of its points."""
SHARE = struct.Struct("<HHff")
"""That heartbeat's :class:`Share` of the fleet's totals, after it: a node that sent
nothing since its last point is sampled from it and that point, its heartbeat not
decoded (:meth:`History.again`)."""
HEAD = LAST.size + SHARE.size
"""Bytes ahead of a node's points."""
EMPTY = POINT.pack(*(packing.missing for packing in PACKINGS))


@dataclass(frozen=True)
class Point:
    """One sample of a node's figures (None: the node did not say)."""

    score: float | None
    hottest: float | None
    utilisation: float | None
    power: float | None
    interval: float | None

    def values(self) -> tuple[float | None, ...]:
        return (self.score, self.hottest, self.utilisation, self.power, self.interval)


def point(beat: Heartbeat, previous: tuple[float, int] | None) -> Point:
    """The figures of ``beat``; ``previous`` is the (ts, seq) of the heartbeat the last
    point was taken from, for the interval seen since."""
    gpus = [gpu for gpu in (beat.sample.gpus if beat.sample else []) if not gpu.lost]
    temps = [gpu.temperature_c for gpu in gpus if gpu.temperature_c is not None]
    utils = [gpu.utilization_pct for gpu in gpus if gpu.utilization_pct is not None]
    powers = [gpu.power_w for gpu in gpus if gpu.power_w is not None]
    interval = None
    if previous is not None and beat.seq > previous[1]:
        elapsed = beat.ts - previous[0]
        cadence = max(1, round(elapsed / beat.interval)) if beat.interval > 0 else 1
        interval = elapsed / min(beat.seq - previous[1], cadence)
    return Point(
        score=float(beat.health.score) if beat.health else None,
        hottest=max(temps) if temps else None,
        utilisation=sum(utils) / len(utils) if utils else None,
        power=sum(powers) if powers else None,
        interval=interval,
    )


class History:
    """The last ``points`` samples of every node, on one shared clock."""

    def __init__(self, points: int) -> None:
        self.points = points
        self.times = array.array("d", [math.nan] * points)
        """When each slot was sampled (NaN: not yet)."""
        self.head = 0
        """The slot the next sample goes to."""
        self.nodes: dict[str, bytearray] = {}
        """Per node, :data:`LAST` then ``points`` points of :data:`POINT`."""

    def begin(self, now: float) -> int:
        """Start a round of samples taken at ``now``; the slot they go to."""
        slot = self.head
        self.times[slot] = now
        self.head = (slot + 1) % self.points
        offset = HEAD + slot * POINT.size
        for ring in self.nodes.values():
            ring[offset : offset + POINT.size] = EMPTY
        return slot

    def put(self, slot: int, node: str, beat: Heartbeat) -> int:
        """Node ``node``'s point of the round at ``slot``, from its latest heartbeat; the
        heartbeats it sent since its last point (0 for its first)."""
        ring = self.nodes.get(node)
        previous: tuple[float, int] | None = None
        if ring is None:
            ring = bytearray(HEAD) + EMPTY * self.points
            self.nodes[sys.intern(node)] = ring
        else:
            previous = LAST.unpack_from(ring)
        sample = point(beat, previous)
        LAST.pack_into(ring, 0, beat.ts, beat.seq)
        SHARE.pack_into(ring, LAST.size, *share_of(beat))
        figures = zip(PACKINGS, sample.values(), strict=True)
        packed = (packing.pack(value) for packing, value in figures)
        POINT.pack_into(ring, HEAD + slot * POINT.size, *packed)
        return max(0, beat.seq - previous[1]) if previous is not None else 0

    def again(self, slot: int, node: str, seq: int) -> Share | None:
        """Node ``node``'s point of the round at ``slot`` when its latest heartbeat is
        still the one (``seq``) its last point came from: the point of the round before
        again, without an interval (no beat since), and that heartbeat's share of the
        totals; None when it sent another since (or has no point yet): then it is
        :meth:`put`."""
        ring = self.nodes.get(node)
        if ring is None or LAST.unpack_from(ring)[1] != seq:
            return None
        before = (slot - 1) % self.points
        *figures, _ = POINT.unpack_from(ring, HEAD + before * POINT.size)
        POINT.pack_into(ring, HEAD + slot * POINT.size, *figures, PACKINGS[-1].missing)
        return Share(*SHARE.unpack_from(ring, LAST.size))

    def keep_only(self, nodes: set[str]) -> None:
        """Forget the nodes not in ``nodes`` (gone, or no longer held)."""
        for node in [node for node in self.nodes if node not in nodes]:
            del self.nodes[node]

    def series(self, node: str) -> list[list[tuple[float, float]]]:
        """Per :data:`SERIES`, the node's (time, value) points, oldest first."""
        ring = self.nodes.get(node)
        out: list[list[tuple[float, float]]] = [[] for _ in SERIES]
        if ring is None:
            return out
        for step in range(self.points):
            slot = (self.head + step) % self.points
            when = self.times[slot]
            if math.isnan(when):
                continue
            raws: Sequence[int] = POINT.unpack_from(ring, HEAD + slot * POINT.size)
            for values, packing, raw in zip(out, PACKINGS, raws, strict=True):
                value = packing.unpack(raw)
                if value is not None:
                    values.append((when, value))
        return out

    def bytes_per_node(self) -> int:
        """Bytes one node's history holds in its own object (its bytearray); the dict's
        entry comes on top (measured by the benchmark)."""
        if not self.nodes:
            return 0
        return sys.getsizeof(next(iter(self.nodes.values())))
