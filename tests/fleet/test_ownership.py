"""Partition ownership: N partitions of FLEET_HB split between aggregators, each consumed
by exactly one at a time; a killed or stopped aggregator's partitions pass to the others
within a few lease ttls, an added one takes its share, and no heartbeat is judged twice,
no alert lost or raised twice across a handover."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager
from types import SimpleNamespace
from typing import Any

import pytest
from nats.js.kv import KeyValue

from actors.fleet.aggregator import lease, record_rules
from actors.fleet.aggregator.actor import AggregatorActor
from actors.fleet.live import feed as fleet_feed
from actors.fleet.storage.registry import approve
from actors.runtime import kv
from actors.runtime.bus import NatsBus
from actors.runtime.schedule import stop_if_cancelled
from actors.runtime.supervisor import Supervisor
from schemas import codec, signing
from schemas.messages import NodeRecord
from schemas.subjects import BUCKET_NODES, STREAM_ALERTS, Subjects, partition_of
from tests.fleet.test_aggregator import watch_alerts
from tests.support.fleet import (
    TEST_BUDGETS,
    TEST_LIMITS,
    Fleet,
    heartbeat,
    new_aggregator,
    new_fleet_api,
    wait_for,
)

TTL = TEST_BUDGETS.lease_ttl
N = TEST_LIMITS.partitions
NODES = [f"node-{i:02d}" for i in range(16)]
INTERVAL = 0.25


def actor_of(supervisor: Supervisor) -> AggregatorActor:
    actor = supervisor.actors[0]
    assert isinstance(actor, AggregatorActor)
    return actor


def held(actor: AggregatorActor) -> set[int]:
    return set(actor.ownership.partitions.held) if actor.ownership.partitions is not None else set()


def split(actors: list[AggregatorActor]) -> list[int]:
    """How many partitions each aggregator holds, sorted."""
    return sorted(len(held(actor)) for actor in actors)


def served(actors: list[AggregatorActor]) -> bool:
    """Every partition held by exactly one of ``actors`` and consumed (its work runs)."""
    owners = [p for actor in actors for p in held(actor) if p in actor.ownership.work]
    return sorted(owners) == list(range(N))


class Nodes:
    """NODES beating from the test as agents would: approved keys, one signed heartbeat
    per node every INTERVAL (seq + 1, Nats-TTL 2 s, a fresh Nats-Msg-Id)."""

    def __init__(self, bus: NatsBus, prefix: str) -> None:
        self.bus = bus
        self.subjects = Subjects(prefix)
        self.keys = {node: signing.KeyPair.generate() for node in NODES}
        self.seq = dict.fromkeys(NODES, 0)
        self.stopped: set[str] = set()
        self.sent: dict[str, list[tuple[bytes, dict[str, str]]]] = {node: [] for node in NODES}

    async def approve(self) -> None:
        for node, key in self.keys.items():
            await approve(self.bus, self.subjects, node, key.public_key)

    async def beat(self) -> None:
        for node in NODES:
            if node in self.stopped:
                continue
            self.seq[node] += 1
            body = codec.encode(heartbeat(node, self.seq[node]))
            signed = self.keys[node].headers(body)
            self.sent[node].append((body, signed))
            headers = {**signed, "Nats-Msg-Id": os.urandom(8).hex(), "Nats-TTL": "2"}
            await self.bus.js.publish(self.subjects.heartbeat("c1", node), body, headers=headers)

    @asynccontextmanager
    async def beating(self) -> AsyncIterator[None]:
        async def forever() -> None:
            while True:
                # Each beat awaits 16 publishes, which nats-py awaits with wait_for: a
                # cancel that lands as an answer comes is lost (Python 3.11; CI hung here).
                stop_if_cancelled()
                await self.beat()
                await asyncio.sleep(INTERVAL)

        task = asyncio.create_task(forever())
        try:
            yield
        finally:
            task.cancel()
            [outcome] = await asyncio.gather(task, return_exceptions=True)
            if isinstance(outcome, Exception):
                raise outcome  # the beating stopped early: say why


class RecordLog:
    """Every write to fleet_nodes of each node, in order (a KV watch)."""

    def __init__(self) -> None:
        self.seqs: dict[str, list[tuple[int, str, str]]] = {}
        self.records: dict[str, NodeRecord] = {}

    def on_change(self, node: str, record: NodeRecord | None) -> None:
        if record is None:
            return
        self.seqs.setdefault(node, []).append((record.last_seq, record.state, record.refused))
        self.records[node] = record

    def in_order(self) -> bool:
        """No node's record ever went back, and none was written twice in a row with the
        same seq and state (each heartbeat's update happened once, in order; a seq
        written again is a state change, e.g. stale)."""
        return all(
            all(a[0] <= b[0] and a != b for a, b in itertools.pairwise(seqs))
            for seqs in self.seqs.values()
        )

    def current(self, nodes: Nodes, slack: int = 8) -> bool:
        return all(
            node in self.records and self.records[node].last_seq >= nodes.seq[node] - slack
            for node in NODES
            if node not in nodes.stopped
        )


@asynccontextmanager
async def recording(bus: NatsBus, prefix: str) -> AsyncIterator[RecordLog]:
    log = RecordLog()
    bucket = await bus.kv(Subjects(prefix).bucket_name(BUCKET_NODES))
    task = asyncio.create_task(kv.follow(bucket, NodeRecord, log.on_change))
    try:
        yield log
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


CHECKPOINT = 0.5
"""These tests follow the records each owner checkpoints (every seq written, in order,
across handovers): they are about checkpoints, so they checkpoint often."""


async def start(fleet: Fleet, count: int) -> tuple[list[AggregatorActor], list[NatsBus]]:
    buses = [await fleet.connect(f"aggregator-{i}") for i in range(count)]
    actors = [
        actor_of(await fleet.start_aggregator(bus, checkpoint_interval=CHECKPOINT)) for bus in buses
    ]
    return actors, buses


async def stored_alerts(bus: NatsBus, prefix: str, kind: str) -> dict[str, int]:
    """Alerts of ``kind`` stored in FLEET_ALERTS, counted by node."""
    subjects = Subjects(prefix)
    info = await bus.js.stream_info(
        subjects.stream_name(STREAM_ALERTS), subjects_filter=subjects.alerts_of(kind, "c1")
    )
    return {
        subject.rsplit(".", 1)[-1]: count for subject, count in (info.state.subjects or {}).items()
    }


@pytest.mark.slow
async def test_two_then_three_aggregators_split_evenly_and_an_added_one_rebalances(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """One aggregator holds every partition; a second added takes half (4/4) by the
    first's clean releases, a third makes it 3/3/2; every node keeps being served, and
    every node's record is written in seq order, never twice for one seq."""
    nodes = Nodes(bus, prefix)
    await nodes.approve()
    async with recording(bus, prefix) as records, nodes.beating():
        first, _ = await start(fleet, 1)
        await wait_for(lambda: split(first) == [N] and served(first))
        await wait_for(lambda: records.current(nodes))
        second, _ = await start(fleet, 1)
        added = time.monotonic()  # once it runs: its start (connect, provision) not timed
        actors = first + second
        await wait_for(lambda: split(actors) == [4, 4] and served(actors), timeout=4 * TTL)
        # Released cleanly, so the newcomer takes them without waiting out a ttl.
        assert time.monotonic() - added < 3 * TTL
        third, _ = await start(fleet, 1)
        actors += third
        await wait_for(lambda: split(actors) == [2, 3, 3] and served(actors), timeout=4 * TTL)
        for node in NODES:  # each node owned by exactly one aggregator
            assert [actor.ownership.owns(node) for actor in actors].count(True) == 1
        mark = dict(nodes.seq)
        await wait_for(lambda: all(records.records[n].last_seq > mark[n] for n in NODES))
    assert set(records.seqs) == set(NODES) and records.in_order(), records.seqs


