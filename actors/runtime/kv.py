"""JetStream KV as the actors use it: key listings, typed reads and one watch loop.

Every reader of a bucket goes through here, so "no such key", "deleted" and "unreadable"
mean the same thing everywhere, and every watcher is stopped the same bounded way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Callable
from typing import NamedTuple, TypeVar

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
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


PAGE_KEYS = 1000
"""Messages asked for per batched direct get."""
PAGE_BYTES = 8 * 1024 * 1024
"""Bytes the server sends at most per page; half the client's pending-bytes budget of a
subscription, so one page never overflows it."""


class _Page(msgspec.Struct):
    """One batched direct get's answers, in stream order, and what its end said."""

    entries: list[tuple[str, bytes | None]]
    """(key, value) per message; None for a delete or purge marker."""
    revisions: list[int] = []
    """The stream sequence (the entry's revision) of each of ``entries``."""
    last_seq: int = 0
    pending: int = 0


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
    latest: dict[str, tuple[bytes | None, int]] = {}
    partial = False
    async for entries in latest_pages(bus, bucket, timeout):
        for key, value, revision in entries:
            if keep is not None and not keep(key):
                continue
            if key in latest or len(latest) < limit:
                latest[key] = (value, revision)
            else:
                partial = True
    if partial:
        log.warning("kv bucket read in part", extra={"bucket": bucket, "limit": limit})
    return {
        key: (value, revision) for key, (value, revision) in latest.items() if value is not None
    }


async def latest_pages(
    bus: Bus, bucket: str, timeout: float
) -> AsyncGenerator[list[tuple[str, bytes | None, int]]]:
    """The scan :func:`latest_values` makes, page by page as it reads them (a caller
    that takes each page in at once never holds the whole bucket's bytes): (key, value,
    revision) in stream order, value None for a delete or purge. A key rewritten during
    the scan comes again later (its last value is the current one). The next page is
    asked for, and the request is at the server, before this one is handed over: the
    server reads it while the caller takes this one in (at most two pages held)."""
    stream = f"KV_{bucket}"
    prefix = f"$KV.{bucket}."
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    asked: _Asked | None = await _ask_page(bus, stream, prefix, 1)
    try:
        while asked is not None:
            current, asked = asked, None  # _page_read unsubscribes it, whatever happens
            page = await _page_read(current, max(deadline - loop.time(), 0.0))
            if page.pending:
                asked = await _ask_page(bus, stream, prefix, page.last_seq + 1)
                await bus.flush(max(deadline - loop.time(), 0.001))
            yield [
                (key, value, revision)
                for (key, value), revision in zip(page.entries, page.revisions, strict=True)
            ]
    finally:
        if asked is not None:  # a caller that stopped early leaves no subscription behind
            await unsubscribe_quietly(asked.subscription)


async def latest_value(bus: Bus, bucket: str, key: str, timeout: float) -> bytes | None:
    """The current value of one ``key`` of ``bucket`` (None when absent or deleted), by
    the same batched direct get as :func:`latest_values`, filtered to the key's subject:
    the one read a node may make of ``fleet_nodes`` (deploy/nats/auth.conf), so it can
    read its own record without reading the fleet's."""
    stream = f"KV_{bucket}"
    prefix = f"$KV.{bucket}."
    value: bytes | None = None
    deadline = asyncio.get_running_loop().time() + timeout
    seq = 1
    while True:
        left = deadline - asyncio.get_running_loop().time()
        page = await _direct_page(bus, stream, prefix, seq, max(left, 0.0), prefix + key)
        for _, entry in page.entries:
            value = entry
        if page.pending == 0:
            return value
        seq = page.last_seq + 1


class _Asked(NamedTuple):
    """One batched direct get sent: the page its answers fill, done when they end."""

    page: _Page
    finished: asyncio.Future[None]
    subscription: Subscription


async def _direct_page(
    bus: Bus, stream: str, prefix: str, seq: int, timeout: float, subjects: str = ""
) -> _Page:
    """Up to PAGE_KEYS messages of ``stream`` from ``seq`` on: one batched direct get."""
    return await _page_read(await _ask_page(bus, stream, prefix, seq, subjects), timeout)


async def _ask_page(bus: Bus, stream: str, prefix: str, seq: int, subjects: str = "") -> _Asked:
    """Send the batched direct get of up to PAGE_KEYS messages of ``stream`` from ``seq``
    on. nats-py does not wrap the batched form, so this sends the request itself on a
    fresh inbox and collects the answers: one message per stored message in stream
    order, then a status 204 "EOB" message (404 when nothing is stored from ``seq`` on)."""
    page = _Page(entries=[])
    finished: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def on_message(msg: Msg) -> None:
        if finished.done():
            return
        headers = msg.headers or {}
        status = headers.get("Status", "")
        if status == END_OF_BATCH:
            page.pending = int(headers.get("Nats-Num-Pending", "0"))
            page.last_seq = int(headers.get("Nats-Last-Sequence", "0"))
            finished.set_result(None)
        elif status == NO_MESSAGES:
            finished.set_result(None)
        elif status:
            finished.set_exception(
                BatchError(f"direct get on {stream}: {status} {headers.get('Description', '')}")
            )
        elif len(page.entries) >= PAGE_KEYS:
            finished.set_exception(BatchError(f"direct get on {stream}: over {PAGE_KEYS} answers"))
        else:
            subject = headers.get("Nats-Subject", "")
            if subject.startswith(prefix):
                deleted = headers.get("KV-Operation") in (KV_DEL, KV_PURGE)
                value = None if deleted or not msg.data else msg.data
                page.entries.append((subject.removeprefix(prefix), value))
                page.revisions.append(int(headers.get("Nats-Sequence", "0")))

    inbox = bus.new_inbox()
    subscription = await bus.subscribe(inbox, on_message)
    try:
        request = {
            "seq": seq,
            "next_by_subj": subjects or f"{prefix}>",
            "batch": PAGE_KEYS,
            "max_bytes": PAGE_BYTES,
        }
        subject = f"{bus.js_api_prefix}.DIRECT.GET.{stream}"
        await bus.publish(subject, msgspec.json.encode(request), reply=inbox)
    except BaseException:
        await unsubscribe_quietly(subscription)
        raise
    return _Asked(page, finished, subscription)


async def _page_read(asked: _Asked, timeout: float) -> _Page:
    """The page of a direct get sent, once its answers ended (within ``timeout``)."""
    try:
        async with asyncio.timeout(timeout):
            await asked.finished
    finally:
        await unsubscribe_quietly(asked.subscription)
    return asked.page


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
            if on_behind is not None:
                on_behind(entry.delta or 0)
    finally:
        await _stop_watcher(watcher)


async def _stop_watcher(watcher: KeyValue.KeyWatcher) -> None:
    """Stop a KV watcher on the way out, bounded: nats-py's stop can wait on a callback that
    is itself waiting (for its set-up, or for room in a full queue)."""
    try:
        async with asyncio.timeout(WATCHER_STOP_TIMEOUT):
            await watcher.stop()  # type: ignore[no-untyped-call]  # nats-py leaves it untyped
    except (TimeoutError, nats.errors.Error):
        log.debug("kv watcher did not stop cleanly")
