"""JetStream KV as the actors use it: key listings, typed reads and one watch loop.

Every reader of a bucket goes through here, so "no such key", "deleted" and "unreadable"
mean the same thing everywhere, and every watcher is stopped the same bounded way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Callable
from typing import TypeVar

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js.kv import KV_DEL, KV_PURGE, KeyValue

from actors.runtime import direct_get
from actors.runtime.bus import Bus
from actors.runtime.subscriptions import unsubscribe_quietly
from schemas import codec
from schemas.errors import DecodeError

log = logging.getLogger(__name__)

T = TypeVar("T")

WATCHER_STOP_TIMEOUT = 2.0
PAGE_KEYS = direct_get.PAGE_KEYS
BatchError = direct_get.BatchError
"""A batched direct get was refused, or answered more than it was asked for."""


async def latest_values(
    bus: Bus,
    bucket: str,
    limit: int,
    timeout: float,
    keep: Callable[[str], bool] | None = None,
) -> dict[str, bytes]:
    """The current value of every key of ``bucket`` (at most ``limit`` keys); deleted and
    purged keys are left out.

    Why not ``keys()`` and ``get()``: listing keys creates an ephemeral consumer on the
    bucket's stream per call (a client that lists often, or a hostile one, exhausts the
    server's consumers), consumer rights would let a node create as many as it likes, and
    a value read key by key races every writer (a key rewritten between the listing and
    its get is missed, a listing taken mid-rewrite repeats or loses keys). A direct get
    (nats-server 2.11+, the bucket needs ``allow_direct``) creates nothing and needs only
    the right to publish one API subject.

    Why a scan and not ``multi_last``: the server answers a ``multi_last`` batch with 413
    "Too Many Results" once the bucket holds more than 1,024 keys. So this reads the
    bucket's stream forward in pages (``seq`` + ``next_by_subj``, at most PAGE_KEYS
    messages and PAGE_BYTES each) until the server says nothing is pending, keeping the
    last message per key. No key is ever missed or repeated: a key's newest message only
    moves forward, so one rewritten during the scan is read again further on (the later
    value wins) and one deleted during it ends with its delete marker.
    Bounded: at most ``limit`` keys are kept (a larger bucket is read in part, and
    logged; the scan still runs to the end, so the keys kept have their newest values); a
    page answering more than asked, a refusal (BatchError) or no end within ``timeout``
    in all (TimeoutError) raise. ``keep``: only keys it accepts are kept (the rest are
    skipped before anything is decoded or stored).
    """
    entries = await latest_entries(bus, bucket, limit, timeout, keep)
    return {key: value for key, (value, _) in entries.items()}


async def latest_entries(
    bus: Bus,
    bucket: str,
    limit: int,
    timeout: float,
    keep: Callable[[str], bool] | None = None,
) -> dict[str, tuple[bytes, int]]:
    """:func:`latest_values` with each value's revision (for compare-and-set)."""
    return await latest_taken(bus, bucket, limit, timeout, lambda _, v, r: (v, r), keep)


async def latest_taken(
    bus: Bus,
    bucket: str,
    limit: int,
    timeout: float,
    take: Callable[[str, bytes, int], T],
    keep: Callable[[str], bool] | None = None,
) -> dict[str, T]:
    """:func:`latest_values`, each value given to ``take`` (key, value, revision) as its
    page comes and only what it answers kept: a reader that decodes there never holds
    the bucket's bytes beside what it made of them (the next page is already asked for
    while it does). A key rewritten during the scan is taken again, the later value
    winning."""
    latest: dict[str, T | None] = {}
    partial = False
    async with contextlib.aclosing(latest_pages(bus, bucket, timeout)) as pages:
        async for entries in pages:
            for key, value, revision in entries:
                if keep is not None and not keep(key):
                    continue
                if key in latest or len(latest) < limit:
                    latest[key] = None if value is None else take(key, value, revision)
                else:
                    partial = True
    if partial:
        log.warning("kv bucket read in part", extra={"bucket": bucket, "limit": limit})
    return {key: taken for key, taken in latest.items() if taken is not None}


