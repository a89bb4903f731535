"""fleetctl aggregators: every partition's lease holder, its rate and lag."""

from __future__ import annotations

import json

import pytest

from actors.fleet.aggregator import AggregatorActor
from actors.runtime.bus import NatsBus
from tests.cli.test_fleetctl_listing import fleetctl
from tests.support.fleet import TEST_LIMITS, Fleet, wait_for


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
    count = actor.partition_count
    assert count == TEST_LIMITS.partitions == 8  # the stream's N, not the differing setting
    await wait_for(lambda: actor.partitions is not None and len(actor.partitions.held) == count)
    assert actor.partitions is not None
    holder = actor.partitions.holder
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
