"""A heartbeat partition whose consumer is left without a leader, against a real
three-server cluster (issue 42's seed 7 run: FLEET_HB's consumer had no leader for the
310 s the run had left, and its node's heartbeats went unjudged): the partition's owner
makes the consumer again after a lease ttl and judges the node's heartbeats again."""

from __future__ import annotations

import datetime
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack
from pathlib import Path

import nats.errors
import pytest
from nats.js.api import ConsumerInfo

from actors.fleet.config import AggregatorConfig
from actors.fleet.live import reader as live
from actors.runtime.bus import NatsBus
from actors.runtime.embedded import NatsServer
from schemas.subjects import STREAM_HEARTBEATS, Subjects
from tests.support.fleet import Fleet, wait_for, wait_record
from tests.support.js_cluster import start_cluster, urls, wait_jetstream

LEASE_TTL = 2.0
ELECTION_PROOF_TTL = 12.0
"""Longer than nats-server's longest raft election timeout (9 s)."""


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[list[NatsServer]]:
    yield from start_cluster(tmp_path / "cluster")


@pytest.fixture
async def cluster_fleet(
    cluster: list[NatsServer], state_dir: Path, prefix: str
) -> AsyncIterator[Fleet]:
    async with AsyncExitStack() as stack:
        bus = await NatsBus.connect(urls(cluster), "test")
        stack.push_async_callback(bus.close)
        await wait_jetstream(bus)
        yield Fleet(urls(cluster), bus, prefix, state_dir, stack)


async def strand(fleet: Fleet, cluster: list[NatsServer]) -> datetime.datetime:
    """Scale partition 0's consumer to one replica and stop its server: the consumer has
    no leader (and cannot get one) while its stream and the cluster are well. Returns
    when the server was stopped."""
    bus = fleet.bus
    stream, durable = stream_of(fleet), durable_of(fleet)
    info = await bus.js.consumer_info(stream, durable)
    await bus.js.add_consumer(stream, config=info.config.evolve(num_replicas=1))

    async def one_replica() -> str:
        try:
            info = await bus.js.consumer_info(stream, durable)
        except (nats.errors.Error, TimeoutError):
            return ""
        cluster_info = info.cluster
        alone = info.config.num_replicas == 1 and cluster_info is not None
        return cluster_info.leader or "" if alone and not cluster_info.replicas else ""

    leader = await wait_for(one_replica)
    victim = next(server for server in cluster if server.name == leader)
    victim.stop()
    return datetime.datetime.now(datetime.UTC)


def stream_of(fleet: Fleet) -> str:
    return Subjects(fleet.prefix).stream_name(STREAM_HEARTBEATS)


def durable_of(fleet: Fleet) -> str:
    return Subjects(fleet.prefix).partition_consumer(AggregatorConfig().durable, 0)


async def judged_again(fleet: Fleet, stopped_at: datetime.datetime) -> ConsumerInfo:
    """Until n1's heartbeats are judged again; the consumer then is one made after the
    stop (returned), and the node is active."""
    bus, subjects = fleet.bus, Subjects(fleet.prefix)
    before = (await live.read_node(bus, subjects, "n1")).last_seq

    async def judged() -> bool:
        try:
            current = await live.read_node(bus, subjects, "n1")
        except (nats.errors.Error, TimeoutError):
            return False
        return current.last_seq > before + 3

    await wait_for(judged)
    took = datetime.datetime.now(datetime.UTC) - stopped_at
    print(f"judged again {took.total_seconds():.1f} s after the consumer's server stopped")
    info: ConsumerInfo = await bus.js.consumer_info(stream_of(fleet), durable_of(fleet))
    assert info.created is not None and info.created > stopped_at
    record = await wait_record(bus, fleet.prefix, "n1", lambda r: r.last_seq > before + 3)
    assert record.state == "active"
    return info


async def test_a_partition_whose_consumer_lost_its_leader_is_judged_again(
    cluster: list[NatsServer], cluster_fleet: Fleet, caplog: pytest.LogCaptureFixture
) -> None:
    """The one partition's consumer, scaled to one replica, loses its only server: its
    owner makes it again (a consumer created after the stop, from the heartbeat after the
    last judged) and the node's heartbeats are judged again; the node stays active."""
    fleet = cluster_fleet
    # A lease outlasting the elections the stop may cause (the leases' own stream may
    # have had its leader there): the partition stays with its owner throughout.
    await fleet.start_aggregator(
        ready_timeout=30, replicas=3, partitions=1, lease_ttl=ELECTION_PROOF_TTL
    )
    await fleet.start_agent(fleet.config(stale_after=30.0))
    await wait_record(fleet.bus, fleet.prefix, "n1", lambda r: r.state == "active")
    stopped_at = await strand(fleet, cluster)

    async def last_stored() -> int:
        try:
            return (await fleet.bus.js.stream_info(stream_of(fleet))).state.last_seq
        except (nats.errors.Error, TimeoutError):
            return 0  # the stream is electing a leader

    stored = await wait_for(last_stored)
    info = await judged_again(fleet, stopped_at)
    # Where the judging had got to: not from the start again, and not past what the
    # stream held once the consumer stopped answering (that would skip heartbeats).
    assert info.config.opt_start_seq is not None
    assert 1 < info.config.opt_start_seq <= stored + 1
    assert "durable consumer not answering; making it again" in caplog.messages
    assert "partitions lost" not in caplog.messages


async def test_a_new_owner_takes_a_partition_whose_consumer_has_no_leader(
    cluster: list[NatsServer], cluster_fleet: Fleet
) -> None:
    """The consumer loses its leader while no aggregator runs: the next owner cannot read
    its ack floor (503), so it resumes from the records' checkpoints, deletes the old
    consumer without waiting for an answer and judges the node's heartbeats again."""
    fleet = cluster_fleet
    first = await fleet.start_aggregator(ready_timeout=30, replicas=3, partitions=1)
    await fleet.start_agent(fleet.config(stale_after=30.0))
    await wait_record(fleet.bus, fleet.prefix, "n1", lambda r: r.state == "active")
    await first.stop()
    stopped_at = await strand(fleet, cluster)
    await fleet.start_aggregator(ready_timeout=30, replicas=3, partitions=1, lease_ttl=LEASE_TTL)
    await judged_again(fleet, stopped_at)