async def latest_pages(
    bus: Bus, bucket: str, timeout: float, since: int = 0
) -> AsyncGenerator[list[tuple[str, bytes | None, int]]]:
    """The scan :func:`latest_values` makes, page by page as it reads them (a caller
    that takes each page in at once never holds the whole bucket's bytes): (key, value,
    revision) in stream order, value None for a delete or purge; with ``since``, only
    the keys written after that revision (the bucket keeps one value a key: a key
    written since comes with its current value, the others are not read). A key
    rewritten during the scan comes again later (its last value is the current one).
    The next page is asked for, and the request is at the server, before this one is
    handed over: the server reads it while the caller takes this one in (at most two
    pages held)."""
    prefix = f"$KV.{bucket}."
    # Every subject (">"), not the bucket's "$KV.<bucket>.>": the stream holds nothing
    # else (what is not the bucket's is left out below), and the server pays for a filter
    # that is not the whole stream on every message it passes (as FLEET_HB's scan,
    # :mod:`actors.fleet.live.reader`). Closed with this generator, not whenever it is
    # collected: a caller that stops early leaves no subscription behind for the next
    # page's answers.
    async with contextlib.aclosing(
        direct_get.pages(bus, f"KV_{bucket}", ">", timeout, start=since + 1)
    ) as pages:
        async for messages in pages:
            yield [
                _entry(message, prefix)
                for message in messages
                if message.subject.startswith(prefix)
            ]


async def values_of(bus: Bus, bucket: str, keys: list[str], timeout: float) -> dict[str, bytes]:
    """The current value of each of ``keys`` that has one (deleted and purged ones left
    out): batched direct gets of exactly those keys (``multi_last``), never a scan."""
    prefix = f"$KV.{bucket}."
    messages = await direct_get.last_of(
        bus, f"KV_{bucket}", [prefix + key for key in keys], timeout
    )
    found: dict[str, bytes] = {}
    for message in messages:
        key, value, _ = _entry(message, prefix)
        if value is not None:
            found[key] = value
    return found


def _entry(message: direct_get.Stored, prefix: str) -> tuple[str, bytes | None, int]:
    """(key, value, revision) of a stored KV message; value None for a delete or purge."""
    deleted = message.headers.get("KV-Operation") in (KV_DEL, KV_PURGE)
    value = None if deleted or not message.data else message.data
    return message.subject.removeprefix(prefix), value, message.seq


async def latest_value(bus: Bus, bucket: str, key: str, timeout: float) -> bytes | None:
    """The current value of one ``key`` of ``bucket`` (None when absent or deleted), by
    the same batched direct get as :func:`latest_values`, filtered to the key's subject:
    the one read a node may make of ``fleet_nodes`` (deploy/nats/auth.conf), so it can
    read its own record without reading the fleet's."""
    prefix = f"$KV.{bucket}."
    value: bytes | None = None
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    seq = 1
    while True:
        request = {"seq": seq, "next_by_subj": prefix + key}
        asked = await direct_get.ask(bus, f"KV_{bucket}", request)
        page = await direct_get.read(asked, max(deadline - loop.time(), 0.0))
        for message in page.messages:
            value = _entry(message, prefix)[1]
        if page.pending == 0:
            return value
        seq = page.last_seq + 1


class _ApiError(msgspec.Struct):
    err_code: int = 0
    description: str = ""


class _PubAck(msgspec.Struct):
    """A JetStream publish's answer: the stored message's sequence, or an error."""

    seq: int = 0
    error: _ApiError | None = None


