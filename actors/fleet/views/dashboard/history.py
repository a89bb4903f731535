"""The dashboard's charts' memory: the last hour of a few figures per node, bounded.

Every ``interval`` seconds the sampler takes one point of each node that changed (of the
nodes this aggregator holds; the others repeat theirs, :class:`History`): health score,
hottest GPU temperature, mean GPU utilisation, GPU power in all, and the heartbeat
interval seen since the last point:
the time between the two heartbeats over the beats between them, counting at most one
beat per configured ``interval`` (an agent beats at once after a health change: such a
beat is not a shorter cadence, and a silence still shows as a longer one). Points of all nodes share
one clock (:attr:`History.times`), so a node keeps only its values, packed as
:data:`POINT` says (7 bytes a point, each figure at the precision its source has: NVML
reads whole degrees, percent and watts), in a ring of bytes, behind the
(ts, seq) of the heartbeat its last point came from and that heartbeat's share of the
fleet's totals (so a node that sent nothing since costs no decode). A node's ring is a
row of a few large ``bytearray`` blocks shared by all nodes (:data:`BLOCK_ROWS` rows each),
not an object of its own: with the default 60 points that is 461 bytes a node plus its
row number and dict entry (a ``bytearray`` a node cost 56 bytes more for its object and
the allocator's rounding of its buffer), about 48 MB at 100,000 nodes, reported by
``bytes_per_node`` and measured in ``tests/bench/bench_dashboard.py``.
"""

from __future__ import annotations

import array
import math
import struct
import sys
from collections.abc import Container, Sequence
from dataclasses import dataclass

