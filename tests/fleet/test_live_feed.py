"""The live feed the fleet process's decisions read: every record in memory from one
watch (or the aggregator beside it), complete only once caught up, and a wake-up for a
reader when a node it names is written."""

from __future__ import annotations

import asyncio
import time

import msgspec

from actors.fleet.aggregator import hot_state, record_rules
from actors.fleet.aggregator.hot_state import NodeState
from actors.fleet.aggregator.view import View
from actors.fleet.live.feed import NodeFeed
from actors.fleet.metrics import AggregatorMetrics
from actors.fleet.storage.registry import approve
from actors.runtime.bus import NatsBus
from schemas import codec
from schemas.messages import NodeRecord, WorkloadSummary
from schemas.subjects import BUCKET_NODES, Subjects
from tests.support.fleet import Fleet, fed, heartbeat, new_aggregator, wait_for, wait_record


def record(node: str, **changes: object) -> NodeRecord:
    base = NodeRecord(node_id=node, cluster="c1", state="active", last_seq=1, last_seen=1.0)
    return msgspec.structs.replace(base, **changes)


async def test_the_feed_mirrors_fleet_nodes_and_wakes_a_reader_for_its_nodes(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """Records written before the watch are there once it is complete, later ones as they
    are written; a reader waiting on n1 is woken by n1's write, not n2's; a write that
    came while the reader was busy (after the number it noted) answers at once."""
    subjects = Subjects(prefix)
    bucket = await bus.kv(subjects.bucket_name(BUCKET_NODES))
    await bucket.put("n1", codec.encode(record("n1")))
    feed = NodeFeed(bus, subjects)
    assert not feed.complete
    await fleet.follow(feed)
    assert feed.complete and feed.record("n1") == record("n1")
    noted = feed.writes
    waiting = asyncio.create_task(feed.changed({"n1"}, timeout=30, since=noted))
    await bucket.put("n2", codec.encode(record("n2")))
    await fed(feed, [record("n2")])
    assert not waiting.done()
    assert not await feed.changed({"n1"}, timeout=0.01, since=feed.writes)
    began = time.monotonic()
    updated = record("n1", last_seq=2)
    await bucket.put("n1", codec.encode(updated))
    assert await waiting, "the write of n1 did not wake its reader"
    took = time.monotonic() - began
    assert took < 5, f"n1's reader woke {took:.1f}s after the write"
    assert feed.record("n1") == updated
    noted = feed.writes
    await bucket.put("n1", codec.encode(record("n1", last_seq=3)))
    await fed(feed, [record("n1", last_seq=3)])
    # Written while the reader was busy: answered at once, from the number it noted.
    assert await feed.changed({"n1"}, timeout=0.01, since=noted)
    assert sorted(feed.whole()) == ["n1", "n2"]


async def test_a_held_nodes_change_reaches_the_feed_at_once_whatever_the_checkpoint(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """Beside an aggregator at the default checkpoint_interval (60 s), a workload turning
    ready on a node it holds is in the feed's record and wakes a reader within seconds
    (the owner writes a change of decision facts at once), and a plain reader of
    fleet_nodes sees it too: not a checkpoint later."""
    aggregator = new_aggregator(bus, prefix, checkpoint_interval=60.0)
    await fleet.start_supervisor(aggregator)
    feed = NodeFeed(bus, Subjects(prefix), aggregator.view, AggregatorMetrics())
    await fleet.follow(feed)
    key = fleet.node_key("n1")
    await approve(bus, Subjects(prefix), "n1", key.public_key)
    stream_subject = Subjects(prefix).heartbeat("c1", "n1")

    async def beat(seq: int, **changes: object) -> None:
        body = codec.encode(heartbeat("n1", seq, **changes))
        await bus.js.publish(stream_subject, body, headers=key.headers(body))

    await beat(1)
    await wait_for(lambda: feed.record("n1") is not None)
    await beat(2)
    await wait_for(lambda: (r := feed.record("n1")) is not None and r.last_seq == 2)
    waiting = asyncio.create_task(feed.changed({"n1"}, timeout=30, since=feed.writes))
    ready = WorkloadSummary(name="w", engine="llamacpp", state="ready", since=1.0, port=1)
    began = time.monotonic()
    await beat(3, workloads=[ready])
    assert await waiting
    took = time.monotonic() - began
    assert took < 5, f"the feed heard of the change {took:.1f}s after the beat"
    whole = feed.record("n1")
    assert whole is not None and whole.heartbeat is not None
    assert [w.state for w in whole.heartbeat.workloads] == ["ready"]
    stored = await wait_record(
        bus, prefix, "n1", lambda r: r.heartbeat is not None and bool(r.heartbeat.workloads), 5
    )
    assert stored.last_seq == 3


class Compared(str):
    """A node's name that counts the times it is compared for equality."""

    compares = 0

    def __eq__(self, other: object) -> bool:
        Compared.compares += 1
        return str.__eq__(self, other)

    __hash__ = str.__hash__


async def test_every_node_is_listed_without_searching_the_held_names_for_each_other(
    bus: NatsBus, prefix: str
) -> None:
    """The feed's every node (what the policy's first round and the placement's walk
    read): the held ones, then the others, each other one told from the held by the
    aggregator's table, not by searching a list of the held names (300 x 300 compares
    here; 50,000 x 50,000 held the event loop for about 15 s)."""
    table = hot_state.NodeTable()
    base = record_rules.pending_record("h", "c1")
    for i in range(300):
        table[f"held-{i}"] = NodeState(base, written=0.0)
    feed = NodeFeed(bus, Subjects(prefix), View(table), AggregatorMetrics())
    others = [Compared(f"other-{i}") for i in range(300)]
    for node in others:
        feed.records.raw[node] = b"{}"
    Compared.compares = 0
    listed = feed.nodes()
    assert listed == [f"held-{i}" for i in range(300)] + others
    assert Compared.compares < 300 * 2, f"{Compared.compares:,} compares"
