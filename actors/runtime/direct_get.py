"""Batched direct gets of a JetStream stream (nats-server 2.11+, the stream needs
``allow_direct``): the one implementation of the request and of collecting its answers,
for the KV reads of :mod:`actors.runtime.kv` and the live heartbeat reads of the views.

A direct get creates nothing at the server (no consumer) and needs only the right to
publish one API subject. nats-py does not wrap the batched form, so a request is sent on
a fresh inbox and its answers collected: one message per stored message in stream order,
then a status 204 "EOB" message (404 when nothing matches).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from datetime import datetime
from typing import NamedTuple

import msgspec
import nats.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from actors.runtime.bus import Bus
from actors.runtime.schedule import stop_if_cancelled
from actors.runtime.subscriptions import unsubscribe_quietly

END_OF_BATCH = "204"
"""The status of the message that ends a batched direct get (description ``EOB``)."""
NO_MESSAGES = "404"
"""The status a batched direct get answers when nothing matches."""
PAGE_KEYS = 1000
"""Messages asked for per batched direct get (and subjects per ``multi_last`` request:
the server answers 413 above 1,024 results)."""
IN_FLIGHT = 4
""":func:`last_of`'s requests in flight at once."""
PAGE_BYTES = 8 * 1024 * 1024
"""Bytes the server sends at most per page; half the client's pending-bytes budget of a
subscription, so one page never overflows it."""
PAGE_TIMEOUT = 10.0
"""Seconds one page's answers may take, whatever is left of the whole read's time: a
request lost (its server frozen or gone, the link cut, this process paused) fails the
read then, not at the end of a cold start's two minutes (an aggregator paused during a
load held no partition for 100 s)."""


class BatchError(nats.errors.Error):
    """A batched direct get was refused, or answered more than it was asked for."""


class Stored(NamedTuple):
    """One message as a direct get answers it."""

    subject: str
    seq: int
    """Its stream sequence."""
    stored: float
    """When the stream stored it (server clock, Unix seconds)."""
    headers: dict[str, str]
    """Its own headers and the server's ``Nats-*`` ones."""
    data: bytes


class Page(msgspec.Struct):
    """One batched direct get's answers, in stream order, and what its end said."""

    messages: list[Stored]
    last_seq: int = 0
    pending: int = 0


class Asked(NamedTuple):
    """One batched direct get sent: the page its answers fill, done when they end."""

    page: Page
    finished: asyncio.Future[None]
    subscription: Subscription


def stored_at(stamp: str) -> float:
    """A ``Nats-Time-Stamp`` (RFC 3339, nanoseconds) as Unix seconds; 0.0 if unreadable."""
    head, dot, fraction = stamp.removesuffix("Z").partition(".")
    try:
        return datetime.fromisoformat(f"{head}+00:00").timestamp() + (
            float(f"0.{fraction}") if dot and fraction.isdigit() else 0.0
        )
    except ValueError:
        return 0.0


async def ask(bus: Bus, stream: str, request: dict[str, object]) -> Asked:
    """Send one batched direct get of ``stream`` (``request`` as the server takes it:
    ``seq`` + ``next_by_subj``, or ``multi_last``; ``batch`` is set to PAGE_KEYS)."""
    page = Page(messages=[])
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
        elif len(page.messages) >= PAGE_KEYS:
            finished.set_exception(BatchError(f"direct get on {stream}: over {PAGE_KEYS} answers"))
        else:
            page.messages.append(
                Stored(
                    headers.get("Nats-Subject", ""),
                    int(headers.get("Nats-Sequence", "0")),
                    stored_at(headers.get("Nats-Time-Stamp", "")),
                    headers,
                    msg.data,
                )
            )

    inbox = bus.new_inbox()
    subscription = await bus.subscribe(inbox, on_message)
    try:
        body = msgspec.json.encode({**request, "batch": PAGE_KEYS, "max_bytes": PAGE_BYTES})
        await bus.publish(f"{bus.js_api_prefix}.DIRECT.GET.{stream}", body, reply=inbox)
    except BaseException:
        await unsubscribe_quietly(subscription)
        raise
    return Asked(page, finished, subscription)


async def read(asked: Asked, timeout: float) -> Page:
    """The page of a direct get sent, once its answers ended (within ``timeout``, and
    PAGE_TIMEOUT at most)."""
    try:
        async with asyncio.timeout(min(timeout, PAGE_TIMEOUT)):
            await asked.finished
    finally:
        await unsubscribe_quietly(asked.subscription)
    return asked.page


async def pages(
    bus: Bus,
    stream: str,
    subjects: str,
    timeout: float,
    up_to: int = 0,
    start: int = 1,
) -> AsyncGenerator[list[Stored]]:
    """Every message of ``stream`` on ``subjects`` (a filter) from stream sequence
    ``start`` on, read forward in pages (``seq`` + ``next_by_subj``) until the server
    says nothing is pending (or, with ``up_to``, past that stream sequence: a stream
    written faster than it is read would otherwise never end), within ``timeout`` in
    all. The next page is asked for, and the request is at the server, before this one
    is handed over: the server reads it while the caller takes this one in (at most two
    pages held)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    asked: Asked | None = await ask(bus, stream, {"seq": start, "next_by_subj": subjects})
    try:
        while asked is not None:
            current, asked = asked, None  # read() unsubscribes it, whatever happens
            page = await read(current, max(deadline - loop.time(), 0.0))
            if page.pending and not (up_to and page.last_seq >= up_to):
                request = {"seq": page.last_seq + 1, "next_by_subj": subjects}
                asked = await ask(bus, stream, request)
                await bus.flush(max(deadline - loop.time(), 0.001))
                stop_if_cancelled()  # nats-py's flush may lose a Ctrl-C's cancel
            yield page.messages
    finally:
        if asked is not None:  # a caller that stopped early leaves no subscription behind
            await unsubscribe_quietly(asked.subscription)


async def last_of(bus: Bus, stream: str, subjects: list[str], timeout: float) -> list[Stored]:
    """The last message of each of ``subjects`` (exact subjects, or filters each matching
    few) that has one, by ``multi_last`` requests of PAGE_KEYS subjects each, at most
    IN_FLIGHT at once (each may answer PAGE_BYTES), within ``timeout`` in all."""
    found: list[Stored] = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    step = PAGE_KEYS * IN_FLIGHT
    for start in range(0, len(subjects), step):
        chunks = [
            subjects[at : at + PAGE_KEYS]
            for at in range(start, min(start + step, len(subjects)), PAGE_KEYS)
        ]
        asked: list[Asked] = []
        try:
            for chunk in chunks:
                asked.append(await ask(bus, stream, {"multi_last": chunk}))
            left = max(deadline - loop.time(), 0.0)
            for page in await asyncio.gather(*(read(one, left) for one in asked)):
                found += page.messages
        finally:
            for one in asked:
                await unsubscribe_quietly(one.subscription)
    return found
