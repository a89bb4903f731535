"""A fleet of N nodes put straight into the bus, for the listing benchmarks at 100,000
nodes (``fleetctl simulate`` registers about 12,000 nodes in ten minutes on the shared
2-core machine; this takes a minute or two).

:func:`fill_trust_and_records` writes each node's approved key (one key pair for the
whole fleet) into ``fleet_trust`` and its active record into ``fleet_nodes``, before an
aggregator starts; :func:`publish_beats` then publishes each node's next heartbeat, signed,
on its heartbeat subject, for the aggregators to judge as any other (``unhealthy`` of them
with an unhealthy health). Every beat is the template of node 0 (8 fake GPUs, about
4.2 KB) with the node's name, seq and ts put in.
"""

from __future__ import annotations

import asyncio
import base64
import time

import msgspec
import nats.errors
import nats.js.errors

from actors.cli.simulate.publisher import SEQ_MARK, TS_MARK, SimOptions, node_id, template
from actors.fleet.aggregator import record_rules
from actors.fleet.live import reader as live
from actors.fleet.live.state_index import read_index
from actors.fleet.storage.streams import heartbeat_partitions
from actors.runtime.bus import NatsBus
from schemas import codec, signing
from schemas.messages import Heartbeat, TrustEntry
from schemas.subjects import BUCKET_NODES, BUCKET_TRUST, STREAM_HEARTBEATS, Subjects
from tests.bench.bench_aggregator import Aggregator, Bench, Cluster
from tests.bench.bench_live_views import records_count

PREFIX = "fleet"
BATCH = 4096
"""Publishes awaited together."""
INTERVAL = 3600.0
"""The beats' interval: nothing turns stale while a benchmark reads."""
KEY = signing.KeyPair.generate()


def beat_template(gpus: int, unhealthy: bool, interval: float = INTERVAL) -> bytes:
    """Node 0's heartbeat with SEQ_MARK and TS_MARK, healthy or not, claiming
    ``interval``."""
    options = SimOptions(nodes=1, rate=1 / interval, duration=1.0, gpus=gpus)
    body = template(node_id(0), options, "bench-fill")
    if not unhealthy:
        return body
    beat = codec.decode(body, Heartbeat)
    assert beat.health is not None
    sick = msgspec.structs.replace(beat.health, status="unhealthy", score=10)
    return msgspec.json.encode(msgspec.structs.replace(beat, health=sick))


def beat_body(template_: bytes, index: int, seq: int, now: float) -> bytes:
    """Node ``index``'s heartbeat ``seq`` from :func:`beat_template`'s, sent ``now``."""
    named = template_.replace(node_id(0).encode(), node_id(index).encode())
    return named.replace(b"%d" % SEQ_MARK, b"%d" % seq).replace(
        repr(TS_MARK).encode(), b"%.6f" % now
    )


async def fill_trust_and_records(url: str, nodes: int, gpus: int) -> None:
    """Each node's approved key and its active record (seq 1, no stream message)."""
    subjects = Subjects(PREFIX)
    trust = subjects.bucket_name(BUCKET_TRUST)
    records = subjects.bucket_name(BUCKET_NODES)
    healthy = beat_template(gpus, unhealthy=False)
    bus = await NatsBus.connect(url, "bench-fill")
    try:
        for index in range(nodes):
            node, now = node_id(index), time.time()
            entry = TrustEntry(node_id=node, public_key=KEY.public_key, approved_at=now)
            await bus.js.publish_async(f"$KV.{trust}.{node}", codec.encode(entry))
            beat = codec.decode(beat_body(healthy, index, 1, now), Heartbeat)
            record = record_rules.accepted(
                record_rules.pending_record(node, beat.cluster),
                beat,
                KEY.public_key,
                now,
                0,
                now,
                record_rules.gpu_fingerprint(beat),
            )
            await bus.js.publish_async(f"$KV.{records}.{node}", codec.encode(record))
            if index % BATCH == BATCH - 1:
                await bus.js.publish_async_completed()
        await bus.js.publish_async_completed()
    finally:
        await bus.close()


async def publish_beats(url: str, nodes: int, gpus: int, unhealthy: int, seq: int = 2) -> None:
    """Each node's heartbeat ``seq``, signed; the first ``unhealthy`` nodes unhealthy."""
    subjects = Subjects(PREFIX)
    templates = (beat_template(gpus, unhealthy=False), beat_template(gpus, unhealthy=True))
    bus = await NatsBus.connect(url, "bench-beats")
    try:
        for index in range(nodes):
            body = beat_body(templates[index < unhealthy], index, seq, time.time())
            subject = subjects.heartbeat("sim", node_id(index))
            await bus.js.publish_async(subject, body, headers=signed_headers(body))
            if index % BATCH == BATCH - 1:
                await bus.js.publish_async_completed()
        await bus.js.publish_async_completed()
    finally:
        await bus.close()


