"""JetStream KV as the actors use it: key listings and typed reads.

Every reader of a bucket goes through here, so "no such key", "deleted" and "unreadable"
mean the same thing everywhere.
"""

from __future__ import annotations

from typing import TypeVar

import nats.js.errors
from nats.js.kv import KeyValue

from schemas import codec

T = TypeVar("T")


async def keys(bucket: KeyValue) -> list[str]:
    """Every key of ``bucket``, sorted; [] for an empty bucket. Reads headers only."""
    try:
        return sorted(await bucket.keys())
    except nats.js.errors.NoKeysError:
        return []


async def read(bucket: KeyValue, key: str, kind: type[T]) -> T | None:
    """The value under ``key`` decoded as ``kind``; None when there is none (never written,
    deleted or purged). An unreadable value raises DecodeError naming the key."""
    try:
        entry = await bucket.get(key)
    except nats.js.errors.KeyNotFoundError:
        return None
    if not entry.value:
        return None
    return codec.decode(entry.value, kind, f"key {key}")
