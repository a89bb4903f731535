"""The walking skeleton end to end: agent -> FLEET_HB -> aggregator -> fleet_nodes."""

from __future__ import annotations

from pathlib import Path

from actors.runtime.bus import NatsBus
from actors.runtime.embedded import NatsServer
from tests.support.fleet import agent_config, approved_agent, start_aggregator, wait_record


async def test_heartbeats_make_node_active(
    nats_server: NatsServer, bus: NatsBus, prefix: str, state_dir: Path
) -> None:
    """An approved agent's signed heartbeats are accepted and its record is active."""
    aggregator = await start_aggregator(bus, prefix)
    agent = await approved_agent(bus, agent_config(nats_server.url, prefix, state_dir))
    try:
        record = await wait_record(
            bus, prefix, "n1", lambda r: r.state == "active" and r.last_seq >= 2
        )
        assert record.cluster == "c1"
        assert record.heartbeat is not None and record.heartbeat.sample is not None
        assert len(record.heartbeat.sample.gpus) == 2
    finally:
        await agent.stop()
        await aggregator.stop()
