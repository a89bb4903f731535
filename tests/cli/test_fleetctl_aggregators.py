"""fleetctl aggregators: the heartbeat lease's holder, its rate and lag."""

from __future__ import annotations

import json

import pytest

from actors.fleet.aggregator import AggregatorActor
from actors.runtime.bus import NatsBus
from tests.cli.test_fleetctl_listing import fleetctl
from tests.support.fleet import Fleet, wait_for


@pytest.mark.slow
async def test_aggregators_names_the_lease_holder(fleet: Fleet, bus: NatsBus, prefix: str) -> None:
    """With one aggregator running, the lease holder is that aggregator and nothing is
    pending; the table form prints the same holder."""
    supervisor = await fleet.start_aggregator()
    actor = supervisor.actors[0]
    assert isinstance(actor, AggregatorActor)
    await wait_for(lambda: actor.lease is not None and actor.lease.held)
    assert actor.lease is not None
    where = ("--server", fleet.url, "--prefix", prefix)
    code, out, err = await fleetctl("aggregators", *where, "--json")
    assert (code, err) == (0, "")
    status = json.loads(out)
    assert status["holder"] == actor.lease.holder and status["partition"] == "hb"
    assert status["pending"] == 0 and status["rate"] >= 0
    code, out, _ = await fleetctl("aggregators", *where)
    assert code == 0 and actor.lease.holder in out.splitlines()[1]