async def counted(url: str, state: str) -> int:
    """Nodes the state index counts in ``state`` (-1 without an index)."""
    bus = await NatsBus.connect(url, "bench")
    try:
        found = await read_index(bus, Subjects(PREFIX))
        if found is None:
            return -1
        return sum(row.get(state, 0) for row in found.counts.values())
    finally:
        await bus.close()


async def unjudged(url: str) -> int:
    """Heartbeats the aggregators' partition consumers have not acknowledged yet (-1
    while a partition has no consumer yet)."""
    bus = await NatsBus.connect(url, "bench")
    try:
        subjects = Subjects(PREFIX)
        stream = subjects.stream_name(STREAM_HEARTBEATS)
        left = 0
        for partition in range(await heartbeat_partitions(bus.js, subjects)):
            name = subjects.partition_consumer(live.DURABLE, partition)
            try:
                info = await bus.js.consumer_info(stream, name, timeout=10.0)
            except nats.js.errors.NotFoundError:
                return -1
            left += (info.num_pending or 0) + (info.num_ack_pending or 0)
        return left
    finally:
        await bus.close()


def judged(url: str, unhealthy: int) -> bool:
    """Every heartbeat acknowledged and the unhealthy nodes counted (False while the
    loaded server does not answer in time)."""
    try:
        return (
            not asyncio.run(unjudged(url)) and asyncio.run(counted(url, "unhealthy")) >= unhealthy
        )
    except nats.errors.TimeoutError:
        return False


def left_behind(
    bench: Bench, cluster: Cluster, aggregator: Aggregator, nodes: int, gpus: int, unhealthy: int
) -> None:
    """Every record of a :func:`filled_fleet` left a beat behind its node's latest accepted
    heartbeat, as a fleet's records are between checkpoints: each node's next beat (seq
    3) is published and judged, and the aggregator killed (SIGKILL: no checkpoint written
    on the way out). None is started again: one would judge the beats its checkpoints
    miss again and write them, as a cold start does."""
    started = time.monotonic()
    asyncio.run(publish_beats(cluster.url, nodes, gpus, unhealthy, seq=3))
    deadline = time.monotonic() + 1800
    while not judged(cluster.url, unhealthy):
        if time.monotonic() > deadline:
            raise RuntimeError("the aggregator did not judge every heartbeat in 30 minutes")
        time.sleep(0.5)
    aggregator.process.kill()
    aggregator.process.wait()
    took = time.monotonic() - started
    bench.say(f"every node's next beat judged in {took:.0f} s, aggregator killed")


def signed_headers(body: bytes) -> dict[str, str]:
    """The headers of ``body`` signed with the fleet's one key (:data:`KEY`)."""
    return {
        signing.HEADER_KEY: KEY.public_key,
        signing.HEADER_SIG: base64.b64encode(KEY.sign(body)).decode(),
    }


def loaded_aggregator(bench: Bench, cluster: Cluster, nodes: int, gpus: int) -> Aggregator:
    """``nodes`` keys and records put in, and an aggregator started on them that holds
    every lease (the records loaded): returned."""
    first = cluster.start_aggregator()  # makes the buckets and streams
    first.wait_owner(120)
    first.stop()
    started = time.monotonic()
    asyncio.run(fill_trust_and_records(cluster.url, nodes, gpus))
    if (stored := asyncio.run(records_count(cluster.url))) != nodes:
        raise RuntimeError(f"{stored} records stored of {nodes}")
    bench.say(f"{nodes} keys and records put in {time.monotonic() - started:.0f} s")
    aggregator = cluster.start_aggregator()
    loaded = aggregator.wait_owner(600)
    if loaded is None:
        raise RuntimeError("the aggregator did not load the records in 10 minutes")
    bench.say(
        f"records loaded, every lease held {loaded:.0f} s after the aggregator answered; "
        f"aggregator RSS {aggregator.rss_mb():.0f} MiB"
    )
    return aggregator


def filled_fleet(
    bench: Bench, cluster: Cluster, nodes: int, gpus: int, unhealthy: int
) -> Aggregator:
    """``nodes`` keys and records put in, an aggregator started on them, then every
    node's next beat (``unhealthy`` of them unhealthy), judged: the aggregator returned."""
    aggregator = loaded_aggregator(bench, cluster, nodes, gpus)
    started = time.monotonic()
    asyncio.run(publish_beats(cluster.url, nodes, gpus, unhealthy))
    bench.say(f"{nodes} heartbeats published in {time.monotonic() - started:.0f} s")
    deadline = time.monotonic() + 1800
    while not judged(cluster.url, unhealthy):
        if time.monotonic() > deadline:
            raise RuntimeError("the aggregator did not judge every heartbeat in 30 minutes")
        time.sleep(2.0)
    bench.say(
        f"every heartbeat judged, {unhealthy} unhealthy counted, "
        f"{time.monotonic() - started:.0f} s after the first publish; "
        f"aggregator RSS {aggregator.rss_mb():.0f} MiB"
    )
    return aggregator
