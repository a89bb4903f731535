"""Automatic retirement (retire_offline_after): a node offline that long is forgotten as
``fleetctl forget`` forgets one, by its partition's owner, once among several
aggregators, and never while the silence is the fleet's (most nodes silent, the bus
gone), counting again from when the fleet is heard."""

from __future__ import annotations

import time

import msgspec

from actors.fleet import record_state
from actors.fleet.aggregator.actor import AggregatorActor
from actors.fleet.aggregator.retirement import (
    RETIRED_BY,
    Retirement,
    retirable,
    silent_shares,
)
from actors.fleet.storage.records import read_record
from actors.fleet.storage.registry import trust_entry
from actors.node.agent import NodeAgent
from actors.runtime.bus import NatsBus
from schemas.messages import NodeRecord
from schemas.subjects import Subjects
from tests.fleet.test_aggregator import watch_alerts
from tests.support.fleet import Fleet, new_aggregator, wait_for, wait_record

QUICK = {"offline_after": 0.5, "sweep_interval": 0.1, "full_sweep_interval": 0.2}
"""Sweeps and offline detection fast enough for a test."""


def record(node: str, cluster: str = "c1", **facts: object) -> NodeRecord:
    """An active record of ``node``, with ``facts`` (stale_since, offline_since, ...)."""
    base = NodeRecord(node_id=node, cluster=cluster, state="active", last_seq=3, last_seen=1.0)
    return record_state.with_state(base, **facts) if facts else base


def test_silent_shares_count_enrolled_nodes_per_fleet_and_cluster() -> None:
    """Stale and offline nodes are silent; deregistered, pending and stopped ones are not
    counted at all; a cluster of one node has no share of its own."""
    records = [
        record("a1", "a", stale_since=5.0),
        record("a2", "a", offline_since=5.0, stale_since=4.0),
        record("a3", "a"),
        record("b1", "b", offline_since=5.0, stale_since=4.0),
        record("b2", "b"),
        record("lone", "c", offline_since=5.0, stale_since=4.0),
        record("gone", "a", deregistered=True, offline_since=5.0, stale_since=4.0),
        record("bye", "b", stopped_since=5.0),
        msgspec.structs.replace(record("new", "a"), state="pending"),
    ]
    overall, clusters = silent_shares(records)
    assert overall == 4 / 6
    assert clusters == {"a": 2 / 3, "b": 1 / 2}


def test_only_an_offline_enrolled_node_silent_long_enough_is_retirable() -> None:
    """Offline since 100 with after 50: retirable at 150 counted from before, not at 149,
    nor at 150 counted from 120; never a stale-only, stopped or deregistered node."""
    offline = record("n1", offline_since=100.0, stale_since=90.0)
    assert retirable(offline, 150.0, 0.0, 50.0)
    assert not retirable(offline, 149.0, 0.0, 50.0)
    assert not retirable(offline, 150.0, 120.0, 50.0)
    assert retirable(offline, 170.0, 120.0, 50.0)
    assert not retirable(record("n1", stale_since=10.0), 1e9, 0.0, 50.0)
    stopped = record_state.with_state(offline, stopped_since=99.0)
    assert not retirable(stopped, 1e9, 0.0, 50.0)
    forgotten = record_state.with_state(offline, deregistered=True)
    assert not retirable(forgotten, 1e9, 0.0, 50.0)


