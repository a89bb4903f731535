"""A pull consumer left without a leader, against a real three-server cluster: its puller
makes it again after ``replace_after`` from the message after the last it handed out, so
the stream is read on with nothing read twice or skipped."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import nats.errors
import pytest
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, StreamConfig

from actors.runtime.batch_pull import BatchPuller, Chain
from actors.runtime.bus import NatsBus
from actors.runtime.consumer import DurableConsumer
from actors.runtime.embedded import NatsServer
from tests.runtime.test_batch_pull import start_loop
from tests.support.fleet import wait_for
from tests.support.js_cluster import start_cluster, urls, wait_jetstream

STREAM = "LEADERLESS"
REPLACE_AFTER = 1.0


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[list[NatsServer]]:
    yield from start_cluster(tmp_path)


@pytest.fixture
async def cluster_bus(cluster: list[NatsServer]) -> AsyncIterator[NatsBus]:
    bus = await NatsBus.connect(urls(cluster), "test")
    await wait_jetstream(bus)
    yield bus
    await bus.close()


async def publish(bus: NatsBus, n: int) -> None:
    """Message ``n`` into the stream, retried while the stream elects a leader (its
    Nats-Msg-Id keeps a retried one from being stored twice)."""

    async def stored() -> bool:
        try:
            await bus.js.publish(
                f"ll.{n}", str(n).encode(), headers={"Nats-Msg-Id": str(n)}, timeout=2.0
            )
        except (nats.errors.Error, TimeoutError):
            return False
        return True

    await wait_for(stored, interval=0.2)


async def test_a_consumer_without_a_leader_is_made_again_from_the_next_message(
    cluster: list[NatsServer], cluster_bus: NatsBus
) -> None:
    """An R1 consumer whose one server is stopped has no leader (every pull: 503); the
    puller deletes it and creates it again from the sequence after the last it handed
    out, and the messages stored since arrive: each message read exactly once, in order."""
    bus = cluster_bus

    async def created() -> bool:
        try:
            await bus.js.add_stream(StreamConfig(name=STREAM, subjects=["ll.>"], num_replicas=3))
        except (nats.errors.Error, TimeoutError):
            return False
        return True

    await wait_for(created, interval=0.2)
    consumer = DurableConsumer(
        bus.js,
        STREAM,
        "ll.>",
        "reader",
        ConsumerConfig(
            ack_policy=AckPolicy.ALL,
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=1,
            ack_wait=30,
            num_replicas=1,
        ),
    )
    await consumer.open()
    read: list[int] = []

    async def handle(messages: list[Msg]) -> list[Chain]:
        read.extend(int(msg.data) for msg in messages)
        return []

    puller = BatchPuller(bus, consumer, replace_after=REPLACE_AFTER)
    loop = start_loop(puller, handle, batch=10, wait=0.5, linger=0.0)
    try:
        for n in (1, 2, 3):
            await publish(bus, n)
        await wait_for(lambda: len(read) >= 3)
        info = await bus.js.consumer_info(STREAM, "reader")
        assert info.cluster is not None and info.cluster.leader
        victim = next(s for s in cluster if s.name == info.cluster.leader)
        victim.stop()
        stopped = time.monotonic()
        for n in (4, 5):
            await publish(bus, n)
        await wait_for(lambda: len(read) >= 5)
        print(f"read on {time.monotonic() - stopped:.1f} s after the consumer's server stopped")
        assert read == [1, 2, 3, 4, 5]
        assert puller.next_seq == 6
        info = await bus.js.consumer_info(STREAM, "reader")
        assert info.cluster is not None and info.cluster.leader != victim.name
        assert info.config.opt_start_seq == 4
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
        await puller.close()
        await consumer.close()