async def update_many(
    bus: Bus, bucket: str, writes: list[tuple[str, bytes, int]], timeout: float
) -> list[int | None]:
    """Write every ``(key, value, revision)`` to ``bucket`` if the key is still at
    ``revision`` (compare-and-set, as ``KeyValue.update``), all in flight at once: each
    write is one publish whose answer comes on one inbox subscription, where nats-py's
    ``update`` costs a request, a future and a timer each. Returns per write its new
    revision, or None where the key had moved on, the write was refused, or no answer came
    within ``timeout`` (the caller writes those the careful way, reading first)."""
    results: list[int | None] = [None] * len(writes)
    answered: set[int] = set()
    finished: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def on_answer(msg: Msg) -> None:
        token = msg.subject.rpartition(".")[2]
        index = int(token) if token.isdigit() else -1
        if not 0 <= index < len(writes) or index in answered or finished.done():
            return
        answered.add(index)
        try:
            answer = msgspec.json.decode(msg.data, type=_PubAck)
        except (msgspec.DecodeError, msgspec.ValidationError):
            answer = _PubAck()
        if answer.error is None and answer.seq > 0:
            results[index] = answer.seq
        elif answer.error is not None:
            log.debug(
                "compare-and-set write refused",
                extra={"key": writes[index][0], "reason": answer.error.description},
            )
        if len(answered) == len(writes):
            finished.set_result(None)

    if not writes:
        return results
    inbox = bus.new_inbox()
    subscription = await bus.subscribe(f"{inbox}.*", on_answer)
    try:
        for index, (key, value, revision) in enumerate(writes):
            headers = {"Nats-Expected-Last-Subject-Sequence": str(revision)}
            await bus.publish(f"$KV.{bucket}.{key}", value, headers, reply=f"{inbox}.{index}")
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await asyncio.shield(finished)
    finally:
        await unsubscribe_quietly(subscription)
    return results


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
    on_behind: Callable[[int], None] | None = None,
) -> None:
    """Call ``on_change(key, value)`` for every current entry of ``bucket``, then
    ``on_current()`` once, then ``on_change`` for every change, until cancelled.

    A deleted or purged key arrives as None. So does an unreadable value (logged): the
    follower's copy must not keep a value the bucket no longer holds, and raising would
    only restart the watch into the same value. ``on_unreadable(key)`` lets the caller
    count them. ``on_behind(n)`` follows every entry: the entries after it the server
    still had for this watch when it sent it, so 0 once the follower has caught up.

    The watch is current at its first entry after which the server had nothing more for
    it (``delta`` 0), or, for a bucket that holds nothing, at nats-py's end-of-data
    marker. That marker alone is not believed: nats-py 2.16 sends it before any entry
    when the server has already sent them all and none has been read yet (a busy
    process; nats-io/nats.py#842), and a follower told it is current then would hold an
    empty copy of a full bucket (the trust watch: every node unknown).
    """
    watcher = await bucket.watchall()
    current = False
    try:
        async for entry in watcher:
            if entry is None:  # nats-py's end-of-data marker (see above)
                if not current and await _holds_nothing(bucket):
                    current = True
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
            if not current and not entry.delta:
                current = True
                if on_current is not None:
                    on_current()
            if on_behind is not None:
                on_behind(entry.delta or 0)
    finally:
        await _stop_watcher(watcher)


async def _holds_nothing(bucket: KeyValue) -> bool:
    """Whether ``bucket``'s stream holds no message (no key, nor a deleted one's marker):
    then a watch of it has no entry to deliver."""
    return (await bucket.status()).values == 0


async def _stop_watcher(watcher: KeyValue.KeyWatcher) -> None:
    """Stop a KV watcher on the way out, bounded: nats-py's stop can wait on a callback that
    is itself waiting (for its set-up, or for room in a full queue)."""
    try:
        async with asyncio.timeout(WATCHER_STOP_TIMEOUT):
            await watcher.stop()  # type: ignore[no-untyped-call]  # nats-py leaves it untyped
    except (TimeoutError, nats.errors.Error):
        log.debug("kv watcher did not stop cleanly")
