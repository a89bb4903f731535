"""Several aggregators on one stream, late deliveries, and offline detection."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator
from typing import Any

import aiohttp
import pytest
from nats.aio.msg import Msg
from prometheus_client.parser import text_string_to_metric_families

from actors.fleet import record_state
from actors.fleet.aggregator import record_rules, sweeps
from actors.fleet.aggregator.actor import AggregatorActor
from actors.fleet.metrics import AggregatorMetrics
from actors.fleet.storage.records import read_record
from actors.fleet.storage.registry import approve
from actors.runtime import kv
from actors.runtime.bus import NatsBus
from schemas import codec, signing
from schemas.messages import NodeRecord
from schemas.subjects import BUCKET_NODES, Subjects
from tests.fleet.test_aggregator import watch_alerts
from tests.support.fleet import (
    TEST_LIMITS,
    Fleet,
    heartbeat,
    new_aggregator,
    new_fleet_api,
    wait_for,
    wait_record,
)


def delivered(
    bus: NatsBus,
    prefix: str,
    body: bytes,
    headers: dict[str, str],
    stream_seq: int,
    stored_ns: int = 0,
) -> Msg:
    """A message as the consumer would deliver it at ``stream_seq``, stored at
    ``stored_ns`` (metadata is parsed from the JetStream ack subject)."""
    stream = Subjects(prefix).stream_name("FLEET_HB")
    reply = f"$JS.ACK.{stream}.agg.1.{stream_seq}.1.{stored_ns}.0"
    return Msg(
        _client=bus.nc,
        subject=Subjects(prefix).stored_heartbeat("c1", "n1", TEST_LIMITS.partitions),
        reply=reply,
        data=body,
        headers=headers,
    )


async def test_late_delivery_is_ignored_but_replay_is_refused(bus: NatsBus, prefix: str) -> None:
    """An older heartbeat delivered after a newer one (lower stream sequence) changes
    nothing and raises nothing; the same body stored again later is a replay."""
    alerts = await watch_alerts(bus, prefix)
    key = signing.KeyPair.generate()
    subjects = Subjects(prefix)
    await approve(bus, subjects, "n1", key.public_key)
    aggregator = new_aggregator(bus, prefix)

    def beat(seq: int) -> tuple[bytes, dict[str, str]]:
        body = codec.encode(heartbeat(seq=seq))
        return body, key.headers(body)

    await aggregator.path.handle(delivered(bus, prefix, *beat(2), stream_seq=20))
    await aggregator.path.handle(delivered(bus, prefix, *beat(1), stream_seq=19))
    assert (await read_record(bus, subjects, "n1")).last_seq == 2
    await bus.flush()
    assert alerts.alerts == []
    late = aggregator.metrics.registry.get_sample_value(
        "fleet_messages_dropped_total", {"reason": "late_delivery"}
    )
    assert late == 1  # counted, so every message of the stream is accounted for

    await aggregator.path.handle(delivered(bus, prefix, *beat(2), stream_seq=21))
    await wait_for(lambda: alerts.of("replay"))
    assert (await read_record(bus, subjects, "n1")).last_stream_seq == 20


async def test_two_aggregators_share_the_work_without_double_alerts(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """Two aggregators keep every node active, raise no replay, and a node's stale
    alert appears once: each holds half the partitions and judges only their nodes."""
    alerts = await watch_alerts(bus, prefix)
    first = await fleet.start_aggregator()
    second = await fleet.start_aggregator(await fleet.connect("second-aggregator"))
    agents = [await fleet.start_agent(fleet.config(node=f"n{i}")) for i in (1, 2, 3)]
    for i in (1, 2, 3):
        await wait_record(bus, prefix, f"n{i}", lambda r: r.state == "active" and r.last_seq >= 6)
    await agents[0].stop(goodbye=False)  # a crash: stale
    await wait_for(lambda: alerts.of("stale"))
    await bus.flush()
    stored = await bus.js.stream_info(Subjects(prefix).stream_name("FLEET_ALERTS"))
    assert len(alerts.of("stale")) == 1 and stored.state.messages >= 1
    assert not alerts.of("replay")
    actors = []
    for supervisor in (first, second):
        actor = supervisor.actors[0]
        assert isinstance(actor, AggregatorActor) and actor.ownership.partitions is not None
        actors.append(actor)
    # The partitions split evenly; each node is in exactly one aggregator's memory.
    assert sorted(
        len(actor.ownership.partitions.held) for actor in actors if actor.ownership.partitions
    ) == [4, 4]
    for node in ("n2", "n3"):
        assert [node in actor.ledger.nodes for actor in actors].count(True) == 1
        assert [actor.ownership.owns(node) for actor in actors].count(True) == 1


async def test_stale_node_goes_offline_then_recovers(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """A node stale for longer than offline_after is offline (one alert); its next
    heartbeat makes it active again with a recovered alert."""
    alerts = await watch_alerts(bus, prefix)
    await fleet.start_aggregator(offline_after=1.0, sweep_interval=0.2)
    agent = await fleet.start_agent()
    await wait_record(bus, prefix, "n1", lambda r: r.state == "active")
    await agent.stop(goodbye=False)  # a crash: stale, then offline
    offline = await wait_record(bus, prefix, "n1", lambda r: r.state == "offline")
    assert offline.stale_since is not None and offline.offline_since is not None
    assert offline.offline_since - offline.stale_since >= 1.0
    await wait_for(lambda: alerts.of("offline"))
    await fleet.start_agent()
    await wait_record(bus, prefix, "n1", lambda r: r.state == "active")
    await wait_for(lambda: alerts.of("recovered"))
    assert len(alerts.of("offline")) == 1


async def test_fleet_http_serves_nodes_and_metrics(fleet: Fleet, bus: NatsBus, prefix: str) -> None:
    """The aggregator's /nodes lists records (with filters), /nodes/<id> gives one, 404
    otherwise, and /metrics counts nodes by state and accepted heartbeats."""
    metrics = AggregatorMetrics()
    fleet_http = new_fleet_api(bus, prefix, metrics)
    await fleet.start_supervisor(new_aggregator(bus, prefix, metrics), fleet_http)
    await fleet.start_agent()
    base = f"http://127.0.0.1:{fleet_http.port}"
    await wait_for(lambda: fleet_http.feed.records.get("n1") is not None)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        async with session.get(f"{base}/nodes?cluster=c1") as response:
            assert [n["node_id"] for n in await response.json()] == ["n1"]
        async with session.get(f"{base}/nodes?state=offline") as response:
            assert await response.json() == []
        async with session.get(f"{base}/nodes/n1") as response:
            assert (await response.json())["cluster"] == "c1"
        async with session.get(f"{base}/nodes/nope") as response:
            assert response.status == 404
        async with session.get(f"{base}/metrics") as response:
            samples = {
                (s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(await response.text())
                for s in family.samples
            }
    state = fleet_http.feed.records["n1"].state
    assert samples[("fleet_nodes", (("state", state),))] == 1
    assert samples[("fleet_heartbeats_accepted_total", ())] >= 1


async def test_full_sweep_finds_nodes_another_aggregator_saw_go_stale(
    bus: NatsBus, prefix: str
) -> None:
    """A stale record this aggregator never saw go stale is found by the full sweep and
    made offline; the frequent sweep alone only checks nodes it saw go stale."""
    alerts = await watch_alerts(bus, prefix)
    subjects = Subjects(prefix)
    stale_long_ago = record_state.with_state(
        record_rules.accept(record_rules.pending_record("n1", "c1"), heartbeat(), "U", 1.0),
        stale_since=time.time() - 60,
    )
    aggregator = new_aggregator(bus, prefix, offline_after=30)
    await aggregator.store.update("n1", lambda _: stale_long_ago)

    await aggregator.sweeps.sweep()
    assert (await read_record(bus, subjects, "n1")).state == "stale"
    await aggregator.sweeps.sweep(everything=True)
    assert (await read_record(bus, subjects, "n1")).state == "offline"
    await wait_for(lambda: alerts.of("offline"))
    assert aggregator.ledger.stale == set()


async def test_a_full_sweep_reads_only_the_records_written_since_the_last(
    bus: NatsBus, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The full sweep takes in records registered through another aggregator reading only
    what was written to fleet_nodes since its last scan: with nothing written, no record
    (every full sweep read the whole bucket: 100,000 records every 2 minutes)."""
    aggregator = new_aggregator(bus, prefix)
    bucket = await bus.kv(Subjects(prefix).bucket_name(BUCKET_NODES))
    for node in ("n0", "n1", "n2"):
        await bucket.put(node, codec.encode(record_rules.pending_record(node, "c1")))
    read: list[str] = []
    scan = kv.latest_pages

    async def counted(*args: Any, **kwargs: Any) -> AsyncGenerator[list[Any]]:
        async with contextlib.aclosing(scan(*args, **kwargs)) as pages:
            async for entries in pages:
                read.extend(node for node, _, _ in entries)
                yield entries

    monkeypatch.setattr(kv, "latest_pages", counted)
    await aggregator.sweeps.sweep(everything=True)
    assert sorted(read) == sorted(aggregator.ledger.nodes) == ["n0", "n1", "n2"]
    read.clear()
    await aggregator.sweeps.sweep(everything=True)
    assert read == []
    await bucket.put("n3", codec.encode(record_rules.pending_record("n3", "c1")))
    await aggregator.sweeps.sweep(everything=True)
    assert read == ["n3"]
    assert "n3" in aggregator.ledger.nodes


