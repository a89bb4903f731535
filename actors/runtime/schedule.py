"""Timing the actors share: jittered periods, capped backoff, rate limits, waiting for
an event with a time limit, and stopping a loop whose cancel was lost.

Periods are jittered (10 % unless said) so agents started together never report in
lock-step; backoffs are jittered wider so reconnecting clients spread out.
"""

from __future__ import annotations

import asyncio
import random
import time


def jittered(period: float, spread: float = 0.1) -> float:
    """``period`` give or take ``spread`` (a fraction), drawn afresh at each call."""
    return period * random.uniform(1 - spread, 1 + spread)


class Backoff:
    """Retry delays that double from ``initial`` up to ``maximum``, each jittered by
    ``spread``, so clients failing together do not retry together; ``reset()`` after a
    success starts again from ``initial``."""

    def __init__(self, initial: float, maximum: float, spread: float = 0.2) -> None:
        self.initial = initial
        self.maximum = maximum
        self.spread = spread
        self._delay = initial

    def next(self) -> float:
        """The delay before the next try; each call doubles the one after (capped)."""
        delay = min(self._delay, self.maximum)
        self._delay = delay * 2
        return jittered(delay, self.spread)

    def reset(self) -> None:
        self._delay = self.initial


async def sleep_jittered(period: float) -> None:
    """Sleep about ``period`` seconds (give or take 10 %)."""
    await asyncio.sleep(jittered(period))


async def wait_or_timeout(event: asyncio.Event, timeout: float) -> bool:
    """Wait until ``event`` is set, for at most ``timeout`` seconds; whether it was set."""
    try:
        async with asyncio.timeout(timeout):
            await event.wait()
    except TimeoutError:
        return False
    return True


class RateLimit:
    """At most ``limit`` events per key in each fixed window of ``window`` seconds.

    Counts are forgotten when a window ends, so memory holds only the keys of one window:
    at most ``max_keys`` of them, or, checked after an overall limit (key ""), at most that
    limit's."""

    def __init__(self, limit: int, window: float, max_keys: int | None = None) -> None:
        self.limit = limit
        self.window = window
        self.max_keys = max_keys
        """Keys counted in one window at most; a key beyond them is refused until it ends
        (checked before an overall limit, this is what bounds memory)."""
        self._started = time.monotonic()
        self._counts: dict[str, int] = {}

    def allow(self, key: str = "") -> bool:
        """Count one event of ``key``; False (not counted) once the key is at its limit."""
        now = time.monotonic()
        if now - self._started >= self.window:
            self._started = now
            self._counts.clear()
        count = self._counts.get(key, 0)
        if count >= self.limit:
            return False
        if count == 0 and self.max_keys is not None and len(self._counts) >= self.max_keys:
            return False
        self._counts[key] = count + 1
        return True


def stop_if_cancelled() -> None:
    """Raise CancelledError if this task's cancel was asked for and lost. Python 3.11's
    ``asyncio.wait_for`` (nats-py awaits its requests and fetches with it) returns the
    result when its task is cancelled just as the awaited thing finished: a loop that
    must stop when told (a partition's work, a lease's keeper) checks at each round.
    Our own code waits with ``asyncio.timeout``, which keeps the cancel (ruff bans
    ``wait_for``)."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


async def take_turn(done: int, per_turn: int) -> None:
    """In a long pass over many items, let the event loop run once every ``per_turn``
    of them (``done``: the items done so far): what else the process does (a lease
    renewal, the connection's reader) waits for a turn, never for the whole pass."""
    if done % per_turn == 0:
        await asyncio.sleep(0)
