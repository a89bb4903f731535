"""What answers at a NATS URL's port when no NATS server greets: a NATS server sends its
``INFO`` line as soon as a client connects, so a port that stays silent for a few round
trips (:func:`greeting_wait`) and then answers an HTTP request is an HTTP server (a
dashboard, nats-server's own monitoring port), and a port that greets with anything else
is some other service. Said at once, instead of a connect timeout's ``no server
answered`` seconds later.

A NATS server slower to greet than the wait is asked in HTTP too: it answers ``INFO``
all the same (the look says nothing then), and logs a parser error for the request."""

from __future__ import annotations

import asyncio
import contextlib
import time
from urllib.parse import urlsplit

GREETING_WAIT = (0.15, 0.5)
"""How long a NATS server may take to send INFO before the port is asked in HTTP: at
least the first, at most the second (seconds), :data:`ROUND_TRIPS` connects between."""
ROUND_TRIPS = 4
"""Connects' times a NATS server has to greet: its INFO comes about one round trip after
the connect returns."""
SNIFF_TIMEOUT = 2.0
"""The whole look, connect to close: a port that says nothing at all says nothing here."""
NATS_PORT = 4222


def greeting_wait(connect_seconds: float) -> float:
    """How long to wait for INFO after a connect that took ``connect_seconds``."""
    shortest, longest = GREETING_WAIT
    return min(longest, max(shortest, ROUND_TRIPS * connect_seconds))


def host_port(url: str) -> tuple[str, int]:
    """The host and port a NATS URL names (``nats://h`` is port 4222)."""
    parts = urlsplit(url if "://" in url else f"nats://{url}")
    return parts.hostname or "127.0.0.1", parts.port or NATS_PORT


async def not_nats(url: str) -> str | None:
    """Why the server at ``url`` is not a NATS server, if its first bytes say so; None for a
    NATS greeting, silence, or a port that cannot be reached otherwise (the connect says
    why). ConnectionRefusedError where nothing listens: said at once, where nats-py would
    try again until its deadline."""
    host, port = host_port(url)
    with contextlib.suppress(TimeoutError, ValueError):
        async with asyncio.timeout(SNIFF_TIMEOUT):
            started = time.monotonic()
            try:
                reader, writer = await asyncio.open_connection(host, port)
            except ConnectionRefusedError:
                raise
            except OSError:
                return None
            try:
                wait = greeting_wait(time.monotonic() - started)
                return await _judge(reader, writer, f"{host}:{port}", wait)
            except OSError:
                return None
            finally:
                writer.close()
    return None


async def _judge(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, where: str, wait: float
) -> str | None:
    first = b""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(wait):
            first = await reader.read(8)
    if first.startswith(b"INFO"):
        return None
    if not first:
        writer.write(f"GET / HTTP/1.0\r\nHost: {where}\r\n\r\n".encode())
        await writer.drain()
        first = await reader.read(8)
        if first.startswith(b"HTTP/"):
            return f"{where} answers HTTP: that is not a NATS port"
        return None
    if first.startswith(b"HTTP/"):
        return f"{where} answers HTTP: that is not a NATS port"
    return f"{where} is not a NATS server (it greets with {first[:8]!r})"
