"""Latency prober: probe answering, RTT and loss, peer discovery, and staying off the
heartbeat path (a hung engine or a silent peer never delays a heartbeat)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from aiohttp import web
from nats.aio.msg import Msg

from actors.node.latency import BUSY_LATE, LOSS_WINDOW, LatencyActor
from actors.runtime.bus import NatsBus
from actors.runtime.schedule import RateLimit
from schemas import codec
from schemas.base import RecordState
from schemas.events import Latency
from schemas.messages import NodeRecord
from schemas.subjects import BUCKET_NODES, EVENT_LATENCY, Subjects
from tests.support.fleet import Fleet, node_events, wait_for, wait_record


def prober(fleet: Fleet, node: str, **settings: Any) -> LatencyActor:
    config = fleet.config(node, **settings)
    return LatencyActor(config, fleet.bus, node_events(config))


async def silent_peer(bus: NatsBus, prefix: str, node: str) -> None:
    """Subscribe as ``node`` on the probe subject and never answer (a hung peer)."""

    async def swallow(msg: Msg) -> None:
        return None

    await bus.subscribe(Subjects(prefix).probe(node), swallow)


async def test_probes_are_answered_and_silent_peers_count_as_loss(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """A live peer yields an RTT and 0% loss; a silent one no RTT and 100% loss; the
    NATS round trip is measured too, and overall loss averages both."""
    got: list[Latency] = []

    async def collect(msg: Msg) -> None:
        got.append(codec.decode(msg.data, Latency, msg.subject))

    await bus.subscribe(Subjects(prefix).event("n1", EVENT_LATENCY), collect)
    await silent_peer(bus, prefix, "ghost")
    await bus.flush()
    # A timeout generous for a loaded machine: a live peer's answer is never counted lost.
    settings: dict[str, Any] = dict(probe_interval=0.2, probe_timeout=2.0)
    await fleet.start_supervisor(
        prober(fleet, "n1", peers=["n2", "ghost"], **settings),
        prober(fleet, "n2", peers=[], max_peers=0, **settings),
    )
    await wait_for(lambda: len(got) >= 2)  # the ghost costs 2 s a round
    latest = got[-1]
    peers = {peer.target_node_id: peer for peer in latest.peers}
    assert peers["n2"].rtt_us is not None and peers["n2"].loss_pct == 0.0
    assert peers["ghost"].rtt_us is None and peers["ghost"].loss_pct == 100.0
    assert latest.avg_peer_rtt_us == peers["n2"].rtt_us
    assert latest.gateway_rtt_us is not None and latest.gateway_rtt_us > 0
    assert latest.loss_pct == 50.0


async def test_loss_is_over_a_sliding_window(fleet: Fleet, bus: NatsBus, prefix: str) -> None:
    """Loss counts only the last LOSS_WINDOW probes, so an old outage ages out."""
    actor = prober(fleet, "n1", peers=["n2"], probe_timeout=2.0)
    for _ in range(2):  # nobody answers as n2 yet
        await actor.measure()
    answering = prober(fleet, "n2")
    # Back-to-back rounds here, far above the answers one asker gets a second.
    answering.answers_per_asker = RateLimit(4 * LOSS_WINDOW, 1.0)
    await fleet.start_supervisor(answering, ready_timeout=5)
    for _ in range(2):
        latest = await actor.measure()
    assert latest.peers[0].loss_pct == 50.0
    for _ in range(LOSS_WINDOW):
        latest = await actor.measure()
    assert latest.peers[0].loss_pct == 0.0 and latest.loss_pct == 0.0


def block_loop_after_publish(monkeypatch: pytest.MonkeyPatch, bus: NatsBus, block: float) -> None:
    """Each publish on ``bus`` then holds the event loop for ``block`` seconds: this
    agent's own loop too busy to read an answer in time (a CPU-bound stretch, simulated)."""
    publish = bus.publish

    async def busy_publish(subject: str, data: bytes, **kwargs: Any) -> None:
        await publish(subject, data, **kwargs)
        time.sleep(block)  # noqa: ASYNC251  # holds the loop on purpose: what is simulated

    monkeypatch.setattr(bus, "publish", busy_publish)


