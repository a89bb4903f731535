"""A URL that points at no NATS server is said at once and why: an HTTP port (a
dashboard, nats-server's monitoring port), another service, or nothing listening, each
in under a second (actors/runtime/sniff.py), and a real server still connects."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from actors.runtime import sniff
from actors.runtime.bus import NatsBus
from actors.runtime.connect_failures import BusError
from actors.runtime.embedded import NatsServer
from tests.support.ports import free_port

SAID_WITHIN = 1.0
"""How long a wrong URL may take to be reported (issue 45's start-up target)."""


@pytest.fixture
async def http_port() -> AsyncIterator[int]:
    """A plain aiohttp server's port, answering every path."""

    async def page(request: web.Request) -> web.Response:
        return web.Response(text="a dashboard")

    app = web.Application()
    app.router.add_get("/{tail:.*}", page)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    assert runner.addresses
    yield int(runner.addresses[0][1])
    await runner.cleanup()


async def refusal(url: str) -> tuple[str, float]:
    """The BusError's message of connecting to ``url``, and how long it took."""
    started = time.monotonic()
    with pytest.raises(BusError) as refused:
        await NatsBus.connect(url, "sniffed")
    return str(refused.value), time.monotonic() - started


async def test_an_http_port_is_named_as_one_within_a_second(http_port: int) -> None:
    """nats:// pointed at an HTTP server: it answers HTTP, said so within a second."""
    message, took = await refusal(f"nats://127.0.0.1:{http_port}")
    assert message == (
        f"cannot reach NATS at nats://127.0.0.1:{http_port}: "
        f"127.0.0.1:{http_port} answers HTTP: that is not a NATS port"
    )
    assert took < SAID_WITHIN, f"said after {took:.2f}s"


async def test_a_refused_port_is_said_within_a_second() -> None:
    """Nothing listening: connection refused within a second, not after the deadline."""
    port = free_port()
    message, took = await refusal(f"nats://127.0.0.1:{port}")
    assert message.endswith("connection refused (is nats-server running and the URL right?)")
    assert took < SAID_WITHIN, f"said after {took:.2f}s"


async def test_a_port_greeting_with_another_protocol_is_named() -> None:
    """A service that greets first with something else (an SSH banner) is named by its
    first bytes."""

    async def ssh(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"SSH-2.0-OpenSSH_9.2\r\n")
        await writer.drain()
        await reader.read()
        writer.close()

    server = await asyncio.start_server(ssh, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        message, took = await refusal(f"nats://127.0.0.1:{port}")
    finally:
        server.close()
    assert message.endswith(f"127.0.0.1:{port} is not a NATS server (it greets with b'SSH-2.0-')")
    assert took < SAID_WITHIN, f"said after {took:.2f}s"


def test_the_greeting_wait_follows_the_connects_round_trip() -> None:
    """A NATS server has a few connect times to greet: 0.15 s at least (loopback), 0.5 s
    at most (a far server)."""
    assert sniff.greeting_wait(0.0001) == 0.15
    assert sniff.greeting_wait(0.08) == pytest.approx(0.32)
    assert sniff.greeting_wait(1.0) == 0.5


async def test_a_nats_server_slow_to_greet_is_not_taken_for_http() -> None:
    """A server whose INFO comes after the greeting wait (and after the HTTP request the
    look then sends) is still no HTTP port: the look says nothing."""

    closed = asyncio.Event()

    async def slow_nats(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(0.3)  # slower than the loopback wait (0.15 s)
        writer.write(b'INFO {"server_id":"slow"}\r\n')
        await writer.drain()
        await reader.read()  # the look hangs up
        writer.close()
        await writer.wait_closed()
        closed.set()

    server = await asyncio.start_server(slow_nats, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        assert await sniff.not_nats(f"nats://127.0.0.1:{port}") is None
        await asyncio.wait_for(closed.wait(), timeout=10)
    finally:
        server.close()


async def test_a_nats_server_still_connects(nats_server: NatsServer) -> None:
    """The look beside the connect leaves a real server's connection alone."""
    bus = await NatsBus.connect(nats_server.url, "sniffed")
    try:
        assert bus.connected
        await bus.flush()
    finally:
        await bus.close()
