"""A bus outage is one ``bus_outage`` alert, not an alert per node
(actors/fleet/aggregator/outage.py): the nodes beating again after a silence of the whole
stream raise no ``anomaly`` for their gap, and a node that died meanwhile is still stale."""

from __future__ import annotations

import asyncio

from actors.fleet.aggregator.outage import Outages
from actors.fleet.aggregator.silence import StreamPulse
from actors.fleet.storage.records import read_record
from actors.runtime.bus import NatsBus
from schemas.subjects import Subjects
from tests.fleet.test_aggregator import watch_alerts
from tests.fleet.test_silence import beat, two_nodes
from tests.support.fleet import Fleet, wait_for, wait_record


def test_a_silence_between_two_heartbeats_is_found_whole() -> None:
    """The silence between a node's two heartbeats is given from its first silent second
    to the first stored again, if it lasted half the span; one shorter is none."""
    pulse = StreamPulse()
    for second in [*range(90, 102), 132, 133]:
        pulse.stored(second + 0.2)
    assert pulse.silence_between(100.2, 132.4, 6.0) == (102.0, 132.0)
    assert pulse.silence_between(95.2, 101.2, 6.0) is None
    pulse.stored(140.2)
    assert pulse.silence_between(133.2, 140.2, 6.0) == (134.0, 140.0)
    assert pulse.silence_between(133.2, 140.2, 16.0) is None  # 6 s of 16 is not half


def test_outages_gather_the_nodes_of_one_silence_then_settle() -> None:
    """Nodes noted after the same silence make one outage, raised once no node has been
    noted for the longest stale_after; a later silence is another."""
    outages = Outages(bound=60.0)
    outages.note("n1", "c1", (100.0, 130.0), 6.0, now=131.0)
    outages.note("n2", "c2", (101.0, 131.0), 2.0, now=132.0)
    assert outages.due(137.9) == []
    [outage] = outages.due(138.0)
    assert (outage.start, outage.end, outage.nodes) == (100.0, 131.0, {"n1": "c1", "n2": "c2"})
    assert outage.message().startswith("bus outage: no heartbeat stored for 31s; 2 node(s)")
    assert outage.message().endswith("no alert per node") and not outage.per_node()
    assert outages.due(1000.0) == []
    outages.note("n1", "c1", (300.0, 310.0), 6.0, now=311.0)
    outages.note("n1", "c1", (400.0, 410.0), 6.0, now=411.0)
    assert [o.start for o in outages.due(411.0)] == [300.0]


def test_an_outage_longer_than_its_bound_says_it_was_told_per_node() -> None:
    """A silence longer than bus_outage_max is still one outage, whose alert says each
    node's alerts were raised; one of the bound itself is not."""
    outages = Outages(bound=30.0)
    assert not outages.told_per_node((100.0, 130.0))
    assert outages.told_per_node((100.0, 131.0))
    outages.note("n1", "c1", (100.0, 131.0), 6.0, now=132.0)
    [outage] = outages.due(138.0)
    assert outage.per_node() and outage.details()["per_node"] == "yes"
    assert outage.message().endswith("longer than bus_outage_max (30s): each node's alerts raised")


async def test_a_bus_outage_is_one_alert_not_one_per_node(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """Both nodes silent with the whole stream, shorter than bus_outage_max, then beating
    again: one bus_outage alert naming both, and no stale, recovered, anomaly or
    sequence_gap alert of either."""
    alerts = await watch_alerts(bus, prefix)
    aggregator, keys = await two_nodes(fleet, bus, prefix, bus_outage_max=15.0)
    await wait_for(lambda: set(aggregator.ledger.held.held) == {"n1", "n2"})
    for seq in range(4, 8):
        for node, key in keys.items():
            await beat(bus, prefix, key, node, seq)
        await asyncio.sleep(0.5)  # the nodes' own pace
    await wait_for(lambda: alerts.of("bus_outage"))
    [outage] = alerts.of("bus_outage")
    assert (outage.node_id, outage.cluster, outage.details["nodes"]) == ("_bus", "_fleet", "2")
    assert int(outage.details["seconds"]) >= 1  # half stale_after at least, in whole seconds
    assert outage.details["per_node"] == "no", outage.message
    per_node = [a.kind for a in alerts.alerts if a.kind != "bus_outage"]
    assert per_node == [], per_node
    for node in keys:
        assert (await read_record(bus, Subjects(prefix), node)).state == "active"


async def test_an_outage_longer_than_bus_outage_max_is_told_per_node(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """Both nodes silent with the whole stream for 6 s, longer than bus_outage_max (2 s):
    each is stale, then recovered when beating again, and the one bus_outage alert says
    each node's alerts were raised."""
    alerts = await watch_alerts(bus, prefix)
    _, keys = await two_nodes(fleet, bus, prefix, bus_outage_max=2.0)
    for node in keys:
        await wait_record(bus, prefix, node, lambda r: r.state == "stale", timeout=15)
    await asyncio.sleep(2.0)  # the outage itself: 6 s at least, three times the bound
    for seq in range(4, 8):
        for node, key in keys.items():
            await beat(bus, prefix, key, node, seq)
        await asyncio.sleep(0.5)  # the nodes' own pace
    await wait_for(lambda: alerts.of("bus_outage") and len(alerts.of("recovered")) == 2)
    assert sorted(a.node_id for a in alerts.of("stale")) == ["n1", "n2"]
    assert sorted(a.node_id for a in alerts.of("recovered")) == ["n1", "n2"]
    [outage] = alerts.of("bus_outage")
    assert outage.details["per_node"] == "yes", outage.message
    assert "longer than bus_outage_max (2s): each node's alerts raised" in outage.message


async def test_a_node_dead_during_the_outage_is_still_stale(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """Only n1 beats again after the silence: n2 is stale, once; the outage's one alert
    names n1 alone, and n1 raises no gap alert."""
    alerts = await watch_alerts(bus, prefix)
    aggregator, keys = await two_nodes(fleet, bus, prefix)
    await wait_for(lambda: set(aggregator.ledger.held.held) == {"n1", "n2"})

    async def n1_beats() -> None:
        for seq in range(4, 100):
            await beat(bus, prefix, keys["n1"], "n1", seq)
            await asyncio.sleep(0.5)  # the node's own pace

    beating = asyncio.create_task(n1_beats())
    try:
        await wait_record(bus, prefix, "n2", lambda r: r.state == "stale")
        await wait_for(lambda: alerts.of("bus_outage"))
    finally:
        beating.cancel()
    [outage] = alerts.of("bus_outage")
    assert outage.details["nodes"] == "1" and "(n1)" in outage.message
    assert [a.node_id for a in alerts.of("stale")] == ["n2"]
    assert alerts.of("anomaly") == [] and alerts.of("sequence_gap") == []
