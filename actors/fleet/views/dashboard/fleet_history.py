"""The fleet's history for the overview's charts: per sample, the nodes by state (every
node of the fleet, from the pages' snapshot) and, of the nodes this aggregator holds, the
mean GPU utilisation, the GPUs' power in all and the heartbeats per second.

One point a ``dashboard_history_interval`` (60 s), a day of them kept: a fixed number of
columns of 4-byte floats, whatever the fleet's size (about 80 KB for a day at one point
a minute; ``tests/bench/bench_dashboard.py`` measures it). It is per fleet, never per
node: the per-node charts are :mod:`.history`'s.
"""

from __future__ import annotations

import array
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

from schemas.messages import Heartbeat

STATE_GROUPS: dict[str, tuple[str, ...]] = {
    "active": ("active",),
    "degraded": ("degraded",),
    "unhealthy": ("unhealthy",),
    "cordoned or draining": ("cordoned", "draining", "drained"),
    "stale or offline": ("stale", "offline"),
}
"""The lines of the nodes-by-state chart and the states each counts."""
GPU_FIGURES = ("GPU utilisation %", "GPU power W", "heartbeats /s", "nodes held", "GPUs")
"""The other columns: GPU mean utilisation and power of the held nodes, their heartbeats
a second, how many nodes and reporting GPUs they were."""
COLUMNS = (*STATE_GROUPS, *GPU_FIGURES)
DAY = 86_400.0
MAX_POINTS = 2880
"""Points kept at most (a day at one point every 30 s)."""


def points_for(interval: float) -> int:
    """Points that cover a day at one every ``interval`` seconds (at most MAX_POINTS)."""
    return max(2, min(MAX_POINTS, math.ceil(DAY / interval)))


@dataclass
class GpuTotals:
    """What one round of samples adds up over the held nodes' heartbeats."""

    nodes: int = 0
    gpus: int = 0
    utilisation: float = 0.0
    """Sum of the reporting GPUs' utilisation (percent)."""
    reporting: int = 0
    power: float = 0.0
    beats: int = 0
    """Heartbeats the held nodes sent since the last round (their seq advanced)."""


UNITS = 2.0**149
"""A 4-byte float's smallest step: a kept share's figures (:data:`.history.SHARE`'s
floats) are whole numbers of it, so :class:`Kept` adds and takes them exactly."""


@dataclass
class Kept:
    """The shares of the nodes whose points repeat, kept as they come and go: exact sums
    (whole numbers of :data:`UNITS`), so a day of changes leaves no drift."""

    nodes: int = 0
    gpus: int = 0
    reporting: int = 0
    utilisation: int = 0
    power: int = 0

    def add(self, share: Share, sign: int = 1) -> None:
        self.nodes += sign
        self.gpus += sign * share.gpus
        self.reporting += sign * share.reporting
        self.utilisation += sign * int(share.utilisation * UNITS)
        self.power += sign * int(share.power * UNITS)

    def take(self, share: Share) -> None:
        self.add(share, -1)

    def totals(self, beats: int) -> GpuTotals:
        """The round's totals, with the ``beats`` the held nodes sent since the last."""
        return GpuTotals(
            nodes=self.nodes,
            gpus=self.gpus,
            utilisation=self.utilisation / UNITS,
            reporting=self.reporting,
            power=self.power / UNITS,
            beats=beats,
        )


class Share(NamedTuple):
    """What one node's heartbeat adds to :class:`GpuTotals`."""

    gpus: int
    reporting: int
    utilisation: float
    power: float


def share_of(beat: Heartbeat) -> Share:
    gpus = reporting = 0
    utilisation = power = 0.0
    for gpu in beat.sample.gpus if beat.sample else []:
        if gpu.lost:
            continue
        gpus += 1
        if gpu.utilization_pct is not None:
            utilisation += gpu.utilization_pct
            reporting += 1
        if gpu.power_w is not None:
            power += gpu.power_w
    return Share(gpus, reporting, utilisation, power)


class FleetHistory:
    """A ring of ``points`` samples of :data:`COLUMNS`, on its own clock."""

    def __init__(self, points: int) -> None:
        self.points = points
        self.times = array.array("d", [math.nan] * points)
        self.columns = {name: array.array("f", [math.nan] * points) for name in COLUMNS}
        self.head = 0
        self._last: float | None = None

    def add(self, now: float, by_state: Mapping[str, int], totals: GpuTotals) -> None:
        """One sample taken at ``now``: the fleet's counts by state and the held nodes'
        totals; heartbeats a second over the time since the sample before."""
        slot = self.head
        self.head = (slot + 1) % self.points
        self.times[slot] = now
        for group, states in STATE_GROUPS.items():
            self.columns[group][slot] = sum(by_state.get(state, 0) for state in states)
        utilisation = totals.utilisation / totals.reporting if totals.reporting else math.nan
        elapsed = now - self._last if self._last is not None else 0.0
        rate = totals.beats / elapsed if elapsed > 0 else math.nan
        figures = (utilisation, totals.power if totals.gpus else math.nan, rate)
        for name, value in zip(GPU_FIGURES, (*figures, totals.nodes, totals.gpus), strict=True):
            self.columns[name][slot] = value
        self._last = now

    def series(self, name: str, since: float) -> list[tuple[float, float]]:
        """The (time, value) points of column ``name`` taken at or after ``since``."""
        column = self.columns[name]
        out = []
        for step in range(self.points):
            slot = (self.head + step) % self.points
            when = self.times[slot]
            if math.isnan(when) or when < since or math.isnan(column[slot]):
                continue
            out.append((when, float(column[slot])))
        return out

    def latest(self, name: str) -> float | None:
        """The newest value of column ``name``; None before any sample."""
        slot = (self.head - 1) % self.points
        value = self.columns[name][slot]
        return None if math.isnan(self.times[slot]) or math.isnan(value) else float(value)