async def test_a_probe_late_for_a_busy_loop_is_not_a_loss(
    fleet: Fleet, bus: NatsBus, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While this agent's loop is held past the probe's timeout, an answer that came meanwhile
    counts as answered, a silent peer's probe is not judged (no loss), and once the loop is
    free again the silent peer's probes count as lost."""
    await silent_peer(bus, prefix, "ghost")
    answering = prober(fleet, "n2")
    await fleet.start_supervisor(answering, ready_timeout=5)
    actor = prober(fleet, "n1", peers=["n2", "ghost"], probe_timeout=0.3)
    with monkeypatch.context() as patched:
        block_loop_after_publish(patched, bus, 0.3 + 2 * BUSY_LATE)
        busy = {peer.target_node_id: peer for peer in (await actor.measure()).peers}
    assert busy["n2"].rtt_us is not None and busy["n2"].loss_pct == 0.0
    assert busy["ghost"].rtt_us is None and busy["ghost"].loss_pct == 0.0
    idle = {peer.target_node_id: peer for peer in (await actor.measure()).peers}
    assert idle["ghost"].loss_pct == 100.0 and idle["n2"].loss_pct == 0.0


async def test_discovers_live_peers_of_its_own_cluster(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """Without configured peers, peers are nodes of the same cluster from fleet_nodes,
    excluding itself, other clusters, pending, offline, stale, stopped and deleted nodes
    (none can answer), and records filed under another node's key, at most max_peers."""
    subjects = Subjects(prefix)
    nodes = await bus.kv(subjects.bucket_name(BUCKET_NODES))
    rows: list[tuple[str, str, RecordState]] = [
        ("n1", "c1", "active"),
        ("n2", "c1", "active"),
        ("n3", "c1", "offline"),
        ("n4", "c2", "active"),
        ("n5", "c1", "degraded"),
        ("n6", "c1", "pending"),
        ("n7", "c1", "active"),
        ("n9", "c1", "stale"),
        ("n10", "c1", "stopped"),
    ]
    for node, cluster, state in rows:
        record = NodeRecord(
            node_id=node, cluster=cluster, state=state, last_seq=1, last_seen=time.time()
        )
        await nodes.put(node, codec.encode(record))
    await nodes.delete("n7")
    await nodes.put(
        "n8",
        codec.encode(
            NodeRecord(
                node_id="n2", cluster="c1", state="active", last_seq=1, last_seen=time.time()
            )
        ),
    )
    actor = prober(fleet, "n1")
    assert sorted(await actor.discover()) == ["n2", "n5"]
    limited = prober(fleet, "n1", max_peers=1)
    assert len(await limited.discover()) == 1


async def test_hung_engine_and_silent_peer_never_delay_heartbeats(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """With an engine that never answers and a peer that never answers (5 s timeouts),
    heartbeats still arrive at the configured 0.5 s rate."""

    async def hang(request: web.Request) -> web.Response:
        await asyncio.sleep(30)
        return web.Response()

    await silent_peer(bus, prefix, "ghost")
    await fleet.start_aggregator()
    hung = await fleet.serve({"/health": hang})
    config = fleet.config(
        engines=[f"vllm={hung}"],
        engine_timeout=5.0,
        engine_interval=0.5,
        peers=["ghost"],
        probe_timeout=5.0,
        probe_interval=0.5,
    )
    await fleet.start_agent(config)
    first = await wait_record(bus, prefix, "n1", lambda r: r.last_seq >= 1)
    started = time.monotonic()
    beats = 6  # 3 s at the normal rate; a blocked heartbeat would need 30 s

    def after(record: NodeRecord) -> bool:
        return record.last_seq >= first.last_seq + beats

    await wait_record(bus, prefix, "n1", after)
    elapsed = time.monotonic() - started
    assert elapsed < 8.0, f"{beats} heartbeats took {elapsed:.1f}s"
