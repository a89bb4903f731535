"""A deleted durable consumer is created again, and /healthz says so while it cannot be."""

from __future__ import annotations

from collections.abc import Mapping

import nats.js.errors

from actors.fleet.metrics import AggregatorMetrics
from actors.fleet.operator.commands import new_command
from actors.fleet.storage.streams import provision
from actors.node.agent import NodeAgent
from actors.node.http_api import HttpApiActor
from actors.runtime.bus import NatsBus
from actors.runtime.supervisor import ActorStatus, Supervisor
from schemas import codec, signing
from schemas.messages import Cordon
from schemas.subjects import STREAM_COMMANDS, STREAM_HEARTBEATS, Subjects, partition_of
from tests.security.attack import attacker, http_status, restarts
from tests.support.commanding import Results
from tests.support.fleet import (
    TEST_LIMITS,
    Fleet,
    new_aggregator,
    new_fleet_api,
    wait_for,
    wait_record,
)


async def consumer_exists(url: str, stream: str, durable: str) -> bool:
    async with attacker(url) as nc:
        try:
            await nc.jetstream().consumer_info(stream, durable)
        except nats.js.errors.NotFoundError:
            return False
    return True


async def test_aggregator_recreates_its_deleted_consumer(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    subjects = Subjects(prefix)
    stream = subjects.stream_name(STREAM_HEARTBEATS)
    # n1's partition's consumer: the one its heartbeats go through.
    durable = subjects.partition_consumer("aggregator", partition_of("n1", TEST_LIMITS.partitions))
    supervisor: Supervisor | None = None

    def statuses() -> Mapping[str, ActorStatus]:
        return supervisor.check() if supervisor else {}

    api = new_fleet_api(bus, prefix, AggregatorMetrics(), statuses)
    supervisor = await fleet.start_supervisor(new_aggregator(bus, prefix), api)
    healthz = f"http://127.0.0.1:{api.port}/healthz"
    await fleet.start_agent()
    first = await wait_record(bus, prefix, "n1", lambda record: record.state == "active")
    assert await http_status(healthz) == 200

    async with attacker(fleet.url) as nc:
        await nc.jetstream().delete_consumer(stream, durable)
    await wait_for(lambda: consumer_exists(fleet.url, stream, durable))
    await wait_record(bus, prefix, "n1", lambda record: record.last_seq > first.last_seq + 2)

    # Its stream gone too, the consumer cannot be created: /healthz says so until it can.
    async with attacker(fleet.url) as nc:
        await nc.jetstream().delete_stream(stream)
    await wait_for(lambda: _status_is(healthz, 503))
    await provision(bus.js, subjects, limits=TEST_LIMITS)
    await wait_for(lambda: _status_is(healthz, 200))
    before = await wait_record(bus, prefix, "n1", lambda record: True)
    await wait_record(bus, prefix, "n1", lambda record: record.last_seq > before.last_seq)
    assert restarts(supervisor) == {"aggregator": 0, "fleet_api": 0}


async def test_agent_recreates_its_deleted_command_consumer(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    subjects = Subjects(prefix)
    stream = subjects.stream_name(STREAM_COMMANDS)
    operator = signing.KeyPair.generate()
    results = await Results().start(bus, prefix)
    agent = await fleet.start_agent(fleet.config(trust_operators=[operator.public_key]))
    assert agent.supervisor is not None and await agent.supervisor.wait_ready(10)
    healthz = f"http://127.0.0.1:{http_port(agent)}/healthz"
    assert await http_status(healthz) == 200

    async with attacker(fleet.url) as nc:
        js = nc.jetstream()
        await js.delete_consumer(stream, "cmd_c1_n1")
        await wait_for(lambda: consumer_exists(fleet.url, stream, "cmd_c1_n1"))
        command = new_command("n1", "c1", Cordon())
        body = codec.encode(command)
        await js.publish(subjects.command("c1", "n1"), body, headers=operator.headers(body))
        await wait_for(lambda: "accepted" in results.statuses(command.id))

        await js.delete_stream(stream)
        await wait_for(lambda: _status_is(healthz, 503))
        await provision(bus.js, subjects, limits=TEST_LIMITS)
        await wait_for(lambda: _status_is(healthz, 200))
        command = new_command("n1", "c1", Cordon())
        body = codec.encode(command)
        await js.publish(subjects.command("c1", "n1"), body, headers=operator.headers(body))
        await wait_for(lambda: "accepted" in results.statuses(command.id))
    assert restarts(agent.supervisor)["commands"] == 0


def http_port(agent: NodeAgent) -> int:
    assert agent.supervisor is not None
    for actor in agent.supervisor.actors:
        if isinstance(actor, HttpApiActor) and actor.port is not None:
            return actor.port
    raise AssertionError("agent serves no HTTP")


async def _status_is(url: str, status: int) -> bool:
    return await http_status(url) == status
