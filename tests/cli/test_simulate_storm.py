"""fleetctl simulate --kill: a stale storm, each killed node alerted exactly once."""

from __future__ import annotations

import io
import re

from actors.cli.simulate import SimOptions, simulate
from actors.runtime.bus import NatsBus
from tests.support.fleet import Fleet


async def test_killed_nodes_each_get_one_stale_alert(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """Two of six nodes stop half way: the report says 2/2 alerted, none stored twice,
    and gives the TTL-expiry-to-alert delay and its two halves; the live nodes are all
    current."""
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
    # Both halves of the delay are reported from the alerts' marked_at (nan without it):
    # the server's, TTL expiry -> marker, and the aggregator's, marker -> alert.
    halves = re.search(
        r"TTL expiry -> alert p50 \S+ p99 ([\d.]+)s; TTL expiry -> marker stored p50 \S+ "
        r"p99 (-?[\d.]+)s, marker -> alert p50 \S+ p99 ([\d.]+)s",
        report,
    )
    assert halves is not None, report
    total, by_server, by_aggregator = (float(found) for found in halves.groups())
    assert 0 <= by_aggregator <= total + 0.5 and by_server <= total + 0.5
    assert code == 0 or "not caught up" in report  # the killed nodes' records stop moving
