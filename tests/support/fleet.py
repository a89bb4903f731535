"""Test helpers: an aggregator and node agents running in the test's event loop."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from actors.fleet.aggregator import AggregatorActor
from actors.fleet.config import AggregatorConfig
from actors.fleet.registry import NotFound, approve, read_record
from actors.node.agent import NodeAgent
from actors.node.config import AgentConfig
from actors.runtime.bus import NatsBus
from actors.runtime.supervisor import Supervisor
from schemas import signing
from schemas.messages import NodeRecord
from schemas.subjects import Subjects


async def start_aggregator(
    bus: NatsBus, prefix: str, ready_timeout: float = 10.0, **settings: Any
) -> Supervisor:
    """An aggregator under a supervisor, which restarts it until provisioning succeeds."""
    supervisor = Supervisor([AggregatorActor(AggregatorConfig(prefix=prefix, **settings), bus)])
    supervisor.start()
    if not await supervisor.wait_ready(ready_timeout):
        await supervisor.stop()
        raise AssertionError(f"aggregator not ready within {ready_timeout:g}s")
    return supervisor


def agent_config(
    server: str, prefix: str, state_dir: Path, node: str = "n1", **settings: Any
) -> AgentConfig:
    values: dict[str, Any] = dict(
        server=server,
        prefix=prefix,
        node_id=node,
        cluster="c1",
        state_dir=str(state_dir / node),
        heartbeat_interval=0.5,
        stale_after=2.0,
        sample_interval=0.5,
        health_interval=0.5,
        fake_gpus=2,
        http_port=0,
    )
    values.update(settings)
    return AgentConfig(**values)


async def approved_agent(bus: NatsBus, config: AgentConfig) -> NodeAgent:
    """Create the node's key, approve it, and start the agent."""
    key = signing.load_or_create_key_file(config.key_path)
    await approve(bus, Subjects(config.prefix), config.node_id, key.public_key)
    agent = NodeAgent(config)
    await agent.start()
    return agent


async def wait_for(check: Callable[[], Any], timeout: float = 10.0, interval: float = 0.05) -> Any:
    """Poll ``check`` (sync or async) until it returns something truthy."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        await asyncio.sleep(interval)


async def wait_record(
    bus: NatsBus,
    prefix: str,
    node: str,
    predicate: Callable[[NodeRecord], bool],
    timeout: float = 10.0,
) -> NodeRecord:
    async def check() -> NodeRecord | None:
        try:
            current = await read_record(bus, Subjects(prefix), node)
        except NotFound:
            return None
        return current if predicate(current) else None

    found: NodeRecord = await wait_for(check, timeout)
    return found