async def test_a_full_sweep_looks_only_at_the_nodes_changed_due_or_pending(
    bus: NatsBus, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After the first full sweep (every node), a full sweep looks at the nodes changed
    since and those whose silence rule may hold by now, and at no other (the pending
    ones counted again only when something changed or came due); a node left untouched
    is still marked stale once its time comes."""
    aggregator = new_aggregator(bus, prefix, full_sweep_interval=0.5)
    subjects = Subjects(prefix)
    bucket = await bus.kv(subjects.bucket_name(BUCKET_NODES))
    now = time.time()

    def live(node: str, seen: float, stale_after: float) -> bytes:
        beat = heartbeat(node, stale_after=stale_after)
        return codec.encode(
            record_rules.accept(record_rules.pending_record(node, "c1"), beat, "U", seen)
        )

    await bucket.put("quiet", live("quiet", now, 60.0))  # due in 2 minutes
    await bucket.put("soon", live("soon", now - 12.5, 10.0))  # due in 8 s
    await bucket.put("silent", live("silent", now - 3600, 1.0))
    await bucket.put("new", codec.encode(record_rules.pending_record("new", "c1")))
    await aggregator.reads.load(set(range(TEST_LIMITS.partitions)), TEST_LIMITS.partitions)
    looked: list[str] = []
    pending_expired = sweeps.pending_expired

    def counted(record: NodeRecord, now: float, expire_after: float) -> bool:
        looked.append(record.node_id)
        return pending_expired(record, now, expire_after)

    monkeypatch.setattr(sweeps, "pending_expired", counted)
    await aggregator.sweeps.sweep(everything=True)
    assert sorted(looked) == ["new", "quiet", "silent", "soon"]
    assert (await read_record(bus, subjects, "silent")).state == "stale"
    looked.clear()
    await aggregator.sweeps.sweep(everything=True)
    assert looked == ["silent"]  # written by the sweep before
    looked.clear()
    await aggregator.sweeps.sweep(everything=True)
    assert looked == []
    assert aggregator.ledger.pending.names == 1  # counted without a look at each node
    recount = aggregator.ledger.pending.recount
    counts: list[int] = []
    monkeypatch.setattr(
        aggregator.ledger.pending, "recount", lambda records: counts.append(len(list(records)))
    )
    await aggregator.sweeps.sweep(everything=True)
    assert counts == []  # nothing changed or due: the count stands
    await bucket.put("later", codec.encode(record_rules.pending_record("later", "c1")))
    await aggregator.sweeps.sweep(everything=True)
    assert counts == [2]
    monkeypatch.setattr(aggregator.ledger.pending, "recount", recount)

    async def soon_stale() -> bool:
        await aggregator.sweeps.sweep(everything=True)
        return (await read_record(bus, subjects, "soon")).state == "stale"

    await wait_for(soon_stale, interval=0.5)
    assert "quiet" not in looked
    assert (await read_record(bus, subjects, "quiet")).state != "stale"
