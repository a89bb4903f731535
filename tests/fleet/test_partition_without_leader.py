"""A heartbeat partition whose consumer is left without a leader, against a real
three-server cluster (issue 42's seed 7 run: FLEET_HB's consumer had no leader for the
310 s the run had left, and its node's heartbeats went unjudged): the partition's owner
makes the consumer again after a lease ttl and judges the node's heartbeats again."""

from __future__ import annotations

import datetime
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack
from pathlib import Path

import nats.errors
import pytest

from actors.fleet.config import AggregatorConfig
from actors.fleet.live import reader as live
from actors.runtime.bus import NatsBus
from actors.runtime.embedded import NatsServer
from schemas.subjects import STREAM_HEARTBEATS, Subjects
from tests.support.fleet import Fleet, wait_for, wait_record
from tests.support.js_cluster import start_cluster, urls, wait_jetstream

LEASE_TTL = 2.0


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


async def test_a_partition_whose_consumer_lost_its_leader_is_judged_again(
    cluster: list[NatsServer], cluster_fleet: Fleet
) -> None:
    """The one partition's consumer, scaled to one replica, loses its only server: its
    owner makes it again (a consumer created after the stop, from the heartbeat after the
    last judged) and the node's heartbeats are judged again; the node stays active."""
    fleet = cluster_fleet
    bus = fleet.bus
    await fleet.start_aggregator(ready_timeout=30, replicas=3, partitions=1, lease_ttl=LEASE_TTL)
    await fleet.start_agent(fleet.config(stale_after=30.0))
    await wait_record(bus, fleet.prefix, "n1", lambda r: r.state == "active")
    subjects = Subjects(fleet.prefix)
    stream = subjects.stream_name(STREAM_HEARTBEATS)
    durable = subjects.partition_consumer(AggregatorConfig().durable, 0)
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
    before = (await live.read_node(bus, subjects, "n1")).last_seq
    victim.stop()
    stopped = time.monotonic()
    stopped_at = datetime.datetime.now(datetime.UTC)

    async def judged_again() -> bool:
        try:
            current = await live.read_node(bus, subjects, "n1")
        except (nats.errors.Error, TimeoutError):
            return False
        return current.last_seq > before + 3

    await wait_for(judged_again)
    print(f"judged again {time.monotonic() - stopped:.1f} s after the consumer's server stopped")
    info = await bus.js.consumer_info(stream, durable)
    assert info.created is not None and info.created > stopped_at
    assert info.config.opt_start_seq is not None and info.config.opt_start_seq > 1
    record = await wait_record(bus, fleet.prefix, "n1", lambda r: r.last_seq > before + 3)
    assert record.state == "active"
