"""fleetctl simulate --kill: a stale storm, each killed node alerted exactly once."""

from __future__ import annotations

import io

from actors.cli.simulate import SimOptions, simulate
from actors.runtime.bus import NatsBus
from tests.support.fleet import Fleet


async def test_killed_nodes_each_get_one_stale_alert(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """Two of six nodes stop half way: the report says 2/2 alerted, none stored twice,
    and gives the TTL-expiry-to-alert delay; the live nodes are all current."""
    await fleet.start_aggregator()
    options = SimOptions(
        nodes=6,
        rate=12.0,
        duration=3.0,
        gpus=1,
        prefix=prefix,
        wait=10.0,
        kill=2,
        min_stale_after=1.0,
    )
    out = io.StringIO()
    code = await simulate(bus, options, out)
    report = out.getvalue()
    assert "stale storm: 2/2 killed nodes alerted, 0 stored more than once" in report, report
    assert "p99" in report
    assert code == 0 or "not caught up" in report  # the killed nodes' records stop moving
