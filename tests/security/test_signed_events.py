"""Node events from the attacker's side: anyone who can publish on ``fleet.evt.<node>.*``
(an open server, another node's stolen key on a permissive one) tries to drive a node's
actions and its signed heartbeat with forged events. Plain nats-py clients, no helpers of
the project's bus."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec
import nats
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from actors.node.agent import NodeAgent
from schemas import codec, signing
from schemas.events import Capacity, Inject, Interruption, NodeState, Sample
from schemas.messages import Heartbeat
from tests.support.fleet import Fleet, wait_for, wait_record

QUIET_S = 2.0
"""How long a node is watched for the effect of a forged event: four heartbeat intervals."""


@pytest.fixture
async def attacker(fleet: Fleet) -> Client:
    """A plain nats-py connection to the test's server."""
    nc = await nats.connect(fleet.url)
    fleet.stack.push_async_callback(nc.close)
    return nc


class Beats:
    """Every heartbeat node n1 publishes from now on."""

    def __init__(self) -> None:
        self.beats: list[Heartbeat] = []

    async def start(self, nc: Client, prefix: str) -> Beats:
        await nc.subscribe(f"{prefix}.hb.c1.n1", cb=self._on_beat)
        await nc.flush()
        return self

    async def _on_beat(self, msg: Msg) -> None:
        self.beats.append(codec.decode(msg.data, Heartbeat, msg.subject))


def dropped(agent: NodeAgent, reason: str = "") -> float:
    """Events dropped for ``reason`` (any reason if "") by all of the agent's actors."""
    return sum(
        sample.value
        for metric in agent.metrics.events_dropped.collect()
        for sample in metric.samples
        if sample.name.endswith("_total") and reason in ("", sample.labels["reason"])
    )


def terminate_notice() -> Interruption:
    return Interruption(
        ts=time.time(), provider="aws", kind="terminate", deadline=time.time() + 120, event_id="x"
    )


async def running_agent(fleet: Fleet, **settings: Any) -> NodeAgent:
    await fleet.start_aggregator()
    agent = await fleet.start_agent(fleet.config(**settings))
    await wait_record(fleet.bus, fleet.prefix, "n1", lambda r: r.state == "active")
    return agent


async def assert_untouched(fleet: Fleet, agent: NodeAgent) -> None:
    """For QUIET_S the node keeps beating as a schedulable, active node and keeps running."""
    seq = (await wait_record(fleet.bus, fleet.prefix, "n1", lambda r: True)).last_seq
    await asyncio.sleep(QUIET_S)
    record = await wait_record(fleet.bus, fleet.prefix, "n1", lambda r: r.last_seq > seq)
    assert record.state == "active" and record.schedulability == "schedulable"
    assert agent.supervisor is not None and not agent.supervisor.finished.is_set()


async def test_unsigned_interruption_neither_drains_nor_stops_the_node(
    fleet: Fleet, attacker: Client
) -> None:
    """An unsigned terminate notice on the node's interruption subject is dropped and
    counted: the node does not drain, deregister or exit."""
    agent = await running_agent(fleet)
    body = codec.encode(terminate_notice())
    await attacker.publish(f"{fleet.prefix}.evt.n1.interruption", body)
    await attacker.flush()
    await assert_untouched(fleet, agent)
    await wait_for(lambda: dropped(agent, "unsigned") >= 1)


async def test_event_signed_by_another_nodes_key_is_dropped(fleet: Fleet, attacker: Client) -> None:
    """A notice signed by node n2's (stolen) key, published on n1's subject, is dropped."""
    agent = await running_agent(fleet)
    n2 = fleet.node_key("n2")
    body = codec.encode(terminate_notice())
    await attacker.publish(f"{fleet.prefix}.evt.n1.interruption", body, headers=n2.headers(body))
    await attacker.flush()
    await assert_untouched(fleet, agent)
    await wait_for(lambda: dropped(agent, "untrusted_key") >= 1)


