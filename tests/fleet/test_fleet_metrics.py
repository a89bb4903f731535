"""The aggregator's /metrics: nodes by state and by cluster, and how far behind it is."""

from __future__ import annotations

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from actors.fleet.metrics import AggregatorMetrics
from actors.runtime.bus import NatsBus
from schemas.subjects import partition_of
from tests.node.test_metrics_series import undocumented
from tests.support.fleet import (
    TEST_LIMITS,
    Fleet,
    new_aggregator,
    new_fleet_api,
    wait_for,
    wait_record,
)

TIMEOUT = aiohttp.ClientTimeout(total=5)


async def scrape(url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        async with session.get(f"{url}/metrics") as response:
            body = await response.text()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(body)
        for sample in family.samples
    }


async def test_nodes_by_cluster_and_state_and_lag(fleet: Fleet, bus: NatsBus, prefix: str) -> None:
    metrics = AggregatorMetrics()
    api = new_fleet_api(bus, prefix, metrics)
    await fleet.start_supervisor(new_aggregator(bus, prefix, metrics), api)
    # No heartbeat processed yet: no lag to tell (no partition's series), not a made-up 0.
    assert metrics.registry.get_sample_value("fleet_aggregator_lag_seconds") is None
    await fleet.start_agent()
    await fleet.start_agent(fleet.config("n2", cluster="c2"))
    await wait_record(bus, prefix, "n1", lambda r: r.state == "active")
    await wait_record(bus, prefix, "n2", lambda r: r.state == "active")
    url = f"http://127.0.0.1:{api.port}"

    def series(cluster: str, state: str) -> tuple[str, frozenset[tuple[str, str]]]:
        return ("fleet_cluster_nodes", frozenset({("cluster", cluster), ("state", state)}))

    async def both_active() -> dict[tuple[str, frozenset[tuple[str, str]]], float] | None:
        samples = await scrape(url)
        wanted = [series("c1", "active"), series("c2", "active")]
        return samples if all(samples.get(key) == 1 for key in wanted) else None

    samples = await wait_for(both_active)
    assert samples[series("c2", "unhealthy")] == 0
    assert samples[("fleet_nodes", frozenset({("state", "unhealthy")}))] == 0
    assert samples[("fleet_nodes", frozenset({("state", "active")}))] == 2
    # Heartbeats every 0.5 s: while the aggregator keeps up, its lag stays about that.
    # The series are labelled by partition: n1's partition has them.
    partition = frozenset({("partition", str(partition_of("n1", TEST_LIMITS.partitions)))})
    lag = samples[("fleet_aggregator_lag_seconds", partition)]
    assert 0 <= lag < 3, lag
    assert samples[("fleet_aggregator_pending_heartbeats", partition)] >= 0
    assert samples[("fleet_aggregator_owner", partition)] == 1
    assert undocumented({(name, ()): value for (name, _), value in samples.items()}) == set()
