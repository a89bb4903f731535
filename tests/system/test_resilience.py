"""Network loss: an agent started before its server, and a server that crashes and comes
back, need no hand-holding."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from actors.fleet.storage.registry import approve
from actors.fleet.storage.streams import provision
from actors.node.agent import NodeAgent
from actors.runtime.bus import NatsBus
from actors.runtime.embedded import NatsServer
from schemas import signing
from schemas.subjects import Subjects
from tests.support.fleet import (
    TEST_LIMITS,
    agent_config,
    start_aggregator,
    wait_for,
    wait_record,
)
from tests.support.ports import free_port


def logged(caplog: pytest.LogCaptureFixture, message: str) -> int:
    """How many times the bus logged ``message`` so far."""
    return sum(1 for r in caplog.records if r.name == "actors.runtime.bus" and r.msg == message)


async def test_agent_waits_for_its_server_and_survives_a_server_crash(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An agent started while no server listens keeps retrying and beats once one is up;
    after the server is SIGKILLed and restarted on the same store, heartbeats resume."""
    caplog.set_level(logging.INFO, logger="actors.runtime.bus")
    port = free_port()
    server = NatsServer(tmp_path / "nats", port=port)
    config = agent_config(
        f"nats://127.0.0.1:{port}", "res", tmp_path / "state", connect_timeout=1.0
    )
    key = signing.load_or_create_key_file(config.key_path)
    agent = NodeAgent(config)
    starting = asyncio.create_task(agent.start())
    await wait_for(lambda: logged(caplog, "nats connect failed; retrying") >= 2)
    assert not starting.done(), "the agent gives up on an absent server"

    await asyncio.to_thread(server.start)
    bus = await NatsBus.connect(server.url, "test")
    subjects = Subjects("res")
    await provision(bus.js, subjects, limits=TEST_LIMITS)
    await approve(bus, subjects, "n1", key.public_key)
    aggregator = await start_aggregator(bus, "res")
    try:
        await asyncio.wait_for(starting, 15)
        before = await wait_record(bus, "res", "n1", lambda r: r.state == "active")

        await aggregator.stop()
        await bus.close()
        lost = logged(caplog, "disconnected from nats; reconnecting")
        server.kill()
        await wait_for(lambda: logged(caplog, "disconnected from nats; reconnecting") > lost)
        await asyncio.to_thread(server.start)
        bus = await NatsBus.connect(server.url, "test")
        aggregator = await start_aggregator(bus, "res")
        after = await wait_record(bus, "res", "n1", lambda r: r.last_seq > before.last_seq + 2)
        assert after.boot_id == before.boot_id, "the agent itself never restarted"
        # Probes missed during the outage may count against health for a few samples.
        await wait_record(bus, "res", "n1", lambda r: r.state == "active")
    finally:
        await agent.stop()
        await aggregator.stop()
        await bus.close()
        server.stop()