from actors.fleet.views.dashboard.fleet_history import Kept, Share, share_of
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
MARK = struct.Struct("<qB")
"""The round of the node's last point written, and whether its points repeat after it
(1) or are missing (0), ahead of its points."""
MARK_AT = LAST.size + SHARE.size
HEAD = MARK_AT + MARK.size
"""Bytes ahead of a node's points."""
EMPTY = POINT.pack(*(packing.missing for packing in PACKINGS))
BLOCK_ROWS = 1024
"""Nodes' rings per block (about 460 KB with 60 points): the blocks grow one at a time,
so at most one block's rows stand empty (a single growing ``bytearray`` over-allocates
by an eighth); the rows of nodes forgotten are used again before a block is added."""


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
    """The last ``points`` samples of every node, on one shared clock.

    A round (:meth:`begin`) touches no node: a node whose latest heartbeat is still the
    one its last point came from repeats that point (without an interval) in every round
    until it is :meth:`put` again, :meth:`blank` or forgotten; the repeats are written
    into its ring when it is next touched or read, and its share of the fleet's totals
    stays in :attr:`kept`. A round costs what changed, not the fleet's size."""

    def __init__(self, points: int) -> None:
        self.points = points
        self.times = array.array("d", [math.nan] * points)
        """When each slot was sampled (NaN: not yet)."""
        self.round = -1
        """The current round (its slot: ``round % points``); -1 before the first."""
        self.head = 0
        """The slot the next sample goes to."""
        self.row_size = HEAD + points * POINT.size
        """A ring's bytes: :data:`LAST`, :data:`SHARE`, :data:`MARK`, then ``points``
        points of :data:`POINT`."""
        self.nodes: dict[str, int] = {}
        """Per node, the row its ring is in."""
        self.kept = Kept()
        """The shares of the nodes whose points repeat (every node with a point in the
        current round)."""
        self._blocks: list[bytearray] = []
        self._free: list[int] = []
        """Rows of nodes forgotten, used again first."""

    def _ring(self, row: int) -> tuple[bytearray, int]:
        """The block row ``row`` is in, and the row's offset in it."""
        block, index = divmod(row, BLOCK_ROWS)
        return self._blocks[block], index * self.row_size

    def _new_row(self) -> int:
        if self._free:
            row = self._free.pop()
        else:
            row = len(self.nodes)
            if row == len(self._blocks) * BLOCK_ROWS:
                self._blocks.append(bytearray(BLOCK_ROWS * self.row_size))
        block, offset = self._ring(row)
        block[offset : offset + self.row_size] = bytes(HEAD) + EMPTY * self.points
        return row

    def _at(self, offset: int, round_: int) -> int:
        """The offset of round ``round_``'s point in the row at ``offset``."""
        return offset + HEAD + round_ % self.points * POINT.size

    def _fill(self, block: bytearray, offset: int, upto: int) -> bool:
        """Write the row's points of the rounds after its last one up to ``upto``: its
        last point again without an interval while it repeats, else none. Whether it
        repeats."""
        last, repeats = MARK.unpack_from(block, offset + MARK_AT)
        if last >= upto:
            return bool(repeats)
        if repeats:
            *figures, _ = POINT.unpack_from(block, self._at(offset, last))
            again = POINT.pack(*figures, PACKINGS[-1].missing)
        else:
            again = EMPTY
        for round_ in range(max(last + 1, upto - self.points + 1), upto + 1):
            at = self._at(offset, round_)
            block[at : at + POINT.size] = again
        MARK.pack_into(block, offset + MARK_AT, upto, repeats)
        return bool(repeats)

    def begin(self, now: float) -> int:
        """Start a round of samples taken at ``now``; the slot they go to. No node is
        touched: each repeats its last point until told otherwise."""
        self.round += 1
        slot = self.head
        self.times[slot] = now
        self.head = (slot + 1) % self.points
        return slot

    def current(self, node: str, seq: int) -> bool:
        """Whether the node's points repeat from its heartbeat ``seq``: nothing to do."""
        row = self.nodes.get(node)
        if row is None:
            return False
        block, offset = self._ring(row)
        _, repeats = MARK.unpack_from(block, offset + MARK_AT)
        return bool(repeats) and LAST.unpack_from(block, offset)[1] == seq

    def put(self, node: str, beat: Heartbeat) -> int:
        """Node ``node``'s point of the current round, from its latest heartbeat, repeated
        after; the heartbeats it sent since its last point (0 for its first)."""
        row = self.nodes.get(node)
        previous: tuple[float, int] | None = None
        if row is None:
            row = self.nodes[sys.intern(node)] = self._new_row()
            block, offset = self._ring(row)
        else:
            block, offset = self._ring(row)
            previous = LAST.unpack_from(block, offset)
            if self._fill(block, offset, self.round - 1):
                self.kept.take(self._share(block, offset))
        sample = point(beat, previous)
        LAST.pack_into(block, offset, beat.ts, beat.seq)
        SHARE.pack_into(block, offset + LAST.size, *share_of(beat))
        MARK.pack_into(block, offset + MARK_AT, self.round, 1)
        self.kept.add(self._share(block, offset))
        figures = zip(PACKINGS, sample.values(), strict=True)
        packed = (packing.pack(value) for packing, value in figures)
        POINT.pack_into(block, self._at(offset, self.round), *packed)
        return max(0, beat.seq - previous[1]) if previous is not None else 0

    def blank(self, node: str) -> None:
        """No point of the node from the current round on (held, its heartbeat not
        readable) until it is :meth:`put` again."""
        row = self.nodes.get(node)
        if row is None:
            return
        block, offset = self._ring(row)
        if self._fill(block, offset, self.round - 1):
            self.kept.take(self._share(block, offset))
        MARK.pack_into(block, offset + MARK_AT, self.round - 1, 0)
        self._fill(block, offset, self.round)

    def _share(self, block: bytearray, offset: int) -> Share:
        return Share(*SHARE.unpack_from(block, offset + LAST.size))

    def forget(self, node: str) -> None:
        """Forget the node (gone, or no longer held); its row is used again by the next
        node, and every block is let go once no node is left (the blocks stay at the
        most nodes held since: at most MAX_NODES)."""
        row = self.nodes.pop(node, None)
        if row is None:
            return
        block, offset = self._ring(row)
        if MARK.unpack_from(block, offset + MARK_AT)[1]:
            self.kept.take(self._share(block, offset))
        self._free.append(row)
        if not self.nodes:
            self._blocks.clear()
            self._free.clear()

    def keep_only(self, nodes: Container[str]) -> None:
        """Forget the nodes not in ``nodes`` (the held ones: no set of them is made)."""
        for node in [node for node in self.nodes if node not in nodes]:
            self.forget(node)

    def series(self, node: str) -> list[list[tuple[float, float]]]:
        """Per :data:`SERIES`, the node's (time, value) points, oldest first."""
        row = self.nodes.get(node)
        out: list[list[tuple[float, float]]] = [[] for _ in SERIES]
        if row is None:
            return out
        block, offset = self._ring(row)
        self._fill(block, offset, self.round)
        for step in range(self.points):
            slot = (self.head + step) % self.points
            when = self.times[slot]
            if math.isnan(when):
                continue
            raws: Sequence[int] = POINT.unpack_from(block, offset + HEAD + slot * POINT.size)
            for values, packing, raw in zip(out, PACKINGS, raws, strict=True):
                value = packing.unpack(raw)
                if value is not None:
                    values.append((when, value))
        return out

    def bytes_per_node(self) -> int:
        """Bytes one node's ring holds in the blocks; its row number and dict entry come
        on top (measured by the benchmark)."""
        return self.row_size if self.nodes else 0
