"""A server restart is one ``bus_outage`` alert, not an alert storm: five agents and an
aggregator ride out their only server stopped for 10 s, and a node that died meanwhile is
still found stale."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from nats.aio.msg import Msg

from actors.fleet.storage.records import read_record
from actors.fleet.storage.registry import approve
from actors.fleet.storage.streams import provision
from actors.node.agent import NodeAgent
from actors.runtime.bus import NatsBus
from actors.runtime.embedded import NatsServer
from schemas import codec, signing
from schemas.messages import Alert
from schemas.subjects import Subjects
from tests.support.fleet import TEST_LIMITS, agent_config, start_aggregator, wait_for, wait_record
from tests.support.ports import free_port

PREFIX = "outage"
NODES = [f"n{index}" for index in range(1, 6)]
OUTAGE = 10.0
"""Seconds the server is down: several of the agents' stale_after."""
PER_NODE = {"stale", "recovered", "anomaly", "sequence_gap"}


def outage_alert(alert: Alert) -> bool:
    """An alert the outage itself would cause per node: a lifecycle or gap alert, or a
    health change for a stale feed (a busy test machine's CPU and latency findings are
    true, and not the outage's)."""
    return alert.kind in PER_NODE or (alert.kind == "health" and "probe_freshness" in alert.message)


@pytest.mark.timeout(180)
async def test_a_server_restart_is_one_alert_and_a_dead_node_is_still_stale(
    tmp_path: Path,
) -> None:
    """The server stopped for 10 s under five beating agents, n5 stopped meanwhile: one
    bus_outage alert naming the four that beat again, no stale, recovered, anomaly,
    sequence_gap or health alert of theirs, and n5 stale; their stops raise none either."""
    port = free_port()
    server = NatsServer(tmp_path / "nats", port=port)
    await asyncio.to_thread(server.start)
    subjects = Subjects(PREFIX)
    bus = await NatsBus.connect(server.url, "test")
    await provision(bus.js, subjects, limits=TEST_LIMITS)
    alerts: list[Alert] = []

    async def on_alert(msg: Msg) -> None:
        alerts.append(codec.decode(msg.data, Alert, msg.subject))

    await bus.subscribe(subjects.alerts(), on_alert)
    aggregator = await start_aggregator(bus, PREFIX, sweep_interval=0.2)
    agents: list[NodeAgent] = []
    try:
        for node in NODES:
            config = agent_config(server.url, PREFIX, tmp_path / "state", node, stale_after=3.0)
            key = signing.load_or_create_key_file(config.key_path)
            await approve(bus, subjects, node, key.public_key)
            agent = NodeAgent(config)
            await agent.start()
            agents.append(agent)
        for node in NODES:
            await wait_record(bus, PREFIX, node, lambda r: r.state == "active", timeout=30)
        before = {node: (await read_record(bus, subjects, node)).last_seq for node in NODES}
        alerts.clear()

        await asyncio.to_thread(server.stop)
        stopped = time.monotonic()
        await agents[-1].stop()  # n5 dies while the bus is down: it never beats again
        await asyncio.sleep(max(0.0, OUTAGE - (time.monotonic() - stopped)))  # the outage
        await asyncio.to_thread(server.start)

        for node in NODES[:-1]:
            await wait_record(
                bus, PREFIX, node, lambda r: r.last_seq > before[r.node_id] + 3, timeout=30
            )
        await wait_record(bus, PREFIX, NODES[-1], lambda r: r.state == "stale", timeout=30)
        await wait_for(lambda: [a for a in alerts if a.kind == "bus_outage"], timeout=30)
        for node in NODES[:-1]:
            assert (await read_record(bus, subjects, node)).state == "active"
        # What the outage raised; what the agents' own stops below raise is not its.
        observed = list(alerts)
    finally:
        for agent in agents:
            await agent.stop()
        await aggregator.stop()
        await bus.close()
        server.stop()
    [outage] = [alert for alert in observed if alert.kind == "bus_outage"]
    assert outage.details["nodes"] == "4", outage.message
    assert int(outage.details["seconds"]) >= OUTAGE - 2, outage.details
    storm = [(a.kind, a.node_id, a.message) for a in observed if outage_alert(a)]
    stopping = [(a.kind, a.node_id, a.message) for a in alerts[len(observed) :]]
    assert storm == [("stale", NODES[-1], storm[0][2])], (storm, "then, stopping:", stopping)
    # A requested stop is a goodbye, not a gap (it was a false sequence_gap once).
    assert not [alert for alert in stopping if alert[0] in PER_NODE], stopping
