"""Serving a small aiohttp app for as long as an actor runs, and Prometheus pages."""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Final

from aiohttp import web
from aiohttp.typedefs import Handler as MiddlewareHandler
from aiohttp.web_protocol import RequestHandler
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from actors.runtime.supervisor import ActorStatus, FatalError, unhealthy

log = logging.getLogger(__name__)

CLEANUP_TIMEOUT = 5.0


@dataclass(frozen=True)
class HttpLimits:
    """What one client may hold of a local HTTP server. Every connection costs a file
    descriptor shared with the NATS connection and every other actor of the process, so
    connections are capped and each one lives only as long as one request may take: a
    client that sends nothing, or sends its headers or body slowly, is cut off."""

    max_connections: int = 256
    """Connections beyond this are answered 503 and closed at once."""
    request_timeout: float = 10.0
    """Seconds a connection has to send its request (headers and body) and be answered;
    then it is closed, answered or not. One request per connection (no keep-alive)."""
    max_request_bytes: int = 64 * 1024
    """Larger request bodies are refused with 413 before being read."""
    max_header_bytes: int = 8 * 1024
    """Longest request line and header field; longer ones are refused with 4xx."""
    header_timeout: float = 10.0
    """Seconds a connection has to send its request line and headers; then it is closed
    unanswered. Bounds a client that trickles its headers where ``request_timeout`` is long
    (the gateway's is an hour, for streamed answers)."""


REFUSAL: Final = (
    b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
)


class _Refused(asyncio.Protocol):
    """A connection over the limit: answered 503 and closed without being read."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.WriteTransport)
        transport.write(REFUSAL)
        transport.close()


STREAMING: set[RequestHandler] = set()
"""Connections answering a long-lived stream (server-sent events): exempt from the cut-off."""


@contextmanager
def kept_open(request: web.Request) -> Iterator[None]:
    """While in this context the answer to ``request`` is a stream that lasts (server-sent
    events): its connection is not cut off after ``request_timeout``. The handler bounds
    how many such streams it holds."""
    handler = request.protocol
    if not isinstance(handler, RequestHandler):
        yield
        return
    STREAMING.add(handler)
    try:
        yield
    finally:
        STREAMING.discard(handler)


def _cut_off(handler: RequestHandler, starting: set[RequestHandler]) -> None:
    """Close ``handler``'s connection if it is still open (no-op once closed), unless it
    answers a stream (:func:`keep_open`)."""
    starting.discard(handler)
    if handler.transport is not None and handler not in STREAMING:
        handler.force_close()


def _cut_off_unread(handler: RequestHandler, starting: set[RequestHandler]) -> None:
    """Close ``handler``'s connection if its request line and headers are not read yet."""
    # aiohttp counts a request once its headers are parsed; it has no header timeout.
    if handler._request_count == 0:
        _cut_off(handler, starting)


@asynccontextmanager
async def serving(
    app: web.Application,
    host: str,
    port: int,
    limits: HttpLimits = HttpLimits(),
    tls: ssl.SSLContext | None = None,
) -> AsyncIterator[int]:
    """Serve ``app`` on host:port (0 picks a free port) within ``limits``, over TLS with
    ``tls``, and yield the bound port (:class:`FatalError` if it cannot be bound); on the
    way out the server is shut down within ``CLEANUP_TIMEOUT``."""

    @web.middleware
    async def one_bounded_request(
        request: web.Request, handler: MiddlewareHandler
    ) -> web.StreamResponse:
        if request.content_length is not None and request.content_length > limits.max_request_bytes:
            raise web.HTTPRequestEntityTooLarge(
                max_size=limits.max_request_bytes, actual_size=request.content_length
            )
        response = await handler(request)
        response.force_close()
        return response

    app.middlewares.append(one_bounded_request)
    runner = web.AppRunner(
        app,
        access_log=None,
        shutdown_timeout=CLEANUP_TIMEOUT / 2,
        max_line_size=limits.max_header_bytes,
        max_field_size=limits.max_header_bytes,
    )
    await runner.setup()
    server = runner.server
    assert server is not None
    loop = asyncio.get_running_loop()

    # asyncio accepts a burst of connections before any of them is made (and counted in
    # server.connections), so handlers not yet connected are counted here until they are.
    starting: set[RequestHandler] = set()

    def accept() -> asyncio.BaseProtocol:
        starting.difference_update([h for h in starting if h.transport is not None])
        if len(server.connections) + len(starting) >= limits.max_connections:
            return _Refused()
        handler = server()
        starting.add(handler)
        # asyncio makes the connection (connection_made, which puts the handler in
        # server.connections) in the loop iteration after it calls this factory; the
        # handler is forgotten here one iteration later. Left to the cut-off timer, a
        # short request's handler stayed counted until request_timeout, so a server
        # refused everything after max_connections requests per request_timeout.
        loop.call_soon(loop.call_soon, starting.discard, handler)
        loop.call_later(limits.request_timeout, _cut_off, handler, starting)
        if limits.header_timeout < limits.request_timeout:
            loop.call_later(limits.header_timeout, _cut_off_unread, handler, starting)
        return handler

    listener: asyncio.Server | None = None
    try:
        try:
            listener = await loop.create_server(accept, host, port, reuse_address=True, ssl=tls)
        except OSError as exc:
            # A taken or forbidden port stays so: fatal, not a restart loop.
            # asyncio's message repeats the address; the errno's own words do not.
            reason = os.strerror(exc.errno).lower() if exc.errno else str(exc)
            raise FatalError(f"cannot serve HTTP on {host}:{port}: {reason}") from None
        bound = int(listener.sockets[0].getsockname()[1])
        log.info("http listening", extra={"host": host, "port": bound})
        yield bound
    finally:
        if listener is not None:
            listener.close()
        try:
            async with asyncio.timeout(CLEANUP_TIMEOUT):
                await runner.cleanup()
        except TimeoutError:
            log.warning("http server did not shut down in time")


def prometheus_page(registry: CollectorRegistry, extra: bytes = b"") -> web.Response:
    """``registry``'s series, then ``extra`` (whole families written elsewhere)."""
    response = web.Response(body=generate_latest(registry) + extra)
    # CONTENT_TYPE_LATEST carries a charset parameter, which aiohttp's content_type refuses.
    response.headers["Content-Type"] = CONTENT_TYPE_LATEST
    return response


def health_page(statuses: Mapping[str, ActorStatus]) -> web.Response:
    """``/healthz`` of the agent and the aggregator alike: 200 only while every actor runs
    without a problem; 503 naming each that does not (or when there are no actors yet)."""
    down = unhealthy(statuses)
    if not statuses or down:
        return web.json_response({"ok": False, "not_running": down}, status=503)
    return web.json_response({"ok": True})