async def test_a_node_offline_past_the_limit_is_forgotten(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """Of three nodes, the one that dies is retired once offline for retire_offline_after:
    deregistered by retirement with the reason, key revoked, one forgotten alert naming
    retirement, counted; the two that beat stay active."""
    alerts = await watch_alerts(bus, prefix)
    aggregator = new_aggregator(bus, prefix, None, retire_offline_after=1.0, **QUICK)
    await fleet.start_supervisor(aggregator)
    agents = [await fleet.start_agent(fleet.config(f"n{i}", fake_gpus=0)) for i in (1, 2, 3)]
    for i in (1, 2, 3):
        await wait_record(bus, prefix, f"n{i}", lambda r: r.state == "active")
    await agents[0].stop(goodbye=False)  # a crash
    retired = await wait_record(bus, prefix, "n1", lambda r: r.deregistered, timeout=30)
    assert retired.state == "deregistered" and retired.deregistered_by == RETIRED_BY
    assert retired.deregistered_reason == "offline for more than 1s"
    assert retired.offline_since is not None and retired.deregistered_at is not None
    assert retired.deregistered_at - retired.offline_since >= 1.0
    entry = await trust_entry(bus, Subjects(prefix), "n1")
    assert entry is not None and entry.revoked
    await wait_for(lambda: alerts.of("forgotten"))
    (alert,) = alerts.of("forgotten")
    assert alert.node_id == "n1" and alert.details["by"] == RETIRED_BY
    assert alert.message.startswith("retired: offline for more than 1s")
    assert aggregator.metrics.registry.get_sample_value("fleet_nodes_retired_total") == 1
    for node in ("n2", "n3"):
        assert (await read_record(bus, Subjects(prefix), node)).state == "active"


async def driven_retirement(
    fleet: Fleet, bus: NatsBus, prefix: str, retiring_bus: NatsBus | None = None
) -> tuple[AggregatorActor, Retirement, list[NodeAgent]]:
    """An aggregator that retires nothing itself, three active agents, and a Retirement
    (retire_offline_after 60 s) over the aggregator's own ledger that the test drives
    with the clock it chooses (on ``retiring_bus`` if given)."""
    aggregator = new_aggregator(bus, prefix, None, **QUICK)
    await fleet.start_supervisor(aggregator)
    agents = [await fleet.start_agent(fleet.config(f"n{i}", fake_gpus=0)) for i in (1, 2, 3)]
    for i in (1, 2, 3):
        await wait_record(bus, prefix, f"n{i}", lambda r: r.state == "active")
    config = msgspec.structs.replace(aggregator.config, retire_offline_after=60.0)
    retirement = Retirement(
        config,
        retiring_bus or bus,
        Subjects(prefix),
        aggregator.ledger,
        aggregator.ownership,
        aggregator.writes,
        aggregator.alerts,
        aggregator.metrics,
    )
    return aggregator, retirement, agents


async def test_most_nodes_silent_holds_retirement_and_restarts_its_count(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """Two of three nodes offline (a silence the fleet caused, as after an outage): an
    hour later nothing is retired and retirement says why; once one beats again, the
    other is retired only after a whole retire_offline_after counted from then."""
    aggregator, retirement, agents = await driven_retirement(fleet, bus, prefix)
    await agents[0].stop(goodbye=False)
    await agents[1].stop(goodbye=False)
    for node in ("n1", "n2"):
        await wait_record(bus, prefix, node, lambda r: r.state == "offline", timeout=15)
    start = time.time()
    await retirement.sweep(start + 3600)
    assert retirement.holding == "67% of the nodes here are stale or offline"
    assert not any(aggregator.ledger.nodes[node].record.deregistered for node in ("n1", "n2"))
    assert retirement.clear_since == start + 3600

    await fleet.start_agent(agents[1].config)  # n2 is heard again
    await wait_for(lambda: aggregator.ledger.nodes["n2"].record.state == "active")
    await retirement.sweep(start + 3650)
    assert retirement.holding == ""
    assert not aggregator.ledger.nodes["n1"].record.deregistered  # 50 s counted of 60
    await retirement.sweep(start + 3661)
    retired = await wait_record(bus, prefix, "n1", lambda r: r.deregistered, timeout=10)
    assert retired.deregistered_by == RETIRED_BY
    assert (await read_record(bus, Subjects(prefix), "n2")).state == "active"


async def test_no_retirement_while_the_bus_is_gone(fleet: Fleet, bus: NatsBus, prefix: str) -> None:
    """A retirement whose connection is down retires nothing however long a node has
    been offline, says so, and counts again from then."""
    gone = await fleet.connect("retirement")
    aggregator, retirement, agents = await driven_retirement(fleet, bus, prefix, gone)
    await agents[0].stop(goodbye=False)
    await wait_record(bus, prefix, "n1", lambda r: r.state == "offline", timeout=15)
    await gone.close()
    later = time.time() + 3600
    await retirement.sweep(later)
    assert retirement.holding == "not connected to NATS" and retirement.clear_since == later
    assert not aggregator.ledger.nodes["n1"].record.deregistered
    assert not (await read_record(bus, Subjects(prefix), "n1")).deregistered


async def test_two_aggregators_retire_a_node_once(fleet: Fleet, bus: NatsBus, prefix: str) -> None:
    """With two aggregators splitting the partitions, a dead node is retired by its
    owner alone: one forgotten alert, only the owner counts it."""
    alerts = await watch_alerts(bus, prefix)
    first = new_aggregator(bus, prefix, None, retire_offline_after=1.0, **QUICK)
    second_bus = await fleet.connect("second-aggregator")
    second = new_aggregator(second_bus, prefix, None, retire_offline_after=1.0, **QUICK)
    await fleet.start_supervisor(first)
    await fleet.start_supervisor(second)
    await wait_for(lambda: first.ownership.since and second.ownership.since)
    agents = [await fleet.start_agent(fleet.config(f"n{i}", fake_gpus=0)) for i in (1, 2, 3)]
    for i in (1, 2, 3):
        await wait_record(bus, prefix, f"n{i}", lambda r: r.state == "active")
    await agents[0].stop(goodbye=False)
    await wait_record(bus, prefix, "n1", lambda r: r.deregistered, timeout=30)
    await wait_for(lambda: alerts.of("forgotten"))
    await bus.flush()
    assert len(alerts.of("forgotten")) == 1
    counts = [
        actor.metrics.registry.get_sample_value("fleet_nodes_retired_total")
        for actor in (first, second)
    ]
    owner = 0 if first.ownership.owns("n1") else 1
    assert counts[owner] == 1 and counts[1 - owner] == 0