@pytest.mark.slow
async def test_killed_aggregator_partitions_pass_on_and_stale_alerts_are_raised_once(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """Three aggregators; one's connection dropped (as good as SIGKILL: no release, the
    fence path) while four nodes stop beating: the two left serve every partition
    within a few ttls, a newcomer then takes its share at once, every stopped node has
    exactly one stale alert stored in FLEET_ALERTS and the others none, no replay or
    gap alert, records in order."""
    alerts = await watch_alerts(bus, prefix)
    nodes = Nodes(bus, prefix)
    await nodes.approve()
    async with recording(bus, prefix) as records, nodes.beating():
        actors, buses = await start(fleet, 3)
        await wait_for(lambda: split(actors) == [2, 3, 3] and served(actors), timeout=6 * TTL)
        await wait_for(lambda: records.current(nodes))
        victim = max(actors, key=lambda actor: len(held(actor)))
        # Stop nodes of the victim's partitions (their markers fire during the handover)
        # and others.
        doomed = [n for n in NODES if victim.ownership.owns(n)][:2] + [
            n for n in NODES if not victim.ownership.owns(n)
        ][:2]
        assert len(doomed) == 4
        nodes.stopped.update(doomed)
        killed = time.monotonic()
        await buses[actors.index(victim)].nc.close()
        rest = [actor for actor in actors if actor is not victim]
        await wait_for(lambda: split(rest) == [4, 4] and served(rest), timeout=6 * TTL)
        handover = time.monotonic() - killed
        assert handover < 4 * TTL, handover
        # A newcomer after the kill takes its share at once: the killed one's member key,
        # unrenewed for over a ttl, does not count as a live aggregator.
        newcomer, _ = await start(fleet, 1)
        added = time.monotonic()  # once it runs: its start (connect, provision) not timed
        rest += newcomer
        await wait_for(lambda: split(rest) == [2, 3, 3] and served(rest), timeout=4 * TTL)
        assert time.monotonic() - added < 2 * TTL
        await wait_for(lambda: len(alerts.of("stale")) >= len(doomed))
        mark = dict(nodes.seq)
        await wait_for(
            lambda: all(
                records.records[n].last_seq > mark[n] for n in NODES if n not in nodes.stopped
            ),
        )
    await bus.flush()
    stored = await stored_alerts(bus, prefix, "stale")
    assert stored == dict.fromkeys(doomed, 1), stored
    assert sorted(alert.node_id for alert in alerts.of("stale")) == sorted(doomed)
    assert not alerts.of("replay") and not alerts.of("sequence_gap")
    assert set(records.seqs) == set(NODES) and records.in_order(), records.seqs


@pytest.mark.slow
async def test_clean_stop_hands_over_at_once_and_an_old_heartbeat_replayed_is_refused(
    fleet: Fleet, bus: NatsBus, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Two aggregators; one stopped cleanly releases its partitions, so the other takes
    each one as a free key, none by waiting out its lease, and serves all of them soon
    after the stop. A heartbeat captured before the handover and
    republished after it (a fresh Nats-Msg-Id) is older than the checkpoint the new
    owner resumed from: refused as a replay, the record keeps its newer seq."""
    alerts = await watch_alerts(bus, prefix)
    nodes = Nodes(bus, prefix)
    await nodes.approve()
    buses = [await fleet.connect(f"aggregator-{i}") for i in range(2)]
    # It follows the records written (checkpoints): at the default 60 s a record taken
    # over falls due anywhere in the next minute, as long as the wait for it.
    supervisors = [await fleet.start_aggregator(b, checkpoint_interval=CHECKPOINT) for b in buses]
    actors = [actor_of(s) for s in supervisors]
    async with recording(bus, prefix) as records, nodes.beating():
        await wait_for(lambda: split(actors) == [4, 4] and served(actors), timeout=6 * TTL)
        await wait_for(lambda: records.current(nodes))
        leaving, staying = actors
        node = next(n for n in NODES if leaving.ownership.owns(n))
        captured = nodes.sent[node][-1]
        old_seq = nodes.seq[node]
        caplog.set_level(logging.WARNING, logger=lease.__name__)
        logged = len(caplog.records)
        await supervisors[0].stop()  # its leases are released (deleted) when this returns
        stopped = time.monotonic()
        await wait_for(lambda: split([staying]) == [N] and served([staying]), timeout=4 * TTL)
        # No time bound tells a release from an expiry: one can come as soon as ttl / 2
        # after the stop (the last renewal up to ttl / 3 + ttl / 8 before it). What does:
        # an expired lease is taken over by an update, which says so in a warning; a
        # released one is created anew, silently.
        taken_over = [
            r for r in caplog.records[logged:] if r.getMessage() == "heartbeat lease taken over"
        ]
        assert taken_over == [], "a lease was waited out, not released at the stop"
        assert time.monotonic() - stopped < 2 * TTL  # a round of the balancer, and a load
        await wait_for(lambda: records.records[node].last_seq > old_seq + 2)
        # The node stops beating first: FLEET_HB keeps one message a node, and a newer
        # beat stored before the owner fetched the replayed one would replace it unread
        # (as on a loaded machine). A whole round of the others' beats after the stop,
        # none of its own is in flight.
        nodes.stopped.add(node)
        other = next(n for n in NODES if n != node)
        mark = nodes.seq[other]
        await wait_for(lambda: nodes.seq[other] >= mark + 2)
        body, signed = captured
        headers = {**signed, "Nats-Msg-Id": os.urandom(8).hex(), "Nats-TTL": "2"}
        await bus.js.publish(Subjects(prefix).heartbeat("c1", node), body, headers=headers)
        await wait_for(lambda: [a for a in alerts.of("replay") if a.node_id == node])
        assert node in staying.ledger.nodes and staying.ledger.nodes[node].record.last_seq > old_seq
    assert set(records.seqs) == set(NODES) and records.in_order(), records.seqs
    assert records.records[node].last_seq > old_seq


async def test_fleet_api_beside_an_aggregator_holding_every_partition_follows_no_watch(
    fleet: Fleet, bus: NatsBus, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The HTTP API beside an aggregator takes in no record of fleet_nodes during the
    aggregator's load (slowed here to a second a page), where it would only drop them,
    nor after it while that aggregator holds every partition: every record is then of a
    node it holds, and the watch would take in each of its writes only to drop it. The
    server has no consumer on the bucket's stream, and every node is listed."""
    nodes = [f"rec-{i:03d}" for i in range(300)]
    bucket = await bus.kv(Subjects(prefix).bucket_name(BUCKET_NODES))
    for node in nodes:
        await bucket.put(node, codec.encode(record_rules.pending_record(node, "c1", "K")))
    real_pages = kv.latest_pages

    async def slow_pages(
        *args: Any, **kwargs: Any
    ) -> AsyncIterator[list[tuple[str, bytes | None, int]]]:
        # Every scan of the bucket, the full sweeps' ones since a revision too (a sweep
        # falls in this test's window on a slow machine).
        async with aclosing(real_pages(*args, **kwargs)) as pages:
            async for page in pages:
                await asyncio.sleep(1.0)
                yield page

    monkeypatch.setattr(kv, "latest_pages", slow_pages)
    aggregator = new_aggregator(bus, prefix)
    api = new_fleet_api(bus, prefix, aggregator.metrics, live=aggregator.view)
    during_load: list[str] = []
    after_load: list[str] = []
    real_follow = kv.follow

    async def counted_follow(
        watched: KeyValue, kind: Any, on_change: Callable[[str, Any], None], **rest: Any
    ) -> None:
        def counted(node: str, value: Any) -> None:
            (during_load if aggregator.ledger.nodes.loading else after_load).append(node)
            on_change(node, value)

        await real_follow(watched, kind, counted, **rest)

    monkeypatch.setattr(fleet_feed, "kv", SimpleNamespace(follow=counted_follow))
    await fleet.start_supervisor(api, aggregator)
    await wait_for(lambda: set(api.current()) == set(nodes))
    assert aggregator.ledger.nodes.everything
    checks = 0
    everything = api.feed._everything

    def counted_check() -> bool:
        nonlocal checks
        checks += 1
        return everything()

    monkeypatch.setattr(api.feed, "_everything", counted_check)
    await wait_for(lambda: checks >= 3)  # three more of the API's resync checks
    assert during_load == [] and after_load == []
    stream = f"KV_{Subjects(prefix).bucket_name(BUCKET_NODES)}"
    assert (await bus.js.stream_info(stream)).state.consumer_count == 0


@pytest.mark.slow
async def test_fleet_api_beside_an_aggregator_still_lists_the_nodes_of_a_partition_it_lost(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """The HTTP API beside an aggregator answers from its in-memory records and skips
    their KV copies; when the aggregator loses a partition (its lease fenced: nothing
    written on the way out), that partition's nodes are read from fleet_nodes again at
    once, not at the next owner's checkpoint (here: nobody claims it for 30 s and
    checkpoints are 120 s apart, so only the re-read can bring them back)."""
    nodes = Nodes(bus, prefix)
    await nodes.approve()
    slow = {"checkpoint_interval": 120.0, "lease_ttl": 30.0}
    async with nodes.beating():
        aggregator = actor_of(await fleet.start_aggregator(await fleet.connect("agg"), **slow))
        api = new_fleet_api(bus, prefix, aggregator.metrics, live=aggregator.view)
        await fleet.start_supervisor(api)
        await wait_for(lambda: split([aggregator]) == [N] and served([aggregator]))
        await wait_for(lambda: set(aggregator.ledger.nodes) == set(NODES))
        await wait_for(lambda: set(api.current()) == set(NODES))
        assert api.feed.records.raw == {}  # every node answered from memory
        lost = partition_of(NODES[0], N)
        assert aggregator.ownership.partitions is not None
        await aggregator.ownership.partitions._drop({lost})
        assert NODES[0] not in aggregator.ledger.nodes
        await wait_for(lambda: set(api.current()) == set(NODES))
        assert NODES[0] in api.feed.records.raw
