"""Durations as people read them, in the largest sensible unit, as kubectl's AGE writes
them (``42s``, ``17m``, ``5h``, ``3d``): every view and alert text says a duration this
way (parsing one back is :func:`actors.runtime.durations.parse_duration`); and times of day
in UTC, whatever value a node sent."""

from __future__ import annotations

import time


def clock(ts: float, pattern: str = "%Y-%m-%dT%H:%M:%SZ") -> str:
    """``ts`` (Unix seconds) in UTC as ``pattern`` (``2026-11-21T11:52:03Z``: lines from
    several hosts compare); "-" for a time no calendar holds (a node's own timestamps are
    bounded below only: 1e300 is a valid one)."""
    try:
        return time.strftime(pattern, time.gmtime(ts))
    except (OverflowError, OSError, ValueError):
        return "-"


def span(seconds: float) -> str:
    """``seconds`` as ``42s``, ``17m``, ``5h`` or ``3d`` (rounded down)."""
    seconds = max(0.0, seconds)
    for unit, size, up_to in (("s", 1, 120), ("m", 60, 120), ("h", 3600, 48)):
        if seconds < size * up_to:
            return f"{seconds // size:.0f}{unit}"
    return f"{seconds // 86400:.0f}d"


def age(seconds: float) -> str:
    """How long ago, in :func:`span`'s units: ``42s ago``, ``3d ago``; ``now`` for a time
    ahead of the clock."""
    if seconds < 0:
        return "now"
    return f"{span(seconds)} ago"
