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

import base64
import time

import msgspec

from actors.cli.simulate.publisher import SEQ_MARK, TS_MARK, SimOptions, node_id, template
from actors.fleet.aggregator import record_rules
from actors.runtime.bus import NatsBus
from schemas import codec, signing
from schemas.messages import Heartbeat, TrustEntry
from schemas.subjects import BUCKET_NODES, BUCKET_TRUST, Subjects

PREFIX = "fleet"
BATCH = 4096
"""Publishes awaited together."""
INTERVAL = 3600.0
"""The beats' interval: nothing turns stale while a benchmark reads."""
KEY = signing.KeyPair.generate()


def _template(gpus: int, unhealthy: bool) -> bytes:
    """Node 0's heartbeat with SEQ_MARK and TS_MARK, healthy or not."""
    options = SimOptions(nodes=1, rate=1 / INTERVAL, duration=1.0, gpus=gpus)
    body = template(node_id(0), options, "bench-fill")
    if not unhealthy:
        return body
    beat = codec.decode(body, Heartbeat)
    assert beat.health is not None
    sick = msgspec.structs.replace(beat.health, status="unhealthy", score=10)
    return msgspec.json.encode(msgspec.structs.replace(beat, health=sick))


def _body(template_: bytes, index: int, seq: int, now: float) -> bytes:
    named = template_.replace(node_id(0).encode(), node_id(index).encode())
    return named.replace(b"%d" % SEQ_MARK, b"%d" % seq).replace(
        repr(TS_MARK).encode(), b"%.6f" % now
    )


async def fill_trust_and_records(url: str, nodes: int, gpus: int) -> None:
    """Each node's approved key and its active record (seq 1, no stream message)."""
    subjects = Subjects(PREFIX)
    trust = subjects.bucket_name(BUCKET_TRUST)
    records = subjects.bucket_name(BUCKET_NODES)
    healthy = _template(gpus, unhealthy=False)
    bus = await NatsBus.connect(url, "bench-fill")
    try:
        for index in range(nodes):
            node, now = node_id(index), time.time()
            entry = TrustEntry(node_id=node, public_key=KEY.public_key, approved_at=now)
            await bus.js.publish_async(f"$KV.{trust}.{node}", codec.encode(entry))
            beat = codec.decode(_body(healthy, index, 1, now), Heartbeat)
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


async def publish_beats(url: str, nodes: int, gpus: int, unhealthy: int) -> None:
    """Each node's heartbeat seq 2, signed; the first ``unhealthy`` nodes unhealthy."""
    subjects = Subjects(PREFIX)
    templates = (_template(gpus, unhealthy=False), _template(gpus, unhealthy=True))
    bus = await NatsBus.connect(url, "bench-beats")
    try:
        for index in range(nodes):
            body = _body(templates[index < unhealthy], index, 2, time.time())
            headers = {
                signing.HEADER_KEY: KEY.public_key,
                signing.HEADER_SIG: base64.b64encode(KEY.sign(body)).decode(),
            }
            subject = subjects.heartbeat("sim", node_id(index))
            await bus.js.publish_async(subject, body, headers=headers)
            if index % BATCH == BATCH - 1:
                await bus.js.publish_async_completed()
        await bus.js.publish_async_completed()
    finally:
        await bus.close()
