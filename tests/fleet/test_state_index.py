"""The fleet's state index against a real server: it follows the aggregator's state
changes (counted and listed within seconds), a listing of a state reads only the nodes it
names, and an index nobody keeps is not used."""

from __future__ import annotations

import argparse

import pytest

from actors.cli.fleetctl import indexed
from actors.cli.render import tables
from actors.fleet.live import reader as live
from actors.fleet.live.state_index import FRESH_FOR, StateIndexActor, merged, read_index
from actors.fleet.process import held_partitions
from actors.fleet.storage.registry import approve
from actors.runtime.bus import NatsBus
from schemas import codec
from schemas.events import Health
from schemas.fleet_index import IndexedNode, PartitionIndex
from schemas.subjects import Subjects
from tests.cli.test_fleetctl_listing import fleetctl
from tests.support.fleet import Fleet, heartbeat, new_aggregator, wait_for

UNHEALTHY = Health(ts=1.0, status="unhealthy", score=40, components=[], checks=[])
HEALTHY = Health(ts=1.0, status="healthy", score=100, components=[], checks=[])


async def test_the_index_follows_state_changes_and_a_state_listing_reads_only_its_nodes(
    fleet: Fleet, bus: NatsBus, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three nodes beat: the index counts three active; n2 turning unhealthy and n3 going
    silent (stale) are counted and listed by the index within seconds, n2 back to
    healthy leaves its list; `nodes --state unhealthy` answers from the index and the
    records of the nodes it names (the scan of every record made to fail), live; above a
    screenful the summary comes from the counts alone; `fleetctl nodes --state
    unhealthy` prints n2 and no other node."""
    subjects = Subjects(prefix)
    aggregator = new_aggregator(bus, prefix)
    index = StateIndexActor(bus, subjects, aggregator.view, held_partitions(aggregator))
    await fleet.start_supervisor(aggregator, index)
    keys = {node: fleet.node_key(node) for node in ("n1", "n2", "n3")}
    seqs = dict.fromkeys(keys, 0)
    for node, key in keys.items():
        await approve(bus, subjects, node, key.public_key)

    async def beat(node: str, **changes: object) -> None:
        seqs[node] += 1
        body = codec.encode(heartbeat(node, seqs[node], stale_after=3.0, **changes))
        # Nats-TTL: the server's marker when the node falls silent (what makes it stale).
        headers = {**keys[node].headers(body), "Nats-TTL": "3"}
        await bus.js.publish(subjects.heartbeat("c1", node), body, headers=headers)

    async def counts() -> dict[str, dict[str, int]] | None:
        found = await read_index(bus, subjects)
        return None if found is None else found.counts

    async def counts_are(wanted: dict[str, int]) -> bool:
        return await counts() == {"c1": wanted}

    for node in keys:
        await beat(node)
    await wait_for(lambda: counts_are({"active": 3}), timeout=60)

    await beat("n2", health=UNHEALTHY)
    await beat("n1")

    async def n2_unhealthy_n3_stale() -> bool:
        await beat("n1")
        await beat("n2", health=UNHEALTHY)
        return await counts_are({"active": 1, "unhealthy": 1, "stale": 1})

    await wait_for(n2_unhealthy_n3_stale, timeout=60, interval=0.5)
    found = await read_index(bus, subjects)
    assert found is not None and found.listed_all
    assert {node: entry.state for node, entry in found.listed.items()} == {
        "n2": "unhealthy",
        "n3": "stale",
    }
    assert found.health.get("unhealthy") == 1

    async def no_scan(*_: object) -> None:
        raise AssertionError("every record read for a listing the index answers")

    monkeypatch.setattr(live, "stored_records", no_scan)
    listing = await indexed.from_index(bus, subjects, None, {"unhealthy"})
    assert listing is not None and listing.records is not None and listing.total == 3
    assert [record.node_id for record in listing.records] == ["n2"]
    assert listing.records[0].live, listing.records[0].live_note
    monkeypatch.setattr(tables, "SUMMARY_ABOVE", 2)
    summary = await indexed.from_index(bus, subjects, "c1", set())
    assert summary is not None and summary.records is None
    assert summary.summary.splitlines()[-2].split() == ["all", "1", "1", "1", "3"]
    monkeypatch.undo()

    code, out, err = await fleetctl(
        "nodes", "--server", fleet.url, "--prefix", prefix, "--state", "unhealthy"
    )
    assert code == 0, err
    assert "n2" in out and "n1" not in out and "n3" not in out

    async def n2_healthy() -> bool:
        await beat("n2", health=HEALTHY)
        listed = await read_index(bus, subjects)
        return listed is not None and "n2" not in listed.listed

    await wait_for(n2_healthy, timeout=60, interval=0.5)


def test_an_index_is_used_only_when_every_partition_has_a_fresh_one() -> None:
    """Two partitions' indexes merge into one (counts added, lists joined); one partition
    missing, or one written longer ago than FRESH_FOR, and the index is not used."""

    def part(partition: int, written: float, nodes: int) -> PartitionIndex:
        return PartitionIndex(
            partition=partition,
            partitions=2,
            holder="a",
            written=written,
            counts={"c1": {"active": nodes, "stale": 1}},
            listed={f"s{partition}": IndexedNode(cluster="c1", state="stale")},
        )

    now = 1000.0
    both = merged({0: part(0, now, 5), 1: part(1, now - 5, 7)}, now)
    assert both is not None
    assert both.counts == {"c1": {"active": 12, "stale": 2}}
    assert sorted(both.listed) == ["s0", "s1"] and both.oldest == now - 5
    assert merged({0: part(0, now, 5)}, now) is None
    assert merged({0: part(0, now, 5), 1: part(1, now - FRESH_FOR - 1, 7)}, now) is None


def test_a_listing_the_index_cannot_answer_reads_the_records() -> None:
    """Labels, an order, a watch, deregistered nodes, or rows or JSON of every state or
    of active nodes: the records are read; rows or JSON of other states come from it."""
    plain = argparse.Namespace(all=False, watch=False, label=None, sort_by=None, limit=None)
    assert indexed.usable(plain, "table", {"unhealthy"})
    assert indexed.usable(plain, "table", set())
    for change in ({"all": True}, {"watch": True}, {"label": ["a=b"]}, {"limit": 5}):
        assert not indexed.usable(argparse.Namespace(**{**vars(plain), **change}), "table", set())
    assert not indexed.usable(plain, "json", set())
    assert not indexed.usable(plain, "json", {"active", "stale"})
    assert not indexed.usable(plain, "table", {"deregistered"})
    every = argparse.Namespace(**{**vars(plain), "all": True})
    assert indexed.usable(every, "table", {"stale"}) and indexed.usable(plain, "json", {"stale"})
