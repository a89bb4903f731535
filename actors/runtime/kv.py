"""JetStream KV as the actors use it: key listings, typed reads and one watch loop.

Every reader of a bucket goes through here, so "no such key", "deleted" and "unreadable"
mean the same thing everywhere, and every watcher is stopped the same bounded way.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TypeVar

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js.kv import KV_DEL, KV_PURGE, KeyValue

from actors.runtime.bus import Bus, unsubscribe_quietly
from schemas import codec
from schemas.errors import DecodeError

log = logging.getLogger(__name__)

T = TypeVar("T")

WATCHER_STOP_TIMEOUT = 2.0
END_OF_BATCH = "204"
"""The status of the message that ends a batched direct get (description ``EOB``)."""
NO_MESSAGES = "404"
"""The status a batched direct get answers when the bucket holds no key at all."""


class BatchError(nats.errors.Error):
    """A batched direct get was refused, or answered more than it was asked for."""


async def latest_values(bus: Bus, bucket: str, limit: int, timeout: float) -> dict[str, bytes]:
    """The current value of every key of ``bucket`` (at most ``limit`` keys), read with one
    JetStream batched direct get; deleted and purged keys are left out.

    Why not ``keys()`` and ``get()``: listing keys creates an ephemeral consumer on the
    bucket's stream per call (a client that lists often, or a hostile one, exhausts the
    server's consumers), and consumer rights would let a node create as many as it likes.
    A direct get (nats-server 2.11+, the bucket needs ``allow_direct``) creates nothing and
    needs only the right to publish one API subject. nats-py does not wrap the batched form,
    so this sends the request itself on a fresh inbox and collects the answers: one message
    per key in stream order, then a status 204 "EOB" message (404 when the bucket is empty).
    Bounded: the server sends at most ``limit`` keys (a larger bucket is read in part, and
    logged), more answers than that or no end within ``timeout`` raise (BatchError,
    TimeoutError).
    """
    stream = f"KV_{bucket}"
    prefix = f"$KV.{bucket}."
    values: dict[str, bytes] = {}
    received = 0
    finished: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def on_message(msg: Msg) -> None:
        nonlocal received
        if finished.done():
            return
        headers = msg.headers or {}
        status = headers.get("Status", "")
        if status in (END_OF_BATCH, NO_MESSAGES):
            if headers.get("Nats-Num-Pending", "0") != "0":
                log.warning("kv bucket read in part", extra={"bucket": bucket, "limit": limit})
            finished.set_result(None)
        elif status:
            finished.set_exception(
                BatchError(f"direct get on {stream}: {status} {headers.get('Description', '')}")
            )
        elif (received := received + 1) > limit:
            finished.set_exception(BatchError(f"direct get on {stream}: over {limit} answers"))
        else:
            subject = headers.get("Nats-Subject", "")
            deleted = headers.get("KV-Operation") in (KV_DEL, KV_PURGE)
            if subject.startswith(prefix) and msg.data and not deleted:
                values[subject.removeprefix(prefix)] = msg.data

    inbox = bus.new_inbox()
    subscription = await bus.subscribe(inbox, on_message)
    try:
        request = {"multi_last": [f"{prefix}>"], "batch": limit}
        subject = f"{bus.js_api_prefix}.DIRECT.GET.{stream}"
        await bus.publish(subject, msgspec.json.encode(request), reply=inbox)
        await asyncio.wait_for(finished, timeout)
    finally:
        await unsubscribe_quietly(subscription)
    return values


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