async def test_forged_state_and_sample_are_not_folded_into_the_heartbeat(
    fleet: Fleet, attacker: Client
) -> None:
    """Unsigned ``state`` and ``sample`` events never reach the node's signed heartbeat."""
    agent = await running_agent(fleet)
    beats = await Beats().start(attacker, fleet.prefix)
    state = NodeState(ts=time.time(), schedulability="drained", reason="forged")
    capacity = Capacity(
        cpu_cores=1,
        cpu_percent=0.0,
        load_avg_1m=0.0,
        memory_total=1,
        memory_available=1,
        gpus_total=0,
        gpus_available=0,
        storage_total=1,
        storage_available=1,
    )
    sample = Sample(ts=time.time() + 60, capacity=capacity, hostname="forged")
    for _ in range(3):
        await attacker.publish(f"{fleet.prefix}.evt.n1.state", codec.encode(state))
        await attacker.publish(f"{fleet.prefix}.evt.n1.sample", codec.encode(sample))
        await attacker.flush()
        await asyncio.sleep(QUIET_S / 3)
    await wait_for(lambda: dropped(agent, "unsigned") >= 6)
    await wait_for(lambda: len(beats.beats) >= 2)
    assert all(beat.schedulability == "schedulable" for beat in beats.beats)
    assert all(beat.sample is None or beat.sample.hostname != "forged" for beat in beats.beats)


async def test_inject_signed_by_a_trusted_operator_is_accepted(
    fleet: Fleet, attacker: Client
) -> None:
    """A fault injection signed by an operator key the agent trusts takes effect; the same
    injection signed by an untrusted key does not."""
    operator, stranger = signing.KeyPair.generate(), signing.KeyPair.generate()
    agent = await running_agent(fleet, trust_operators=[operator.public_key])
    beats = await Beats().start(attacker, fleet.prefix)
    subject = f"{fleet.prefix}.evt.n1.inject"

    def hot(beat: Heartbeat) -> bool:
        return beat.sample is not None and beat.sample.gpus[1].temperature_c == 95.0

    forged = codec.encode(Inject(ts=time.time(), node_id="n1", fault="temp", gpu=1, value=95))
    await attacker.publish(subject, forged, headers=stranger.headers(forged))
    await attacker.flush()
    await asyncio.sleep(QUIET_S / 2)
    assert not any(hot(beat) for beat in beats.beats)
    await wait_for(lambda: dropped(agent, "untrusted_key") >= 1)

    body = codec.encode(Inject(ts=time.time(), node_id="n1", fault="temp", gpu=1, value=95))
    await attacker.publish(subject, body, headers=operator.headers(body))
    await attacker.flush()
    await wait_for(lambda: any(hot(beat) for beat in beats.beats))


async def test_honest_traffic_still_flows(fleet: Fleet) -> None:
    """The node's own signed events all reach its heartbeat with nothing dropped, and a
    notice the node itself signs still drains it."""
    agent = await running_agent(fleet)
    record = await wait_record(
        fleet.bus,
        fleet.prefix,
        "n1",
        lambda r: bool(
            r.health_status == "healthy"
            and r.heartbeat
            and r.heartbeat.sample
            and r.heartbeat.health
            and r.heartbeat.engine
            and r.heartbeat.latency
        ),
    )
    assert record.state == "active"
    assert dropped(agent) == 0
    await fleet.publish_event("interruption", terminate_notice())
    await wait_record(fleet.bus, fleet.prefix, "n1", lambda r: r.schedulability != "schedulable")


async def test_a_captured_notice_replayed_after_the_command_lifetime_does_nothing(
    fleet: Fleet, attacker: Client
) -> None:
    """The node remembers a notice's key for max_command_lifetime: a properly signed
    terminate notice older than that (captured, sent again) neither drains nor stops it."""
    agent = await running_agent(fleet, max_command_lifetime=60.0)
    old = msgspec.structs.replace(terminate_notice(), ts=time.time() - 120)
    body = codec.encode(old)
    await attacker.publish(
        f"{fleet.prefix}.evt.n1.interruption", body, headers=agent.key.headers(body)
    )
    await attacker.flush()
    await assert_untouched(fleet, agent)
