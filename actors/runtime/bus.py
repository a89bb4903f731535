"""The bus every actor talks through: a small Protocol, implemented over nats-py.

Actors see only :class:`Bus`; tests run them against a real nats-server. The NATS
connection reconnects forever with backoff; callers get timeouts, never hangs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import socket
import ssl
import struct
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

import msgspec
import nats
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.api import PubAck
from nats.js.kv import KeyValue

from actors.runtime import (
    connect_failures,
    nats_headers,  # noqa: F401  (installs the faster header parser)
)
from actors.runtime.connect_failures import BusError
from actors.runtime.schedule import Backoff
from schemas import codec
from schemas.errors import FleetError
from schemas.signing import KeyPair

log = logging.getLogger(__name__)

Handler = Callable[[Msg], Awaitable[None]]

# Bounded buffers: a subscriber that falls this far behind drops messages (counted by
# nats-py as slow-consumer errors, logged by our error callback) instead of growing memory.
PENDING_MSGS_LIMIT = 4096
PENDING_BYTES_LIMIT = 16 * 1024 * 1024
PUBLISH_TIMEOUT = 5.0
"""How long a JetStream publish waits for the stream's acknowledgement."""
DEFAULT_JS_API_PREFIX = "$JS.API"
CONNECT_BACKOFF_INITIAL = 0.5
CONNECT_BACKOFF_MAX = 15.0
"""A first connection retried forever waits 0.5 s, doubling up to 15 s, between tries."""
SERVER_TIMEOUT = 2
"""Each step of one server's handshake (the TCP connect, its INFO, the TLS upgrade, the
first PONG) waits this long at most (nats.go's and nats-py's default), however long the
whole connection may take: a server frozen with its socket open holds a reconnect this
long before the next of the list is tried. At 5 s, a node leaving a server whose
JetStream had stopped answering landed on the frozen one and was called stale 40 ms
before it got through (a CI fault round)."""
PING_INTERVAL = 2.0
PINGS_MISSED = 2
"""Every connection to a cluster sends a PING every PING_INTERVAL seconds and waits as long
for its PONG; after PINGS_MISSED unanswered in a row (4 to 8 s: the server frozen, or the
link cut) it leaves that server for the next of its list. nats-py's own PINGs (every 2
minutes) would notice after minutes, and then wait up to 30 s more on the dead server
for TLS to close: leaving here drops the connection at once."""
MOVE_AFTER = 2.0
"""Seconds of JetStream calls timing out through one server, with none answered between
(and at least two failures), after which the connection moves to another server of its
list: a server that answers PINGs but has lost its quorum (cut off from the rest of
its cluster) answers no JetStream call, and nats-py never leaves it on its own."""
MOVE_BACKOFF_INITIAL = 10.0
MOVE_BACKOFF_MAX = 60.0
"""Once a connection has tried every server of its list without an answer, the move back
to the first waits this long (doubling while JetStream keeps failing): while the whole
cluster elects a leader, moving helps nobody, and a fleet moving at once is a
reconnection storm. The servers not yet tried are tried at once (after MOVE_AFTER on
each): the next of the list may be the one cut off from the cluster, and waiting there
for the backoff leaves a live node silent past its ``stale_after``."""


def move_backoff(stale_after: float) -> float:
    """A node's first wait before going round its server list again: a quarter of its
    ``stale_after`` (at most :data:`MOVE_BACKOFF_INITIAL`). Seed 7's g2 left both servers
    electing a leader, landed on the one cut off from them, and waited there 10.8 s past
    its 5 s ``stale_after``; at the default 30 s the wait stays 7.5 s."""
    return min(MOVE_BACKOFF_INITIAL, stale_after / 4)


class NotProvisioned(FleetError):
    """A stream or bucket of the wire contract does not exist yet on this server."""

    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(
            f"{name} does not exist on this server; start an aggregator "
            "(fleetctl aggregator), which creates the fleet's streams and buckets"
        )


