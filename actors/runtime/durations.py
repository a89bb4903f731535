"""Durations as people write them (``30``, ``30s``, ``500ms``, ``2m``, ``1h``, ``1d``):
the one parser of settings (flags, env, TOML) and of the tools' duration arguments. The
standard library only, so a short command that takes a duration starts at once.
"""

from __future__ import annotations

import re

DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h|d)?\s*$")


class DurationError(ValueError):
    """Text that is not a duration; its message is the one line a user sees."""


def parse_duration(value: str | float) -> float:
    """Seconds from ``30``, ``30s``, ``500ms``, ``2m``, ``1h``, ``1d`` (or a number): the
    one duration parser of flags, env, TOML and fleetctl's own duration arguments. Negative,
    infinite or malformed values raise DurationError; the caller checks its own bounds."""
    if isinstance(value, bool):
        raise DurationError(f"{value!r} is not a duration (use 30, 30s, 500ms, 2m, 1h)")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        match = _DURATION.match(value)
        if match is None:
            raise DurationError(f"{value!r} is not a duration (use 30, 30s, 500ms, 2m, 1h)")
        number, unit = match.groups()
        seconds = float(number) * DURATION_UNITS[unit or "s"]
    if not 0 <= seconds < float("inf"):  # NaN fails too
        raise DurationError(f"{value!r} is not a duration (use 30, 30s, 500ms, 2m, 1h)")
    return seconds
