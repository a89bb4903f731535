"""The dashboard's charts' memory: the last hour of a few figures per node, bounded.

Every ``interval`` seconds the sampler takes one point of every node it is given (the
nodes this aggregator holds): health score, hottest GPU temperature, mean GPU
utilisation, GPU power in all, and the heartbeat interval seen since the last point
(time between the two heartbeats over the seqs between them). Points of all nodes share
one clock (:attr:`History.times`), so a node keeps only its values: :data:`SERIES`
unsigned 16-bit numbers (tenths; :data:`MISSING` where the node said nothing) per point,
in one ``bytearray`` used as a ring. With the default 60 points that is 600 bytes of
values a node (about 700 with the bytearray and its dict entry): 70 MB at 100,000 nodes,
reported by ``bytes_per_node`` and measured in ``tests/bench/bench_dashboard.py``.
"""

from __future__ import annotations

import array
import math
import sys
from dataclasses import dataclass

from schemas.messages import Heartbeat

SERIES = (
    "health score",
    "hottest GPU °C",
    "GPU utilisation %",
    "GPU power W",
    "heartbeat interval s",
)
"""What each point holds, in order."""
MISSING = 0xFFFF
SCALE = 10.0
"""Values are kept in tenths."""
LIMIT = (MISSING - 1) / SCALE
"""The largest value kept (6,553.4): more is kept as this."""


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
        interval = (beat.ts - previous[0]) / (beat.seq - previous[1])
    return Point(
        score=float(beat.health.score) if beat.health else None,
        hottest=max(temps) if temps else None,
        utilisation=sum(utils) / len(utils) if utils else None,
        power=sum(powers) if powers else None,
        interval=interval,
    )


def _pack(value: float | None) -> int:
    if value is None or math.isnan(value):
        return MISSING
    return round(min(max(value, 0.0), LIMIT) * SCALE)


class History:
    """The last ``points`` samples of every node, on one shared clock."""

    def __init__(self, points: int) -> None:
        self.points = points
        self.times = array.array("d", [math.nan] * points)
        """When each slot was sampled (NaN: not yet)."""
        self.head = 0
        """The slot the next sample goes to."""
        self.values: dict[str, array.array[int]] = {}
        self.last: dict[str, tuple[float, int]] = {}
        """Per node, (ts, seq) of the heartbeat its last point came from."""
        self._width = len(SERIES)

    def begin(self, now: float) -> int:
        """Start a round of samples taken at ``now``; the slot they go to."""
        slot = self.head
        self.times[slot] = now
        self.head = (slot + 1) % self.points
        for values in self.values.values():
            for i in range(self._width):
                values[slot * self._width + i] = MISSING
        return slot

    def put(self, slot: int, node: str, beat: Heartbeat) -> None:
        """Node ``node``'s point of the round at ``slot``, from its latest heartbeat."""
        values = self.values.get(node)
        if values is None:
            values = array.array("H", [MISSING] * (self.points * self._width))
            self.values[sys.intern(node)] = values
        sample = point(beat, self.last.get(node))
        self.last[node] = (beat.ts, beat.seq)
        for i, value in enumerate(sample.values()):
            values[slot * self._width + i] = _pack(value)

    def keep_only(self, nodes: set[str]) -> None:
        """Forget the nodes not in ``nodes`` (gone, or no longer held)."""
        for node in [node for node in self.values if node not in nodes]:
            del self.values[node]
            self.last.pop(node, None)

    def series(self, node: str) -> list[list[tuple[float, float]]]:
        """Per :data:`SERIES`, the node's (time, value) points, oldest first."""
        values = self.values.get(node)
        out: list[list[tuple[float, float]]] = [[] for _ in SERIES]
        if values is None:
            return out
        for step in range(self.points):
            slot = (self.head + step) % self.points
            when = self.times[slot]
            if math.isnan(when):
                continue
            for i in range(self._width):
                raw = values[slot * self._width + i]
                if raw != MISSING:
                    out[i].append((when, raw / SCALE))
        return out

    def bytes_per_node(self) -> int:
        """Bytes one node's history holds in its own objects (its values' array and its
        last (ts, seq)); the dicts' entries come on top (measured by the benchmark)."""
        if not self.values:
            return 0
        node, values = next(iter(self.values.items()))
        last = self.last.get(node, (0.0, 0))
        return sys.getsizeof(values) + sys.getsizeof(last) + sum(map(sys.getsizeof, last))
