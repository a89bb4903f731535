"""A wall clock the harness can step: loaded by each agent it starts (this directory is on
the agent's PYTHONPATH, so Python imports this module at start-up, before the agent).

``time.time`` and ``time.time_ns`` return the real time plus the offset in seconds
written in the file ``FLT_CLOCK_FILE`` (read at most every 0.2 s), as an NTP step would
move them; ``time.monotonic``, and so asyncio's timers, are untouched, as a step leaves
them. (libfaketime, Debian's ``faketime``, was the first choice: its 0.9.10 fails every
``time.sleep`` with EINVAL once told to leave the monotonic clock alone.)
"""

from __future__ import annotations

import os
import time

_FILE = os.environ.get("FLT_CLOCK_FILE", "")
_REREAD = 0.2


def _install(path: str) -> None:
    real_time, real_time_ns, monotonic = time.time, time.time_ns, time.monotonic
    offset, next_read = 0.0, 0.0

    def current() -> float:
        nonlocal offset, next_read
        now = monotonic()
        if now >= next_read:
            next_read = now + _REREAD
            try:
                with open(path) as file:
                    offset = float(file.read().strip() or 0)
            except (OSError, ValueError):
                pass
        return offset

    def stepped_time() -> float:
        return real_time() + current()

    def stepped_time_ns() -> int:
        return real_time_ns() + int(current() * 1e9)

    time.time = stepped_time
    time.time_ns = stepped_time_ns


if _FILE:
    _install(_FILE)