class Bus(Protocol):
    """What actors need from the messaging layer."""

    @property
    def js(self) -> JetStreamContext: ...

    @property
    def js_api_prefix(self) -> str:
        """Where this connection reaches the JetStream API (``$JS.API`` by default)."""
        ...

    async def publish(
        self, subject: str, data: bytes, headers: dict[str, str] | None = None, reply: str = ""
    ) -> None: ...

    def new_inbox(self) -> str: ...

    async def subscribe(self, subject: str, handler: Handler, queue: str = "") -> Subscription: ...

    async def request(
        self, subject: str, data: bytes, timeout: float, headers: dict[str, str] | None = None
    ) -> Msg: ...

    async def flush(self, timeout: float = 2.0) -> None: ...

    async def rtt(self, timeout: float = 2.0) -> float: ...

    async def kv(self, bucket: str) -> KeyValue: ...

    @property
    def connected(self) -> bool: ...

    @property
    def reconnected_at(self) -> float | None:
        """Monotonic time the connection was last regained after a loss (None: never
        lost): what a consumer of the node's own events judges their age from, since
        none could come while the bus was down."""
        ...

    def on_reconnect(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` each time the connection is regained (once per callback)."""
        ...

    def jetstream_answered(self, answered: bool) -> None:
        """Say whether a JetStream call made at a steady pace (a heartbeat, a lease
        renewal) was answered; calls that time out for :data:`MOVE_AFTER` seconds move
        the connection to another server."""
        ...


RESET = struct.pack("ii", 1, 0)
"""``SO_LINGER`` on, for 0 seconds: a close sends a reset and drops what is unsent."""


def reset_on_close(transport: asyncio.BaseTransport) -> None:
    """Make closing ``transport``'s socket a reset (``SO_LINGER`` 0). A plain close keeps
    the bytes the kernel had not yet delivered and goes on sending them: to a server cut
    off, for as long as TCP retries (minutes), so a node's heartbeat published before the
    cut reached the cluster after the newer ones it sent through another server, and read
    as a replay. Reset, they are dropped: a heartbeat is sent anew at the next interval,
    and a publish that waits for JetStream's acknowledgement gets none and fails, as it
    would have."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, RESET)


class NatsBus:
    """:class:`Bus` over one nats-py connection."""

    def __init__(
        self,
        nc: Client,
        server: str,
        events: _ConnectionEvents,
        js_api_prefix: str,
        move_backoff: float = MOVE_BACKOFF_INITIAL,
    ) -> None:
        self.nc = nc
        self.server = server
        self._events = events
        self.js_api_prefix = js_api_prefix
        self._js = nc.jetstream(timeout=5.0, prefix=js_api_prefix)
        self._buckets: dict[str, KeyValue] = {}
        self._failing_since: float | None = None
        self._failures = 0
        self._next_move = 0.0
        self._moves = 0
        """Moves since JetStream last answered: the round of the list they have made."""
        self._move_backoff = Backoff(move_backoff, MOVE_BACKOFF_MAX)
        self._watching: asyncio.Task[None] | None = None
        self._leaving: asyncio.Task[None] | None = None

    @classmethod
    async def connect(
        cls,
        server: str,
        name: str,
        *,
        nkey_seed: str | None = None,
        connect_timeout: float = 5.0,
        retry_forever: bool = False,
        inbox_prefix: str = "_INBOX",
        js_api_prefix: str = DEFAULT_JS_API_PREFIX,
        tls: ssl.SSLContext | None = None,
        move_backoff: float = MOVE_BACKOFF_INITIAL,
    ) -> NatsBus:
        """Connect; with ``retry_forever`` the first connection is retried with backoff too.
        ``move_backoff``: the first wait before going round the server list again once
        every server failed JetStream (see :data:`MOVE_BACKOFF_INITIAL`); an agent passes
        a quarter of its ``stale_after``, so it is back on a server that reaches the
        cluster's quorum before it would be called stale.
        ``js_api_prefix`` is where JetStream's API answers: another prefix when an account
        imports it from another (deploy/nats/auth.conf). ``tls`` (from
        :func:`actors.runtime.tls.client_context`) is used for ``tls://`` URLs and for
        ``nats://`` servers that require TLS."""
        connect_failures.check_urls(server)
        wants_tls = tls is not None or any(url.startswith("tls://") for url in server.split(","))
        # Shuffled here, not by nats-py: its reconnects then go round the list in order,
        # so leaving a server (a move, a lost connection) never picks the same one again.
        urls = server.split(",")
        random.shuffle(urls)
        backoff = Backoff(CONNECT_BACKOFF_INITIAL, CONNECT_BACKOFF_MAX)
        while True:
            nc = Client()
            events = _ConnectionEvents(server)
            try:
                # nats-py retries an unreachable server forever by itself (we ask it to,
                # for reconnects); the deadline turns that into a clear answer.
                async with asyncio.timeout(connect_timeout):
                    await connect_failures.unless_not_nats(
                        server,
                        nc.connect(
                            servers=urls,
                            name=name,
                            connect_timeout=max(1, min(round(connect_timeout), SERVER_TIMEOUT)),
                            allow_reconnect=True,
                            max_reconnect_attempts=-1,
                            reconnect_time_wait=2,
                            dont_randomize=True,
                            nkeys_seed_str=nkey_seed,
                            inbox_prefix=inbox_prefix,
                            tls=tls,
                            error_cb=events.error,
                            disconnected_cb=events.disconnected,
                            reconnected_cb=events.reconnected,
                        ),
                    )
                # nats-py upgrades only when the server says tls_required, so a tls:// URL
                # to a plaintext server would silently stay plaintext.
                if wants_tls and not nc._server_info.get("tls_required"):
                    raise ConnectionError(connect_failures.TLS_NOT_OFFERED)
                events.up = True
                bus = cls(nc, server, events, js_api_prefix, move_backoff)
                bus._watching = asyncio.create_task(bus._watch(), name="nats-watch")
                return bus
            except asyncio.CancelledError:
                await nc.close()
                raise
            except Exception as exc:
                await nc.close()
                # The deadline's TimeoutError hides why each try failed; the error callback
                # saw it (a refused certificate, a hostname mismatch, ...).
                cause = events.cause if isinstance(exc, TimeoutError) and events.cause else exc
                reason = connect_failures.reason(cause, tls)
                if not retry_forever:
                    raise BusError(server, reason) from None
                delay = backoff.next()
                log.warning(
                    "nats connect failed; retrying",
                    extra={"server": server, "reason": reason, "retry_in_s": round(delay, 1)},
                )
                await asyncio.sleep(delay)

    @property
    def js(self) -> JetStreamContext:
        return self._js

    @property
    def connected(self) -> bool:
        return bool(self.nc.is_connected)

    @property
    def reconnected_at(self) -> float | None:
        return self._events.back_at

    def on_reconnect(self, callback: Callable[[], None]) -> None:
        self._events.listeners.add(callback)

    def jetstream_answered(self, answered: bool) -> None:
        now = time.monotonic()
        if answered:
            # The backoff holds moves back while JetStream keeps failing; once it answers,
            # the next failure (another fault) may move at once.
            self._failing_since, self._failures, self._next_move = None, 0, 0.0
            self._moves = 0
            self._move_backoff.reset()
            return
        if self._failing_since is None:
            self._failing_since = now
        self._failures += 1
        if (
            self._failures >= 2
            and now - self._failing_since >= MOVE_AFTER
            and now >= self._next_move
            and len(self.nc.servers) > 1
        ):
            self._failing_since, self._failures = None, 0
            self._moves += 1
            # Every server tried once this round: the next move would go back to the
            # first, so it waits; until then the next server is tried at once.
            round_done = self._moves % len(self.nc.servers) == len(self.nc.servers) - 1
            self._next_move = now + self._move_backoff.next() if round_done else 0.0
            self._leave("JetStream not answering through this server")

    def _leave(self, why: str) -> None:
        """Drop the connection to the current server at once, without the TLS goodbye a
        frozen server would never answer (asyncio waits 30 s for it); nats-py sees the
        connection gone and reconnects to the next server of the list. The socket is
        reset (:func:`reset_on_close`): what the kernel still held for the server left is
        dropped, not delivered after what goes to the next one."""
        if not self.nc.is_connected:
            return
        current = self.nc.connected_url
        log.warning(
            f"{why}; leaving it for another", extra={"server": current.netloc if current else ""}
        )
        writer = getattr(self.nc._transport, "_io_writer", None)
        if writer is not None:
            reset_on_close(writer.transport)
            writer.transport.abort()
        else:  # a websocket: no socket of its own to drop, so nats-py's own way
            self._leaving = asyncio.create_task(self.nc.force_reconnect(), name="nats-leave")

    async def _watch(self) -> None:
        """PING the server every PING_INTERVAL, waiting as long for each PONG; leave it
        after PINGS_MISSED in a row go unanswered (a server frozen, or cut off). Only
        while the list (with the servers the cluster announced) has another server."""
        missed = 0
        while True:
            await asyncio.sleep(PING_INTERVAL)
            if not self.nc.is_connected or len(self.nc.servers) < 2:
                missed = 0  # with one server there is nowhere to go: nats-py's own PINGs
                continue
            try:
                await self._round_trip(PING_INTERVAL)
                missed = 0
            except (nats.errors.Error, TimeoutError):
                missed += 1
                if missed >= PINGS_MISSED:
                    missed = 0
                    self._leave("the server answers no PING")

    async def publish(
        self, subject: str, data: bytes, headers: dict[str, str] | None = None, reply: str = ""
    ) -> None:
        await self.nc.publish(subject, data, reply=reply, headers=headers)

    def new_inbox(self) -> str:
        """A fresh reply subject under this connection's inbox prefix (for a request answered
        by several messages, which ``request`` cannot wait for)."""
        return self.nc.new_inbox()

    async def subscribe(self, subject: str, handler: Handler, queue: str = "") -> Subscription:
        return await self.nc.subscribe(
            subject,
            queue=queue,
            cb=handler,
            pending_msgs_limit=PENDING_MSGS_LIMIT,
            pending_bytes_limit=PENDING_BYTES_LIMIT,
        )

    async def request(
        self, subject: str, data: bytes, timeout: float, headers: dict[str, str] | None = None
    ) -> Msg:
        return await self.nc.request(subject, data, timeout=timeout, headers=headers)

    async def flush(self, timeout: float = 2.0) -> None:
        """Return once the server has processed everything sent before this call.

        nats-py 2.16's ``flush()`` writes its PING straight to the socket while earlier
        SUB and PUB commands may still wait in its pending buffer, so the PONG can come
        back before the server has seen them (a subscriber then misses the first
        messages; measured: 62 in 1500 subscribe-then-publish rounds). Pushing the
        pending buffer out first restores the order the NATS protocol promises."""
        async with asyncio.timeout(timeout):
            await self.nc._flush_pending(force_flush=True)
        await self._round_trip(timeout)

    async def rtt(self, timeout: float = 2.0) -> float:
        """Round trip to the server in seconds (a PING/PONG flush)."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        await self._round_trip(timeout)
        return loop.time() - start

    async def _round_trip(self, timeout: float) -> None:
        """One PING, answered by its PONG within ``timeout``.

        nats-py 2.16's ``flush()`` and ``rtt()`` cancel the PONG's future when they time
        out or are cancelled (an actor stopping mid-flush), yet leave it queued: the PONG
        that comes later then raises InvalidStateError in nats-py's reader, which ends
        the reader, and with it every subscription and request of the connection (seen:
        an aggregator whose lease was fenced never read a message again). Here the
        future is shielded: it stays pending until its PONG arrives; only the wait for it
        is bounded or cancelled."""
        nc = self.nc
        if nc.is_closed:
            raise nats.errors.ConnectionClosedError
        if nc._reading_task is None or nc._reading_task.done():
            await nc._flush_pending()  # no reader to see a PONG (as nats-py's own flush)
            return
        pong: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        await nc._send_ping(pong)
        try:
            async with asyncio.timeout(timeout):
                await asyncio.shield(pong)
        except TimeoutError:
            raise nats.errors.FlushTimeoutError from None

    async def kv(self, bucket: str) -> KeyValue:
        cached = self._buckets.get(bucket)
        if cached is None:
            try:
                cached = self._buckets[bucket] = await self._js.key_value(bucket)
            except nats.js.errors.BucketNotFoundError:
                raise NotProvisioned(bucket) from None
        return cached

    async def close(self, timeout: float = 5.0) -> None:
        """Drain (deliver what is buffered, then close), bounded by ``timeout``. A
        connection the server has gone from (stopped, restarting) is closed all the same:
        nats-py's flush of its socket then raises ConnectionResetError, which is no news.
        The close after a failed drain is bounded by ``timeout`` too (one reconnecting on
        a starved machine once hung there past a test's two minutes)."""
        if self._watching is not None:
            self._watching.cancel()
        if self.nc.is_closed:
            return
        self._events.up = False
        try:
            async with asyncio.timeout(timeout):
                await self.nc.drain()
        except (TimeoutError, nats.errors.Error, OSError) as exc:
            log.warning(
                "nats drain did not finish; closing", extra={"reason": connect_failures.reason(exc)}
            )
            try:
                async with asyncio.timeout(timeout):
                    await self.nc.close()
            except OSError:
                pass  # the socket was gone already: closed is what it is
            except TimeoutError:
                log.warning("nats close did not finish; left to the process's end")


def bus_fault(exc: BaseException) -> bool:
    """Whether ``exc`` is the bus failing (a timeout, no server, no responders, a closed
    connection), not a defect: what a fault of the cluster makes any actor see, logged as
    what it is, without a traceback. A group (a TaskGroup's) is one if all it holds are."""
    if isinstance(exc, BaseExceptionGroup):
        return all(bus_fault(inner) for inner in exc.exceptions)
    return unanswered(exc) or isinstance(
        exc,
        nats.errors.ConnectionClosedError
        | nats.errors.NoServersError
        | nats.errors.StaleConnectionError
        | nats.errors.OutboundBufferLimitError
        | nats.js.errors.ServiceUnavailableError,
    )


def unanswered(exc: BaseException) -> bool:
    """Whether a JetStream call failed for want of an answer (a timeout, no responders),
    not with one: what :meth:`Bus.jetstream_answered` is told."""
    return isinstance(
        exc,
        TimeoutError
        | nats.errors.TimeoutError
        | nats.errors.NoRespondersError
        | nats.js.errors.NoStreamResponseError,
    )


async def publish_signed(
    bus: Bus,
    subject: str,
    message: msgspec.Struct,
    key: KeyPair,
    msg_id: str,
    *,
    headers: dict[str, str] | None = None,
    tag: Callable[[str, bytes], dict[str, str]] | None = None,
    timeout: float = PUBLISH_TIMEOUT,
) -> tuple[PubAck, int]:
    """Store ``message`` in JetStream signed by ``key``, under ``Nats-Msg-Id: msg_id`` (the
    stream drops a repeat), plus ``headers`` and those ``tag`` makes of the subject and the
    body; the stream's acknowledgement and the body's size in bytes. Raises
    nats.errors.Error or TimeoutError."""
    body = codec.encode(message)
    signed = key.headers(body)
    signed["Nats-Msg-Id"] = msg_id
    signed.update(headers or {})
    signed.update(tag(subject, body) if tag is not None else {})
    ack = await bus.js.publish(subject, body, timeout=timeout, headers=signed)
    return ack, len(body)


async def publish_signed_event(
    bus: Bus, subject: str, message: msgspec.Struct, key: KeyPair
) -> None:
    """Publish ``message`` on core NATS signed by ``key`` (``Fleet-Key``/``Fleet-Sig``), so
    its consumers can refuse what the node did not say; raises nats.errors.Error."""
    body = codec.encode(message)
    await bus.publish(subject, body, headers=key.headers(body))


class _ConnectionEvents:
    """Logs losing and regaining an established connection (not failed first attempts,
    nor our own close)."""

    def __init__(self, server: str) -> None:
        self.server = server
        self.up = False
        self.cause: Exception | None = None
        """The most telling error of the tries so far: a TLS error is kept over the reset
        or EOF that follows it, which says nothing of why."""
        self.back_at: float | None = None
        """Monotonic time of the last reconnect."""
        self.listeners: set[Callable[[], None]] = set()

    async def error(self, exc: Exception) -> None:
        if isinstance(exc, nats.errors.SlowConsumerError):
            log.warning("slow consumer: messages dropped", extra={"subject": exc.subject})
            return
        if isinstance(exc, ssl.SSLError) or not isinstance(self.cause, ssl.SSLError):
            self.cause = exc
        log.debug("nats error", extra={"reason": connect_failures.reason(exc)})

    async def disconnected(self) -> None:
        if self.up:
            log.warning("disconnected from nats; reconnecting", extra={"server": self.server})

    async def reconnected(self) -> None:
        self.back_at = time.monotonic()
        log.info("reconnected to nats", extra={"server": self.server})
        for listener in list(self.listeners):
            listener()
