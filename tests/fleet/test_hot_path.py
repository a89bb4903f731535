"""The aggregator's hot path: acceptance state in memory, records written on state
changes and checkpoints, exact replay protection across an owner change."""

from __future__ import annotations

import asyncio
import contextlib
import math
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import nats
import pytest
from nats.aio.msg import Msg

from actors.fleet import record_state
from actors.fleet.aggregator import hot_state, reads, record_rules, sweeps
from actors.fleet.aggregator.actor import JUDGED_PER_TURN, AggregatorActor
from actors.fleet.aggregator.hot_state import CheckpointQueue, NodeState
from actors.fleet.aggregator.sweep_queue import SweepQueue
from actors.fleet.storage.records import read_record
from actors.fleet.storage.registry import NotFound, approve, forget
from actors.runtime import kv
from actors.runtime.batch_pull import Step, delivery
from actors.runtime.bus import Bus, NatsBus
from actors.runtime.embedded import NatsServer
from actors.runtime.supervisor import Supervisor
from schemas import codec, signing
from schemas.errors import InvalidToken
from schemas.events import Health
from schemas.messages import Heartbeat, NodeRecord
from schemas.subjects import BUCKET_NODES, Subjects, partition_of
from tests.fleet.test_aggregator import publish, watch_alerts
from tests.fleet.test_aggregators import delivered
from tests.support.fleet import TEST_LIMITS, Fleet, heartbeat, new_aggregator, wait_for


def aggregator_of(supervisor: Supervisor) -> AggregatorActor:
    actor = supervisor.actors[0]
    assert isinstance(actor, AggregatorActor)
    return actor


def count(actor: AggregatorActor, name: str) -> float:
    return actor.metrics.registry.get_sample_value(name) or 0.0


async def stored_seq(bus: NatsBus, prefix: str) -> int:
    """n1's last seq in fleet_nodes; 0 while it has no record."""
    try:
        return (await read_record(bus, Subjects(prefix), "n1")).last_seq
    except NotFound:
        return 0


async def beat(
    bus: NatsBus, prefix: str, key: signing.KeyPair, seq: int, **changes: object
) -> None:
    beat = msgspec.structs.replace(heartbeat(seq=seq, stale_after=60.0, interval=30.0), **changes)
    body = codec.encode(beat)
    # Its TTL is the stale_after it claims, as an agent's: a 2 s one expired unjudged
    # behind an aggregator still starting on a busy machine (a busy run's failure).
    await publish(bus, prefix, body, key.headers(body), ttl=math.ceil(beat.stale_after))


async def beat_until_checkpointed(
    bus: NatsBus, prefix: str, key: signing.KeyPair, owner: Supervisor, last: int
) -> None:
    """n1 beats seqs 1..``last``, each once the one before was accepted by ``owner`` (a
    heartbeat replaced in FLEET_HB before it was read would be a sequence gap), until
    fleet_nodes holds ``last``."""
    for seq in range(1, last + 1):
        await beat(bus, prefix, key, seq)

        def accepted(seq: int = seq) -> bool:
            state = aggregator_of(owner).ledger.nodes.get("n1")
            return state is not None and state.record.last_seq == seq

        await wait_for(accepted)

    async def checkpointed() -> bool:
        return await stored_seq(bus, prefix) == last

    await wait_for(checkpointed)


