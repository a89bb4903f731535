"""fleetctl aggregators: every partition's lease holder, its rate and lag."""

from __future__ import annotations

import json

import pytest

from actors.fleet.aggregator.actor import AggregatorActor
from actors.runtime.bus import NatsBus
from tests.cli.test_fleetctl_listing import fleetctl
from tests.support.fleet import TEST_LIMITS, Fleet, wait_for, wait_record


@pytest.mark.slow
async def test_aggregators_lists_every_partition_and_its_holder(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """With one aggregator running (its partitions setting differing from the stream's:
    the stream's N is used), every partition's holder is that aggregator and nothing is
    pending; the table form prints one row per partition with that holder, then one per
    aggregator with the partitions it holds."""
    supervisor = await fleet.start_aggregator(partitions=4)
    actor = supervisor.actors[0]
    assert isinstance(actor, AggregatorActor)
    count = actor.ownership.partition_count
    assert count == TEST_LIMITS.partitions == 8  # the stream's N, not the differing setting
    await wait_for(
        lambda: (
            actor.ownership.partitions is not None and len(actor.ownership.partitions.held) == count
        )
    )
    assert actor.ownership.partitions is not None
    holder = actor.ownership.partitions.holder
    where = ("--server", fleet.url, "--prefix", prefix)
    code, out, err = await fleetctl("aggregators", *where, "--json")
    assert (code, err) == (0, "")
    statuses = [json.loads(line) for line in out.splitlines()]
    assert [status["partition"] for status in statuses] == [str(p) for p in range(count)]
    assert all(status["holder"] == holder for status in statuses)
    assert all(status["pending"] == 0 and status["rate"] >= 0 for status in statuses)
    code, out, _ = await fleetctl("aggregators", *where)
    partitions, aggregators = out.split("\n\n")
    rows = partitions.splitlines()[1:]
    assert code == 0 and len(rows) == count and all(holder in row for row in rows)
    # The summary: one aggregator, holding every partition.
    assert aggregators.splitlines()[1].split()[:2] == [holder, str(count)]


@pytest.mark.slow
async def test_aggregators_rate_is_the_partitions_heartbeat_rate(fleet: Fleet) -> None:
    """Three agents beating every 0.5 s send 6 heartbeats a second in all: the partitions'
    rates add up to about that (not the whole stream's rate on every partition, as the
    stream's sequence gave), and the columns of both tables are aligned."""
    supervisor = await fleet.start_aggregator()
    actor = supervisor.actors[0]
    assert isinstance(actor, AggregatorActor)
    for node in ("n1", "n2", "n3"):
        await fleet.start_agent(fleet.config(node))
    for node in ("n1", "n2", "n3"):
        await wait_record(fleet.bus, fleet.prefix, node, lambda r: r.last_seq >= 3)
    where = ("--server", fleet.url, "--prefix", fleet.prefix)

    async def two_busy() -> list[dict[str, object]] | None:
        """A reading in which two partitions or more have a rate: the three nodes are not
        all in one partition. A reading across a lease's takeover (a starved machine's
        aggregator fenced itself) has every consumer made again between its two looks,
        so every rate 0: the next reading is taken."""
        code, out, err = await fleetctl("aggregators", *where, "--json")
        assert (code, err) == (0, "")
        statuses: list[dict[str, object]] = [json.loads(line) for line in out.splitlines()]
        busy = [status for status in statuses if float(str(status["rate"])) > 0]
        return statuses if len(busy) >= 2 else None

    statuses = await wait_for(two_busy, interval=0.0)
    assert 3.0 <= sum(float(str(status["rate"])) for status in statuses) <= 9.0, statuses
    code, out, _ = await fleetctl("aggregators", *where)
    assert code == 0
    for table in out.split("\n\n"):
        lines = table.splitlines()
        header = lines[0]
        rate = header.index("RATE")
        assert all(line[rate - 2 : rate] == "  " and line[rate] != " " for line in lines[1:])
