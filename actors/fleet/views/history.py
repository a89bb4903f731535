"""A node's history as the streams keep it: alerts (``FLEET_ALERTS``, which include every
state change of its record) and command results (``FLEET_EVENTS``); and which alerts a
view shows when it has room for a few (:func:`ranked`, :class:`AlertFeed`): info alerts
never push a warning or critical one out.

Reads are bounded and leave nothing behind: each uses an ephemeral consumer that is
deleted when the read ends (and that the server would drop by itself after
``INACTIVE_THRESHOLD`` if this process died first), and keeps at most ``limit`` entries.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import heapq
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass

import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from actors.runtime.bus import Bus, NotProvisioned
from actors.runtime.subscriptions import unsubscribe_quietly
from schemas import codec
from schemas.errors import DecodeError
from schemas.messages import Alert, CommandResult
from schemas.subjects import STREAM_ALERTS, STREAM_EVENTS, Subjects, check_token

ALERTS_READ = 500
"""Alerts of one node read to choose its recent ones from (:func:`recent_history`)."""
INACTIVE_THRESHOLD = 30.0
"""Seconds after which the server removes a consumer this process could not delete."""
BATCH = 256
FETCH_TIMEOUT = 5.0


@dataclass(frozen=True)
class Entry:
    """One stored message: an alert or a command result, when it was stored (server clock)
    and its subject; ``message`` is None when the body could not be decoded."""

    ts: float
    subject: str
    message: Alert | CommandResult | None
    body: bytes


def alert_subject(subjects: Subjects, node: str) -> str:
    """Every alert about ``node``, in any cluster (node ids are unique in the fleet)."""
    return f"{subjects.prefix}.alert.*.*.{check_token('node id', node)}"


def result_subject(subjects: Subjects, node: str) -> str:
    return f"{subjects.prefix}.result.*.{check_token('node id', node)}"


def _config(since: float | None) -> ConsumerConfig:
    if since is None:
        return ConsumerConfig(
            deliver_policy=DeliverPolicy.ALL,
            ack_policy=AckPolicy.NONE,
            inactive_threshold=INACTIVE_THRESHOLD,
            mem_storage=True,
        )
    return ConsumerConfig(
        deliver_policy=DeliverPolicy.BY_START_TIME,
        opt_start_time=datetime.datetime.fromtimestamp(since, datetime.UTC),
        ack_policy=AckPolicy.NONE,
        inactive_threshold=INACTIVE_THRESHOLD,
        mem_storage=True,
    )


def _entry(msg: Msg, kind: type[Alert] | type[CommandResult]) -> Entry:
    stored = msg.metadata.timestamp.timestamp() if msg.metadata.timestamp else time.time()
    return _decoded(msg.subject, msg.data, kind, stored)


def _decoded(
    subject: str, body: bytes, kind: type[Alert] | type[CommandResult], ts: float
) -> Entry:
    message: Alert | CommandResult | None
    try:
        message = codec.decode(body, kind)
    except DecodeError:
        message = None
    return Entry(ts=ts, subject=subject, message=message, body=body)


async def _stream_name(bus: Bus, name: str) -> str:
    try:
        await bus.js.stream_info(name)
    except nats.js.errors.NotFoundError:
        raise NotProvisioned(name) from None
    return name


async def read(
    bus: Bus,
    stream: str,
    subject: str,
    kind: type[Alert] | type[CommandResult],
    since: float | None = None,
    limit: int | None = None,
) -> list[Entry]:
    """The messages of ``stream`` on ``subject`` stored since ``since`` (all when None),
    oldest first, at most the last ``limit``; stops at the message that was last when the
    read began, so a busy stream cannot keep it going."""
    await _stream_name(bus, stream)
    found: deque[Entry] = deque(maxlen=limit)
    sub = await bus.js.pull_subscribe(subject, stream=stream, config=_config(since))
    try:
        info = await sub.consumer_info()
        pending = info.num_pending or 0
        while pending > 0:
            try:
                batch = await sub.fetch(min(BATCH, pending), timeout=FETCH_TIMEOUT)
            except nats.errors.TimeoutError:
                break  # what was pending has been removed since (per-subject caps, age)
            for msg in batch:
                found.append(_entry(msg, kind))
                pending = msg.metadata.num_pending
    finally:
        await _delete(bus, sub, stream)
    return list(found)


async def _delete(
    bus: Bus,
    sub: JetStreamContext.PullSubscription | JetStreamContext.PushSubscription,
    stream: str,
) -> None:
    """Unsubscribe and delete the consumer; one already gone is no error."""
    with contextlib.suppress(nats.errors.Error, TimeoutError):
        name = (await sub.consumer_info()).name
        await unsubscribe_quietly(sub)
        await bus.js.delete_consumer(stream, name)


async def node_history(
    bus: Bus, subjects: Subjects, node: str, since: float | None = None, limit: int | None = None
) -> tuple[list[Entry], list[Entry]]:
    """(alerts, command results) of ``node``, each oldest first and at most ``limit``."""
    alerts, results = await asyncio.gather(
        read(
            bus,
            subjects.stream_name(STREAM_ALERTS),
            alert_subject(subjects, node),
            Alert,
            since,
            limit,
        ),
        read(
            bus,
            subjects.stream_name(STREAM_EVENTS),
            result_subject(subjects, node),
            CommandResult,
            since,
            limit,
        ),
    )
    return alerts, results


async def recent_history(
    bus: Bus, subjects: Subjects, node: str, limit: int
) -> tuple[list[Entry], list[Entry]]:
    """(alerts, command results) a view of ``node`` shows, oldest first: the last
    ``limit`` results, and ``limit`` alerts :func:`ranked` among its last ALERTS_READ."""
    alerts, results = await node_history(bus, subjects, node, limit=ALERTS_READ)
    return ranked(alerts, limit), results[-limit:]


def is_info(entry: Entry) -> bool:
    """An alert of ``info`` severity (an undecodable one is not: it is shown)."""
    return isinstance(entry.message, Alert) and entry.message.severity == "info"


def ranked(alerts: list[Entry], limit: int) -> list[Entry]:
    """The ``limit`` alerts to show of ``alerts`` (oldest first): the newest warning and
    critical ones, then the newest info ones in the room left, in time order. A flood of
    info alerts (a policy's would-be actions, releases) never pushes a node's warning or
    critical alert out of a view."""
    serious = [entry for entry in alerts if not is_info(entry)][-limit:]
    room = limit - len(serious)
    info = [entry for entry in alerts if is_info(entry)][-room:] if room > 0 else []
    return sorted([*serious, *info], key=lambda entry: entry.ts)


class AlertFeed:
    """The latest alerts with their sequence numbers, at most ``size`` info ones and
    ``size`` warning or critical ones (each kept apart, so an info flood never pushes a
    warning out), iterated in sequence order."""

    def __init__(self, size: int) -> None:
        self.info: deque[tuple[int, Alert]] = deque(maxlen=size)
        self.serious: deque[tuple[int, Alert]] = deque(maxlen=size)

    def append(self, item: tuple[int, Alert]) -> None:
        (self.info if item[1].severity == "info" else self.serious).append(item)

    def __iter__(self) -> Iterator[tuple[int, Alert]]:
        return heapq.merge(self.info, self.serious, key=lambda item: item[0])

    def __reversed__(self) -> Iterator[tuple[int, Alert]]:
        return iter(sorted(self, key=lambda item: -item[0]))

    def __len__(self) -> int:
        return len(self.info) + len(self.serious)


def merged(*histories: list[Entry]) -> list[Entry]:
    """Entries of several streams in one list, oldest first (by stored time)."""
    return sorted((entry for history in histories for entry in history), key=lambda e: e.ts)


@contextlib.asynccontextmanager
async def following_alerts(
    bus: Bus, subjects: Subjects, since: float, handler: Callable[[Entry], Awaitable[None]]
) -> AsyncIterator[None]:
    """Hand every alert stored since ``since`` to ``handler``, then each new one as it is
    stored, in stream order (an ordered consumer), until the context is left; the
    consumer is deleted then."""
    stream = await _stream_name(bus, subjects.stream_name(STREAM_ALERTS))

    async def deliver(msg: Msg) -> None:
        await handler(_entry(msg, Alert))

    sub = await bus.js.subscribe(
        subjects.alerts(),
        stream=stream,
        cb=deliver,
        ordered_consumer=True,
        deliver_policy=DeliverPolicy.BY_START_TIME,
        config=ConsumerConfig(
            opt_start_time=datetime.datetime.fromtimestamp(since, datetime.UTC),
            inactive_threshold=INACTIVE_THRESHOLD,
        ),
    )
    try:
        yield
    finally:
        await _delete(bus, sub, stream)


def live_entry(msg: Msg, kind: type[Alert] | type[CommandResult]) -> Entry:
    """An entry for a message seen on core NATS, which has no stored time: timed by its
    own ``ts``, or now when it cannot be read."""
    entry = _decoded(msg.subject, msg.data, kind, time.time())
    if entry.message is None:
        return entry
    return Entry(ts=entry.message.ts, subject=msg.subject, message=entry.message, body=msg.data)
