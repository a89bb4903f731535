"""JetStream KV as the actors use it: key listings, typed reads and one watch loop.

Every reader of a bucket goes through here, so "no such key", "deleted" and "unreadable"
mean the same thing everywhere, and every watcher is stopped the same bounded way.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TypeVar

import nats.errors
import nats.js.errors
from nats.js.kv import KV_DEL, KV_PURGE, KeyValue

from schemas import codec
from schemas.errors import DecodeError

log = logging.getLogger(__name__)

T = TypeVar("T")

WATCHER_STOP_TIMEOUT = 2.0


async def keys(bucket: KeyValue) -> list[str]:
    """Every key of ``bucket``, sorted; [] for an empty bucket. Reads headers only."""
    try:
        return sorted(await bucket.keys())
    except nats.js.errors.NoKeysError:
        return []


async def read(bucket: KeyValue, key: str, kind: type[T]) -> T | None:
    """The value under ``key`` decoded as ``kind``; None when there is none (never written,
    deleted or purged). An unreadable value raises DecodeError naming the key."""
    value, _ = await read_with_revision(bucket, key, kind)
    return value


async def read_with_revision(
    bucket: KeyValue, key: str, kind: type[T]
) -> tuple[T | None, int | None]:
    """Like :func:`read`, plus the KV revision a compare-and-set write must name: None when
    the key has never been written or was deleted (the writer creates it)."""
    try:
        entry = await bucket.get(key)
    except nats.js.errors.KeyNotFoundError:  # KeyDeletedError included
        return None, None
    if not entry.value:
        return None, entry.revision
    return codec.decode(entry.value, kind, f"key {key}"), entry.revision


async def follow(
    bucket: KeyValue,
    kind: type[T],
    on_change: Callable[[str, T | None], None],
    on_current: Callable[[], None] | None = None,
    on_unreadable: Callable[[str], None] | None = None,
) -> None:
    """Call ``on_change(key, value)`` for every current entry of ``bucket``, then
    ``on_current()`` once, then ``on_change`` for every change, until cancelled.

    A deleted or purged key arrives as None. So does an unreadable value (logged): the
    follower's copy must not keep a value the bucket no longer holds, and raising would
    only restart the watch into the same value. ``on_unreadable(key)`` lets the caller
    count them.
    """
    watcher = await bucket.watchall()
    try:
        async for entry in watcher:
            if entry is None:  # nats-py's marker: every current entry has been delivered
                if on_current is not None:
                    on_current()
                continue
            value = None
            if entry.operation not in (KV_DEL, KV_PURGE) and entry.value:
                try:
                    value = codec.decode(entry.value, kind, f"key {entry.key}")
                except DecodeError as exc:
                    log.warning(
                        "unreadable kv value",
                        extra={"bucket": entry.bucket, "key": entry.key, "reason": str(exc)},
                    )
                    if on_unreadable is not None:
                        on_unreadable(entry.key)
            on_change(entry.key, value)
    finally:
        await _stop_watcher(watcher)


async def _stop_watcher(watcher: KeyValue.KeyWatcher) -> None:
    """Stop a KV watcher on the way out, bounded: nats-py's stop can wait on a callback that
    is itself waiting (for its set-up, or for room in a full queue)."""
    try:
        await asyncio.wait_for(watcher.stop(), WATCHER_STOP_TIMEOUT)  # type: ignore[no-untyped-call]  # nats-py leaves it untyped
    except (TimeoutError, nats.errors.Error):
        log.debug("kv watcher did not stop cleanly")
