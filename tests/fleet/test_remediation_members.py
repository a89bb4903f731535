"""The remediation policy's index of the fleet: kept from the live feed's writes, so a
round with nothing written decodes no record, and a node written sick or silent is one
the policy may act on at the next round."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, cast

import msgspec

from actors.fleet.live.feed import NodeFeed
from actors.fleet.remediation.config import PolicyConfig
from actors.fleet.remediation.members import READ_PER_TURN, Members
from actors.runtime.bus import NatsBus
from schemas import codec
from schemas.messages import NodeRecord
from schemas.subjects import BUCKET_NODES, Subjects
from tests.support.fleet import Fleet, fed


def record(node: str, **changes: object) -> NodeRecord:
    base = NodeRecord(node_id=node, cluster="c1", state="active", last_seq=1, last_seen=1.0)
    return msgspec.structs.replace(base, **changes)


async def test_a_quiet_round_decodes_nothing_and_a_written_node_is_taken_in(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """The first refresh reads every record; refreshes with nothing written read none
    and offer no node to act on; a node written stale is read alone, offered, and no
    longer counted as reporting; written deregistered, it leaves the cluster."""
    subjects = Subjects(prefix)
    bucket = await bus.kv(subjects.bucket_name(BUCKET_NODES))
    fleet_records = [record(f"n{i}") for i in range(40)]
    for each in fleet_records:
        await bucket.put(each.node_id, codec.encode(each))
    feed = NodeFeed(bus, subjects)
    members = Members(feed, PolicyConfig(key_file="unused", classes=["gpu", "xid", "hung"]))
    await fleet.follow(feed)
    await fed(feed, fleet_records)
    await members.refresh(everything=True)
    assert (members.read, members.clusters(), members.reporting("c1")) == (40, ["c1"], 40)
    for _ in range(3):
        await members.refresh(everything=False)
    assert members.read == 40
    assert members.of("c1", set()) == []
    silent = record("n7", state="stale", last_seq=2)
    await bucket.put("n7", codec.encode(silent))
    await fed(feed, [silent])
    await members.refresh(everything=False)
    assert members.read == 41
    assert [r.node_id for r in members.of("c1", {"n9"})] == ["n7", "n9"]
    assert members.reporting("c1") == 39
    gone = record("n7", state="deregistered", deregistered=True, last_seq=3)
    await bucket.put("n7", codec.encode(gone))
    await fed(feed, [gone])
    await members.refresh(everything=False)
    assert members.of("c1", set()) == []
    assert members.reporting("c1") == 39


async def test_a_refresh_gives_the_event_loop_its_turns() -> None:
    """A refresh over many records lets the event loop run every READ_PER_TURN of them
    (the 25,000 written in a round at 100,000 nodes, decoded at once, held it for about
    0.5 s) and still takes in every one."""
    feed = NodeFeed(cast(Any, None), Subjects("t"))
    for i in range(2 * READ_PER_TURN + 500):
        feed.records[f"n{i:04d}"] = record(f"n{i:04d}")
    members = Members(feed, PolicyConfig(key_file="unused", classes=["gpu", "xid", "hung"]))
    turns = 0

    async def count() -> None:
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0)

    counter = asyncio.create_task(count())
    await asyncio.sleep(0)
    before = turns
    await members.refresh(everything=True)
    during = turns - before
    counter.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await counter
    assert during >= 2, during
    assert members.read == members.reporting("c1") == 2 * READ_PER_TURN + 500
