"""fleetctl simulate --kill: a stale storm, each killed node alerted exactly once."""

from __future__ import annotations

import io
import re
import time

from nats.aio.msg import Msg

from actors.cli.simulate.publisher import SimOptions
from actors.cli.simulate.run import StaleAlerts, simulate
from actors.runtime.bus import NatsBus
from schemas import codec
from schemas.messages import Alert
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


async def test_a_stale_alerts_marked_at_counts_only_as_a_finite_time() -> None:
    """The storm's halves are taken from each alert's ``marked_at``: one that is not a
    finite number (nan would sort anywhere among the delays and spoil the quantiles) is
    left out, and the alert still counts as arrived."""
    watch = StaleAlerts()
    for node, marked_at in (("a", "nan"), ("b", "inf"), ("c", "-1e999"), ("d", "12.5")):
        alert = Alert(
            id=f"stale-{node}",
            kind="stale",
            node_id=node,
            cluster="c1",
            severity="warning",
            message="no heartbeat",
            ts=time.time(),
            details={"marked_at": marked_at},
        )
        await watch.on_alert(Msg(_client=None, subject="fleet.alert", data=codec.encode(alert)))  # type: ignore[arg-type]
    assert sorted(watch.arrived) == ["a", "b", "c", "d"]
    assert watch.marked == {"d": 12.5}