async def test_steady_heartbeats_are_not_written_one_by_one(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """Heartbeats that change nothing cost one write (the node becoming active); the
    live record has the last seq at once, fleet_nodes only a state change later, which
    is written at once."""
    key = signing.KeyPair.generate()
    await approve(bus, Subjects(prefix), "n1", key.public_key)
    actor = aggregator_of(await fleet.start_aggregator(checkpoint_interval=120.0))
    await beat(bus, prefix, key, 1)

    async def first_written() -> bool:
        return await stored_seq(bus, prefix) == 1

    await wait_for(first_written)
    for seq in range(2, 11):
        # One at a time: FLEET_HB keeps one heartbeat per node, and one replaced unread
        # would be a sequence gap (an alert, so a write).
        await beat(bus, prefix, key, seq)

        def accepted(seq: int = seq) -> bool:
            return actor.ledger.nodes["n1"].record.last_seq == seq

        await wait_for(accepted)
    assert count(actor, "fleet_heartbeats_accepted_total") == 10
    assert actor.ledger.nodes["n1"].dirty
    assert count(actor, "fleet_record_writes_total") == 1
    assert await stored_seq(bus, prefix) == 1

    sick = Health(ts=time.time(), status="unhealthy", score=10)
    await beat(bus, prefix, key, 11, health=sick)

    async def written() -> bool:
        record = await read_record(bus, Subjects(prefix), "n1")
        return record.state == "unhealthy" and record.last_seq == 11

    await wait_for(written)
    assert count(actor, "fleet_record_writes_total") == 2


async def test_checkpoint_writes_the_newest_record(fleet: Fleet, bus: NatsBus, prefix: str) -> None:
    """A node that only keeps beating has its newest record in fleet_nodes within about
    one checkpoint interval."""
    key = signing.KeyPair.generate()
    await approve(bus, Subjects(prefix), "n1", key.public_key)
    await fleet.start_aggregator(checkpoint_interval=1.0)
    for seq in range(1, 6):
        await beat(bus, prefix, key, seq)

    async def checkpointed() -> bool:
        return await stored_seq(bus, prefix) == 5

    last_beat = time.monotonic()
    await wait_for(checkpointed)
    took = time.monotonic() - last_beat
    assert took < 5.0, f"the newest record reached fleet_nodes {took:.1f}s after the last beat"


async def test_new_owner_resumes_from_the_checkpoint_and_refuses_older_replays(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """An owner change (the aggregator stopped, another started) starts from fleet_nodes:
    a heartbeat older than the checkpoint is refused as a replay, the node's next one is
    accepted without a false sequence_gap alert though the old owner had accepted
    heartbeats it never checkpointed."""
    alerts = await watch_alerts(bus, prefix)
    key = signing.KeyPair.generate()
    await approve(bus, Subjects(prefix), "n1", key.public_key)
    first = await fleet.start_aggregator(checkpoint_interval=0.5)
    await beat_until_checkpointed(bus, prefix, key, first, 5)
    await first.stop()
    second = aggregator_of(await fleet.start_aggregator(checkpoint_interval=0.5))
    await wait_for(lambda: "n1" in second.ledger.nodes)  # the lease taken, the records loaded
    assert second.ledger.nodes["n1"].record.last_seq == 5
    await beat(bus, prefix, key, 3)  # captured earlier, published again
    await wait_for(lambda: alerts.of("replay"))
    await beat(bus, prefix, key, 8)
    await wait_for(lambda: second.ledger.nodes["n1"].record.last_seq == 8)
    await bus.flush()
    assert not alerts.of("sequence_gap")
    assert [alert.details.get("seq") for alert in alerts.of("replay")] == ["3"]


async def test_redelivered_heartbeat_is_not_a_replay(bus: NatsBus, prefix: str) -> None:
    """The same stored message delivered again (same stream sequence: a failover before
    its ack) is recognised as seen, not alerted on as a replay."""
    alerts = await watch_alerts(bus, prefix)
    key = signing.KeyPair.generate()
    await approve(bus, Subjects(prefix), "n1", key.public_key)
    aggregator = new_aggregator(bus, prefix)
    body = codec.encode(heartbeat(seq=1))
    await aggregator.path.handle(delivered(bus, prefix, body, key.headers(body), stream_seq=7))
    await aggregator.path.handle(delivered(bus, prefix, body, key.headers(body), stream_seq=7))
    await bus.flush()
    assert alerts.of("replay") == []
    late = aggregator.metrics.registry.get_sample_value(
        "fleet_messages_dropped_total", {"reason": "late_delivery"}
    )
    assert late == 1


async def test_a_heartbeat_judged_before_is_dropped_before_its_signature_is_checked(
    bus: NatsBus, prefix: str
) -> None:
    """A message stored no later than the node's last accepted one (same or lower stream
    sequence, same or earlier time) is dropped as a late delivery without its signature
    checked: here its signature is broken, and no bad_signature alert comes."""
    alerts = await watch_alerts(bus, prefix)
    key = signing.KeyPair.generate()
    await approve(bus, Subjects(prefix), "n1", key.public_key)
    aggregator = new_aggregator(bus, prefix)
    stored = time.time_ns()
    body = codec.encode(heartbeat(seq=2))
    await aggregator.path.handle(delivered(bus, prefix, body, key.headers(body), 7, stored))
    older = codec.encode(heartbeat(seq=1))
    broken = {**key.headers(older), signing.HEADER_SIG: key.headers(body)[signing.HEADER_SIG]}
    for stream_seq, stored_ns in ((7, stored), (6, stored - 10**9)):
        await aggregator.path.handle(delivered(bus, prefix, older, broken, stream_seq, stored_ns))
    await bus.flush()
    assert alerts.of("bad_signature") == [] and alerts.of("replay") == []
    late = aggregator.metrics.registry.get_sample_value(
        "fleet_messages_dropped_total", {"reason": "late_delivery"}
    )
    assert late == 2
    assert aggregator.ledger.nodes["n1"].record.last_seq == 2
    # Stored later under a lower sequence: not judged before (see the next test).
    await aggregator.path.handle(delivered(bus, prefix, older, broken, 6, stored + 10**9))
    await wait_for(lambda: alerts.of("bad_signature"))


async def test_a_heartbeat_stream_made_again_does_not_lock_nodes_out(
    bus: NatsBus, prefix: str
) -> None:
    """FLEET_HB deleted and made again numbers its messages from 1 again: a node's next
    heartbeat, at a stream sequence below its record's but stored later, is accepted."""
    key = signing.KeyPair.generate()
    await approve(bus, Subjects(prefix), "n1", key.public_key)
    aggregator = new_aggregator(bus, prefix)
    stored = time.time_ns()
    for seq, stream_seq, stored_ns in ((1, 500, stored), (2, 3, stored + 10**9)):
        body = codec.encode(heartbeat(seq=seq))
        await aggregator.path.handle(
            delivered(bus, prefix, body, key.headers(body), stream_seq, stored_ns)
        )
    record = aggregator.ledger.nodes["n1"].record
    assert (record.last_seq, record.last_stream_seq) == (2, 3)


async def test_a_heartbeat_stream_deleted_by_an_operator_locks_no_node_out(
    fleet: Fleet, bus: NatsBus, prefix: str, nats_server: NatsServer
) -> None:
    """On a real server: FLEET_HB deleted with a plain client, the aggregator restarted
    (which makes the stream again, numbering from 1, and sources again what FLEET_HB_IN
    holds: the node's last heartbeat, unless its next one replaced it there first), the
    node's next heartbeat, at a stream sequence below its record's, is accepted: it was
    stored later."""
    key = signing.KeyPair.generate()
    await approve(bus, Subjects(prefix), "n1", key.public_key)
    first = await fleet.start_aggregator(checkpoint_interval=0.5)
    await beat_until_checkpointed(bus, prefix, key, first, 3)
    await first.stop()
    operator = await nats.connect(nats_server.url)
    try:
        await operator.jetstream().delete_stream(Subjects(prefix).stream_name("FLEET_HB"))
    finally:
        await operator.close()
    second = aggregator_of(await fleet.start_aggregator(checkpoint_interval=0.5))
    await wait_for(lambda: "n1" in second.ledger.nodes)
    assert second.ledger.nodes["n1"].record.last_stream_seq >= 1
    await beat(bus, prefix, key, 4)
    await wait_for(lambda: second.ledger.nodes["n1"].record.last_seq == 4)
    assert second.ledger.nodes["n1"].record.last_stream_seq in (1, 2)


def test_checkpoint_keeps_an_operator_reset_not_yet_used() -> None:
    """A reset-seq written by an operator after the owner's last write survives the
    owner's next checkpoint, unless a heartbeat already used it up."""
    mine = record_rules.pending_record("n1", "c1", "K")
    assert hot_state.checkpoint(True, mine, reset_consumed=False).seq_reset
    assert not hot_state.checkpoint(True, mine, reset_consumed=True).seq_reset
    assert not hot_state.checkpoint(False, mine, reset_consumed=False).seq_reset


def test_operator_changes_are_told_by_the_digest_of_the_record_last_known() -> None:
    """The owner keeps a digest of the record it last wrote: the same record read back
    leaves its own as it is; one an operator deregistered since gives the deregistration;
    one changed elsewhere but not in its deregistration leaves its own."""
    known = record_rules.pending_record("n1", "c1", "K")
    mine = record_state.with_state(known, last_seq=9)
    digest = hot_state.digest(known, hot_state.NO_GPUS)
    assert 0 <= digest < 2**hot_state.DIGEST_BITS
    assert sys.getsizeof(digest) <= 32  # two digits of an int: a 32-byte block a node
    assert hot_state.operator_changes(mine, known, digest) is mine
    forgotten = record_state.with_state(known, deregistered=True, deregistered_by="operator")
    taken = hot_state.operator_changes(mine, forgotten, digest)
    assert taken.deregistered and taken.deregistered_by == "operator" and taken.last_seq == 9
    elsewhere = record_state.with_state(known, last_seq=3)
    assert hot_state.operator_changes(mine, elsewhere, digest) is mine


def test_checkpoint_queue_spreads_and_skips_clean_nodes() -> None:
    """A node's checkpoint falls due one interval after its last write; a node written
    since (a transition) or not dirty is not written again."""
    queue = CheckpointQueue(10.0)
    record = record_rules.pending_record("n1", "c1")
    nodes = {
        "a": NodeState(record, written=0.0, dirty=True),
        "b": NodeState(record, written=5.0, dirty=True),
        "c": NodeState(record, written=1.0, dirty=False),
    }
    for name in ("a", "c", "b"):
        queue.push(name, nodes[name])
    assert queue.due(9.0, 100, nodes) == []
    assert queue.due(12.0, 100, nodes) == ["a"]
    nodes["b"].written = 14.0  # written by a transition meanwhile
    assert queue.due(16.0, 100, nodes) == []
    assert queue.due(24.0, 100, nodes) == ["b"]


def test_nodes_due_in_one_second_share_its_int_and_are_taken_then() -> None:
    """The sweep queue gives every node due in one second the same int object as its
    ``due`` (not an int of its own: 32 bytes a node), takes them at that second and not
    before, and a second queued again after it was taken is another entry."""
    table = hot_state.NodeTable()
    record = record_rules.pending_record("n1", "c1")
    for name, when in (("a", 1000.2), ("b", 1000.9), ("c", 1003.5)):
        table[name] = NodeState(record_state.with_state(record, last_seen=when), written=0.0)
    queue = SweepQueue(table, lambda record: record.last_seen)
    assert sorted(queue.take(0.0)) == ["a", "b", "c"]  # the first sweep: every node
    for name in ("a", "b", "c"):
        queue.put(name)
    due = {name: table[name].due for name in ("a", "b", "c")}
    assert due == {"a": 1000, "b": 1000, "c": 1003}
    assert due["a"] is due["b"]
    assert queue.take(999.9) == []
    assert sorted(queue.take(1000.0)) == ["a", "b"]
    assert table["a"].due == table["b"].due == 0
    queue.put("a")  # its record unchanged: due in the second taken again
    assert table["a"].due == 1000
    assert queue.take(1002.0) == ["a"]
    assert queue.take(1003.0) == ["c"]
    assert queue._second == {}  # nothing kept for the seconds taken


def test_checkpoint_queue_writes_a_node_due_first_though_queued_last() -> None:
    """Nodes queued in one order but due in another (a cold start's load spreads their
    ``written`` over the interval before, in no order) are each due at their own time:
    a node due early is not held behind one queued before it and due later."""
    queue = CheckpointQueue(10.0)
    record = record_rules.pending_record("n1", "c1")
    nodes = {
        name: NodeState(record, written=at, dirty=True)
        for name, at in (("late", 9.0), ("early", 0.5), ("mid", 4.0))
    }
    for name in ("late", "early", "mid"):
        queue.push(name, nodes[name])
    assert len(queue) == 3
    assert queue.due(11.0, 100, nodes) == ["early"]
    assert queue.due(14.5, 100, nodes) == ["mid"]
    assert queue.due(19.0, 100, nodes) == ["late"]
    assert len(queue) == 0


class LoopRounds:
    """Counts the event loop's rounds while :meth:`counting`, and what was noted in each."""

    def __init__(self) -> None:
        self.round = 0
        self.noted: dict[int, list[str]] = {}

    def note(self, what: str = "") -> None:
        self.noted.setdefault(self.round, []).append(what)

    def sizes(self) -> list[int]:
        """How many were noted in each round that noted any, in order."""
        return [len(noted) for noted in self.noted.values()]

    async def _tick(self) -> None:
        while True:
            self.round += 1
            await asyncio.sleep(0)

    @contextlib.asynccontextmanager
    async def counting(self) -> AsyncIterator[None]:
        ticker = asyncio.create_task(self._tick())
        try:
            yield
        finally:
            ticker.cancel()


async def test_partitions_judge_in_turns_the_loop_runs_between(bus: NatsBus, prefix: str) -> None:
    """Two partitions' fetches judged at once take turns of JUDGED_PER_TURN heartbeats,
    one partition a round of the event loop: whatever else the process runs (the
    connection's reader, a lease renewal) waits for one turn, never for whole fetches
    (a cold start's backlog made rounds of a second, and the leases missed their fence)."""
    aggregator = new_aggregator(bus, prefix)
    key = signing.KeyPair.generate()
    subjects = Subjects(prefix)

    def fetch(partition: int, size: int) -> list[Msg]:
        names = [f"n{i}" for i in range(10 * size)]
        mine = [name for name in names if partition_of(name, TEST_LIMITS.partitions) == partition]
        messages = []
        for seq, name in enumerate(mine[:size], 1):
            body = codec.encode(msgspec.structs.replace(heartbeat(seq=1), node_id=name))
            msg = delivered(bus, prefix, body, key.headers(body), stream_seq=seq)
            msg.subject = subjects.stored_heartbeat("c1", name, TEST_LIMITS.partitions)
            messages.append(msg)
        return messages

    loop = LoopRounds()
    judge = aggregator.path.judge

    def counted(msg: Msg, fetched: bool = False) -> list[Step]:
        loop.note(msg.subject)
        return judge(msg, fetched)

    aggregator.path.judge = counted  # type: ignore[method-assign]
    size = 3 * JUDGED_PER_TURN + 5
    first, second = fetch(0, size), fetch(1, size)
    async with loop.counting():
        await asyncio.gather(aggregator.handle_batch(first), aggregator.handle_batch(second))
    turns = list(loop.noted.values())
    assert max(len(turn) for turn in turns) == JUDGED_PER_TURN
    partitions = {msg.subject: i for i, batch in enumerate((first, second)) for msg in batch}
    assert all(len({partitions[subject] for subject in turn}) == 1 for turn in turns)
    assert len(turns) == 2 * 4  # each fetch in four turns, never two in one round
    judged = [subject for turn in turns for subject in turn]
    assert [s for s in judged if partitions[s] == 0] == [msg.subject for msg in first]
    assert [s for s in judged if partitions[s] == 1] == [msg.subject for msg in second]


async def test_a_load_takes_records_in_turns_the_loop_runs_between(
    bus: NatsBus, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cold start's load decodes at most TAKEN_PER_TURN records in one round of the
    event loop (a page holds 1,000): a load of 100,000 records never holds the process
    for a page at a time, so the lease renewals keep their fence while it runs; every
    record is loaded all the same."""
    aggregator = new_aggregator(bus, prefix)
    bucket = await bus.kv(Subjects(prefix).bucket_name(BUCKET_NODES))
    stored = 2 * reads.TAKEN_PER_TURN + 50
    for i in range(stored):
        await bucket.put(f"n{i}", codec.encode(record_rules.pending_record(f"n{i}", "c1")))
    loop = LoopRounds()
    from_stored = hot_state.from_stored

    def counted(*args: Any) -> NodeState:
        loop.note()
        return from_stored(*args)

    monkeypatch.setattr(hot_state, "from_stored", counted)
    async with loop.counting():
        every = set(range(TEST_LIMITS.partitions))
        loaded, _ = await aggregator.reads.load(every, TEST_LIMITS.partitions)
    assert loaded == stored == len(aggregator.ledger.nodes)
    assert max(loop.sizes()) <= reads.TAKEN_PER_TURN
    assert len(loop.sizes()) >= stored // reads.TAKEN_PER_TURN + 1


async def test_a_full_sweep_takes_nodes_in_turns_the_loop_runs_between(
    bus: NatsBus, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full sweep passes over every held node at most SWEPT_PER_TURN a round of the
    event loop (0.8 s in one go at 100,000 nodes under load), and still sweeps each."""
    aggregator = new_aggregator(bus, prefix)
    bucket = await bus.kv(Subjects(prefix).bucket_name(BUCKET_NODES))
    stored = 2 * sweeps.SWEPT_PER_TURN + 10
    for i in range(stored):
        await bucket.put(f"n{i}", codec.encode(record_rules.pending_record(f"n{i}", "c1")))
    await aggregator.reads.load(set(range(TEST_LIMITS.partitions)), TEST_LIMITS.partitions)
    loop = LoopRounds()
    pending_expired = sweeps.pending_expired

    def counted(record: NodeRecord, now: float, expire_after: float) -> bool:
        loop.note()
        return pending_expired(record, now, expire_after)

    monkeypatch.setattr(sweeps, "pending_expired", counted)
    async with loop.counting():
        await aggregator.sweeps.sweep(everything=True)
    assert sum(loop.sizes()) == stored
    assert max(loop.sizes()) <= sweeps.SWEPT_PER_TURN
    assert len(loop.sizes()) >= 3


async def test_message_breaking_the_judge_is_terminated_alone(bus: NatsBus, prefix: str) -> None:
    """A message on which judging raises (a bug) is terminated on its own and counted;
    the rest of the batch is judged, and nothing raises out of the batch."""
    aggregator = new_aggregator(bus, prefix)
    key = signing.KeyPair.generate()
    body = codec.encode(heartbeat(seq=1))
    broken = delivered(bus, prefix, body, key.headers(body), stream_seq=1)
    fine = delivered(bus, prefix, body, key.headers(body), stream_seq=2)
    fine.subject = Subjects(prefix).stored_heartbeat("c1", "n2", TEST_LIMITS.partitions)
    judged: list[int] = []

    def judge(msg: Msg, fetched: bool = False) -> list[Step]:
        if msg is broken:
            raise RuntimeError("bug")
        judged.append(2)
        return []

    aggregator.path.judge = judge  # type: ignore[method-assign]
    chains = await aggregator.handle_batch([broken, fine])
    assert chains == [[(broken, broken.term)]]
    assert judged == [2]
    dropped = aggregator.metrics.registry.get_sample_value(
        "fleet_messages_dropped_total", {"reason": "handler_error"}
    )
    assert dropped == 1


async def test_stored_message_with_a_status_header_is_judged(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """A heartbeat published with the header the server's status answers carry (and no
    body) is a message like any other: refused and counted, and the node's next valid
    heartbeat is accepted."""
    key = signing.KeyPair.generate()
    await approve(bus, Subjects(prefix), "n1", key.public_key)
    actor = aggregator_of(await fleet.start_aggregator())
    await bus.js.publish(Subjects(prefix).heartbeat("c1", "n1"), b"", headers={"Status": "503"})

    def refused() -> float:
        registry = actor.metrics.registry
        return sum(
            registry.get_sample_value("fleet_heartbeats_refused_total", {"kind": kind}) or 0
            for kind in ("bad_signature", "unknown_node")
        )

    await wait_for(lambda: refused() == 1)
    await beat(bus, prefix, key, 1)
    await wait_for(
        lambda: "n1" in actor.ledger.nodes and actor.ledger.nodes["n1"].record.last_seq == 1
    )


async def test_the_writes_of_a_moment_go_out_together_and_a_conflict_the_careful_way(
    fleet: Fleet, bus: NatsBus, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Five nodes' records written at once are one batch of compare-and-set publishes;
    the one an operator forgot in between fails its compare-and-set there and is written
    the careful way (read again), so the operator's deregistration is kept, not undone."""
    subjects = Subjects(prefix)
    nodes = [f"n{i}" for i in range(1, 6)]
    keys = {node: signing.KeyPair.generate() for node in nodes}
    for node, key in keys.items():
        await approve(bus, subjects, node, key.public_key)
    actor = aggregator_of(await fleet.start_aggregator(checkpoint_interval=120.0))
    for node, key in keys.items():
        body = codec.encode(heartbeat(node=node, seq=1, stale_after=60.0, interval=30.0))
        await publish(bus, prefix, body, key.headers(body), node=node, ttl=60)
    await wait_for(
        lambda: all(actor.ledger.nodes.get(n) and actor.ledger.nodes[n].revision for n in nodes)
    )
    await forget(bus, subjects, "n3", by="UOPERATOR", reason="retired")
    batches: list[list[str]] = []
    update_many = kv.update_many

    async def counted(
        bus: Bus, bucket: str, writes: list[tuple[str, bytes, int]], timeout: float
    ) -> list[int | None]:
        batches.append([key for key, _, _ in writes])
        return await update_many(bus, bucket, writes, timeout)

    monkeypatch.setattr(kv, "update_many", counted)
    await asyncio.gather(*(actor.writes.write(node) for node in nodes))
    assert batches == [nodes]
    forgotten = await read_record(bus, subjects, "n3")
    assert forgotten.deregistered and forgotten.deregistered_by == "UOPERATOR"
    for node in nodes:
        assert (await read_record(bus, subjects, node)).last_seq == 1


async def test_a_subject_is_checked_against_the_nodes_state_or_in_full(
    bus: NatsBus, prefix: str
) -> None:
    """A heartbeat subject of a node in memory, in its record's cluster, is taken by what
    the node's state holds (its partition, noted once checked in full); a wrong partition
    token, prefix or layout is refused all the same, and another cluster is checked in
    full."""
    actor = new_aggregator(bus, prefix)
    node = "n-split"
    partition = partition_of(node, actor.ownership.partition_count)
    good = f"{prefix}.hb.{partition}.c1.{node}"
    other = (partition + 1) % actor.ownership.partition_count
    wrong = [
        f"{prefix}.hb.{other}.c1.{node}",
        f"x{prefix}.hb.{partition}.c1.{node}",
        f"{prefix}.hb.{partition}.c*.{node}",
        f"{prefix}.hb.c1.{node}",
    ]
    assert actor.ownership.split(good) == (partition, "c1", node)  # unknown: in full
    actor.ledger.nodes[node] = NodeState(record_rules.pending_record(node, "c1"), 1.0)
    assert actor.ownership.split(good) == (partition, "c1", node)
    assert actor.ledger.nodes[node].partition == partition
    assert actor.ownership.split(good) == (partition, "c1", node)  # from the state
    for subject in wrong:
        with pytest.raises(InvalidToken):
            actor.ownership.split(subject)
    assert actor.ownership.split(f"{prefix}.hb.{partition}.c2.{node}") == (partition, "c2", node)


async def test_a_checkpoint_keeps_the_in_memory_record_as_it_is(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """A checkpoint of a node that only kept beating leaves its in-memory record the same
    object (nothing made again from the whole record written), and remembers the digest
    of exactly what fleet_nodes now holds: an operator's change after it is still told
    from the owner's own writes."""
    key = signing.KeyPair.generate()
    await approve(bus, Subjects(prefix), "n1", key.public_key)
    actor = aggregator_of(await fleet.start_aggregator(checkpoint_interval=120.0))
    for seq in (1, 2):
        await beat(bus, prefix, key, seq)

        def accepted(seq: int = seq) -> bool:
            return "n1" in actor.ledger.nodes and actor.ledger.nodes["n1"].record.last_seq == seq

        await wait_for(accepted)
    state = actor.ledger.nodes["n1"]
    assert state.dirty
    kept = state.record
    await actor.writes.write("n1")
    stored = await read_record(bus, Subjects(prefix), "n1")
    assert stored.last_seq == 2 and not state.dirty
    assert state.record is kept
    assert state.stored == hot_state.stored_digest(stored)


async def test_a_heartbeat_reaches_fleet_nodes_as_the_node_signed_it(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """Published with plain nats-py, a signed heartbeat carrying a field this version does
    not know is accepted, and the record written (read back with plain nats-py) embeds
    the heartbeat's bytes as signed, unknown field and all, and decodes whole."""
    key = signing.KeyPair.generate()
    await approve(bus, Subjects(prefix), "n1", key.public_key)
    await fleet.start_aggregator()
    known = codec.encode(heartbeat(seq=1, stale_after=60.0, interval=30.0))
    body = known[:-1] + b',"from_a_newer_agent":[1,{"x":"y"}]}'
    await publish(bus, prefix, body, key.headers(body), ttl=60)

    async def written() -> bool:
        return await stored_seq(bus, prefix) == 1

    await wait_for(written)
    nodes = await bus.js.key_value(Subjects(prefix).bucket_name(BUCKET_NODES))
    entry = await nodes.get("n1")
    assert entry.value is not None and body in entry.value
    record = codec.decode(entry.value, NodeRecord)
    assert record.heartbeat == codec.decode(body, Heartbeat)


async def test_a_fetchs_signatures_are_checked_ahead_once_each_and_only_for_their_message(
    bus: NatsBus, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The signatures of a fetch's heartbeats from known nodes are checked in one loop
    before any is judged (see ``Signatures.ahead``). A signature that held is checked once;
    one that failed is checked again when judged, which refuses it as ever; a heartbeat
    judged before is not checked at all. A check ahead counts only for its own message
    under the key it held with, and a message that breaks it breaks no batch. The bodies
    accepted are packed once judging is done, each node's the body of its last beat."""
    subjects = Subjects(prefix)
    keys = {node: signing.KeyPair.generate() for node in ("n1", "n2")}
    for node, key in keys.items():
        await approve(bus, subjects, node, key.public_key)
    aggregator = new_aggregator(bus, prefix)
    watch = asyncio.create_task(aggregator.store.follow_trust())
    try:
        await wait_for(lambda: aggregator.store.cached_key("n2") == keys["n2"].public_key)
        stored = time.time_ns()

        def message(node: str, seq: int, stream_seq: int, stored_ns: int, sig: str = "") -> Msg:
            body = codec.encode(heartbeat(node=node, seq=seq))
            headers = keys[node].headers(body)
            if sig:
                headers[signing.HEADER_SIG] = sig
            msg = delivered(bus, prefix, body, headers, stream_seq, stored_ns)
            msg.subject = subjects.stored_heartbeat("c1", node, TEST_LIMITS.partitions)
            return msg

        first = [message("n1", 1, 1, stored), message("n2", 1, 2, stored)]
        for msg in first:
            await aggregator.path.handle(msg)
        checked: list[bytes] = []
        verify_with = signing.verify_with

        def counted(key: bytes, public_key: str, headers: dict[str, str], body: bytes) -> None:
            checked.append(body)
            verify_with(key, public_key, headers, body)

        monkeypatch.setattr(signing, "verify_with", counted)
        good = message("n1", 2, 3, stored + 10**9)
        goods_signature = keys["n1"].headers(good.data)[signing.HEADER_SIG]
        forged = message("n2", 2, 4, stored + 10**9, sig=goods_signature)
        again = first[0]  # stored at stream seq 1: judged before
        chains = await aggregator.handle_batch([good, forged, again])
        assert [chain[0][0] for chain in chains] == [forged]  # its refusal's alert
        assert checked == [good.data, forged.data, forged.data]
        assert aggregator.ledger.nodes["n1"].record.last_seq == 2
        assert aggregator.ledger.nodes["n2"].record.last_seq == 1
        refused = aggregator.metrics.registry.get_sample_value(
            "fleet_heartbeats_refused_total", {"kind": "bad_signature"}
        )
        assert refused == 1
        state = aggregator.ledger.nodes["n1"]
        assert state.body is not None
        assert aggregator.ledger.nodes.bodies.unpack(state.body) == good.data

        # A check ahead under another key counts for nothing: judged, n1's forged beat
        # is checked under its own key, and refused.
        checked.clear()
        bad = message("n1", 3, 5, stored + 2 * 10**9, sig=goods_signature)
        aggregator.path.verify.verified = {id(bad): (bytes(32), delivery(bad))}
        assert aggregator.path.judge(bad) != []  # its refusal's alert
        assert checked == [bad.data]
        refused = aggregator.metrics.registry.get_sample_value(
            "fleet_heartbeats_refused_total", {"kind": "bad_signature"}
        )
        assert refused == 2
        assert aggregator.ledger.nodes["n1"].record.last_seq == 2

        # A message that breaks a check ahead breaks no batch: the judge meets it again
        # and terminates it alone. (A reply subject no server sends: a heartbeat subject
        # comes only in the server's deliveries, so this is a fault, not an input.)
        broken = message("n1", 3, 6, stored + 3 * 10**9)
        broken.reply = "$JS.ACK.stream.consumer.1.x.1.1.0"
        fine = message("n2", 2, 7, stored + 3 * 10**9)
        chains = await aggregator.handle_batch([broken, fine])
        assert chains[0] == [(broken, broken.term)]
        assert aggregator.ledger.nodes["n2"].record.last_seq == 2
    finally:
        watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)
