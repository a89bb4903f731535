"""Heartbeat ownership: one aggregator at a time holds the lease and consumes FLEET_HB;
a killed owner's work passes to another within the lease's ttl, without double work."""

from __future__ import annotations

import time

import pytest

from actors.fleet.aggregator import AggregatorActor
from actors.runtime.bus import NatsBus
from actors.runtime.supervisor import Supervisor
from schemas.subjects import Subjects
from tests.fleet.test_aggregator import watch_alerts
from tests.support.fleet import TEST_BUDGETS, Fleet, wait_for, wait_record


def actor_of(supervisor: Supervisor) -> AggregatorActor:
    actor = supervisor.actors[0]
    assert isinstance(actor, AggregatorActor)
    return actor


def owners(actors: list[AggregatorActor]) -> list[AggregatorActor]:
    return [actor for actor in actors if actor.lease is not None and actor.lease.held]


async def start_many(
    fleet: Fleet, count: int
) -> tuple[list[AggregatorActor], list[NatsBus], list[Supervisor]]:
    buses = [await fleet.connect(f"aggregator-{i}") for i in range(count)]
    supervisors = [await fleet.start_aggregator(bus) for bus in buses]
    actors = [actor_of(supervisor) for supervisor in supervisors]
    await wait_for(lambda: len(owners(actors)) == 1)
    return actors, buses, supervisors


@pytest.mark.slow
async def test_killed_owner_hands_over_and_stale_alert_is_raised_once(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """Two aggregators: exactly one owns; its connection killed, the other owns within
    the lease ttl plus a second and carries on (records current, no replay alert); a
    node stopped afterwards gets exactly one stale alert, stored once."""
    alerts = await watch_alerts(bus, prefix)
    actors, buses, _ = await start_many(fleet, 2)
    agents = [await fleet.start_agent(fleet.config(node=f"n{i}")) for i in (1, 2)]
    for i in (1, 2):
        await wait_record(bus, prefix, f"n{i}", lambda r: r.state == "active" and r.last_seq >= 3)
    [owner] = owners(actors)
    killed = time.monotonic()
    await buses[actors.index(owner)].nc.close()  # as good as SIGKILL for the lease
    survivor = actors[1 - actors.index(owner)]
    await wait_for(lambda: owners([survivor]) == [survivor], timeout=TEST_BUDGETS.lease_ttl + 5)
    handover = time.monotonic() - killed
    assert handover < TEST_BUDGETS.lease_ttl + 1.5, handover
    seq = survivor.nodes["n2"].record.last_seq if "n2" in survivor.nodes else 0
    await wait_for(lambda: "n2" in survivor.nodes and survivor.nodes["n2"].record.last_seq > seq)

    await agents[0].stop()
    await wait_for(lambda: alerts.of("stale"), timeout=10)
    await bus.flush()
    assert [alert.node_id for alert in alerts.of("stale")] == ["n1"]
    assert not alerts.of("replay") and not alerts.of("sequence_gap")
    ids = [alert.id for alert in alerts.alerts]
    assert len(ids) == len(set(ids))
    stored = await bus.js.stream_info(Subjects(prefix).stream_name("FLEET_ALERTS"))
    assert stored.state.messages == len(ids)


@pytest.mark.slow
async def test_three_aggregators_one_owner_and_a_clean_stop_hands_over_at_once(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """Three aggregators, one owner; an aggregator added later stands by; the owner
    stopped cleanly releases the lease, so another owns well within the ttl."""
    actors, _, supervisors = await start_many(fleet, 3)
    added = actor_of(await fleet.start_aggregator(await fleet.connect("added")))
    actors.append(added)
    await fleet.start_agent()
    await wait_record(bus, prefix, "n1", lambda r: r.state == "active")
    [owner] = owners(actors)
    assert owner is not added
    supervisor = supervisors[actors.index(owner)]
    stopped = time.monotonic()
    await supervisor.stop()
    rest = [actor for actor in actors if actor is not owner]
    await wait_for(lambda: len(owners(rest)) == 1, timeout=TEST_BUDGETS.lease_ttl + 5)
    assert time.monotonic() - stopped < TEST_BUDGETS.lease_ttl
    [successor] = owners(rest)
    await wait_for(lambda: "n1" in successor.nodes)
    seq = successor.nodes["n1"].record.last_seq
    await wait_for(lambda: successor.nodes["n1"].record.last_seq > seq)
