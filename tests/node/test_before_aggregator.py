"""An agent started before any aggregator has created the fleet's streams waits quietly:
no actor crashes, one log line per waiting actor, and it joins once an aggregator comes."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from actors.fleet.storage.registry import approve
from actors.node.agent import NodeAgent
from actors.node.commands.actor import CommandsActor
from actors.runtime.bus import NatsBus
from actors.runtime.embedded import NatsServer
from actors.runtime.supervisor import Supervisor
from schemas import signing
from schemas.subjects import Subjects
from tests.support.fleet import agent_config, start_aggregator, wait_for, wait_record


@pytest.fixture
async def bare(nats_server: NatsServer) -> AsyncIterator[NatsBus]:
    """A connection to a server where this test's prefix has no stream yet."""
    bus = await NatsBus.connect(nats_server.url, "test-bare")
    yield bus
    await bus.close()


@pytest.fixture
async def early_agent(
    nats_server: NatsServer, prefix: str, state_dir: Path
) -> AsyncIterator[NodeAgent]:
    """Agent n1, started before anything created the prefix's streams."""
    config = agent_config(nats_server.url, prefix, state_dir, heartbeat_interval=0.2)
    signing.load_or_create_key_file(config.key_path)
    agent = NodeAgent(config)
    await agent.start()
    yield agent
    await agent.stop()


@pytest.fixture
async def aggregator(bare: NatsBus, prefix: str) -> AsyncIterator[list[Supervisor]]:
    """Aggregators a test starts, stopped when it ends."""
    started: list[Supervisor] = []
    yield started
    for supervisor in started:
        await supervisor.stop()


@pytest.mark.slow
async def test_an_agent_waits_quietly_for_the_streams(
    early_agent: NodeAgent,
    bare: NatsBus,
    prefix: str,
    aggregator: list[Supervisor],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Before the streams exist: every actor runs (none restarted), the command actor says
    once that it waits for FLEET_CMD and the heartbeat actor once that no stream answers,
    whatever the number of tries; an aggregator started then makes the node active."""
    caplog.set_level(logging.INFO)
    agent = early_agent
    assert agent.supervisor is not None and await agent.supervisor.wait_ready(10)
    commands = next(a for a in agent.supervisor.actors if isinstance(a, CommandsActor))
    # Beats refused again (each publish waits out its timeout on this server), and the
    # consumer tried again meanwhile after its first backoffs (1 s, 2 s, 4 s).
    await wait_for(lambda: agent.metrics.heartbeat_failures._value.get() >= 2)
    assert "does not exist yet" in commands.problem()
    assert all(status.restarts == 0 for status in agent.supervisor.check().values())
    logged = caplog.get_records("setup") + caplog.records
    warnings = [r for r in logged if r.levelno >= logging.WARNING]
    assert not [r for r in warnings if "crashed" in r.getMessage() or r.exc_info]
    waiting = [r for r in warnings if r.getMessage().startswith("stream does not exist yet")]
    refused = [r for r in warnings if r.getMessage().startswith("heartbeat not acknowledged")]
    assert len(waiting) == 1 and len(refused) == 1, [r.getMessage() for r in warnings]
    assert "has an aggregator created the fleet's streams?" in refused[0].getMessage()
    assert refused[0].seq == 1  # type: ignore[attr-defined]  # the first beat, never again

    aggregator.append(await start_aggregator(bare, prefix))
    key = signing.load_key_file(agent.config.key_path)
    await approve(bare, Subjects(prefix), "n1", key.public_key)
    await wait_record(bare, prefix, "n1", lambda r: r.state == "active", 20)
    await wait_for(lambda: commands.problem() == "")
    assert any(r.getMessage() == "heartbeats acknowledged again" for r in caplog.records)
    # Its first creation, after the wait: not "again".
    opened = [r.getMessage() for r in caplog.records if r.getMessage().startswith("durable")]
    assert "durable consumer opened" in opened and "durable consumer created again" not in opened
