"""systemd notifications (actors/runtime/notify.py) against a fake notify socket: a unix
datagram socket the test binds and names in $NOTIFY_SOCKET, as systemd does."""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from actors.node.agent import NodeAgent
from actors.runtime import notify
from tests.support.fleet import Fleet


@pytest.fixture
def notify_socket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify"))
    sock.setblocking(False)
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "notify"))
    yield sock
    sock.close()


def test_notify_sends_one_datagram(notify_socket: socket.socket) -> None:
    assert notify.notify(notify.READY)
    assert notify_socket.recv(256) == b"READY=1"


def test_without_systemd_nothing_is_sent() -> None:
    assert not notify.notify(notify.READY, env={})


def test_a_refusing_socket_is_logged_not_raised(tmp_path: Path) -> None:
    assert not notify.notify(notify.READY, env={"NOTIFY_SOCKET": str(tmp_path / "gone")})


@pytest.mark.parametrize(
    ("env", "interval"),
    [
        ({"WATCHDOG_USEC": "30000000"}, 15.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())}, 15.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}, None),  # another process's
        ({}, None),
        ({"WATCHDOG_USEC": "0"}, None),
    ],
)
def test_watchdog_interval_is_half_of_systemds(env: dict[str, str], interval: float | None) -> None:
    assert notify.watchdog_interval(env) == interval


async def received(sock: socket.socket, timeout: float = 10.0) -> str:
    loop = asyncio.get_running_loop()
    return (await asyncio.wait_for(loop.sock_recv(sock, 256), timeout)).decode()


async def test_agent_is_ready_then_feeds_the_watchdog_then_stops(
    fleet: Fleet, notify_socket: socket.socket, monkeypatch: pytest.MonkeyPatch
) -> None:
    """READY=1 once every actor runs, WATCHDOG=1 while /healthz would be green, STOPPING=1."""
    monkeypatch.setenv("WATCHDOG_USEC", "200000")  # a ping every 0.1 s
    fleet.node_key()  # created
    agent = NodeAgent(fleet.config())
    stop = asyncio.Event()
    running = asyncio.create_task(agent.run_until(stop))
    try:
        assert await received(notify_socket) == "READY=1"
        assert agent.supervisor is not None and agent.supervisor.all_running
        assert [await received(notify_socket) for _ in range(3)] == ["WATCHDOG=1"] * 3
    finally:
        stop.set()
        await running
    assert await received(notify_socket) == "STOPPING=1"


async def test_an_unhealthy_agent_starves_the_watchdog(
    fleet: Fleet, notify_socket: socket.socket, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "200000")
    fleet.node_key()  # created
    agent = NodeAgent(fleet.config())
    stop = asyncio.Event()
    running = asyncio.create_task(agent.run_until(stop))
    try:
        assert await received(notify_socket) == "READY=1"
        assert agent.supervisor is not None
        agent.supervisor.status["latency"].phase = "backoff"  # as /healthz would show it
        await asyncio.sleep(0.3)
        while True:  # drain pings sent before
            try:
                notify_socket.recv(256)
            except BlockingIOError:
                break
        with pytest.raises(TimeoutError):
            await received(notify_socket, timeout=0.5)
    finally:
        stop.set()
        await running
