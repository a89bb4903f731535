"""The walking skeleton end to end: agent -> FLEET_HB -> aggregator -> fleet_nodes."""

from __future__ import annotations

from actors.runtime.bus import NatsBus
from tests.support.fleet import Fleet, wait_record


async def test_heartbeats_make_node_active(fleet: Fleet, bus: NatsBus, prefix: str) -> None:
    """An approved agent's signed heartbeats are accepted and its record is active."""
    await fleet.start_aggregator()
    await fleet.start_agent()
    record = await wait_record(bus, prefix, "n1", lambda r: r.state == "active" and r.last_seq >= 2)
    assert record.cluster == "c1"
    assert record.heartbeat is not None and record.heartbeat.sample is not None
    assert len(record.heartbeat.sample.gpus) == 2
