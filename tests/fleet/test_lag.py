"""Processing lag as a signal: the oldest unprocessed heartbeat's age as a metric, and
``/healthz`` failing beyond ``max_lag``."""

from __future__ import annotations

import time

import aiohttp

from actors.fleet.metrics import AggregatorMetrics
from actors.runtime.bus import NatsBus
from actors.runtime.supervisor import ActorStatus
from tests.support.fleet import Fleet, new_aggregator, new_fleet_api


async def test_lag_beyond_max_lag_fails_healthz(fleet: Fleet, bus: NatsBus, prefix: str) -> None:
    """An owned partition 100 s behind with heartbeats pending reports a problem (503 on
    /healthz, naming the partition and the lag) while another owned one is current;
    caught up (nothing pending) it is healthy again, and its gauge says 0."""
    metrics = AggregatorMetrics()
    aggregator = new_aggregator(bus, prefix, metrics, max_lag=30.0)
    for partition in (2, 5):  # as while it holds these two partitions' leases
        aggregator.ownership.consumers[partition] = aggregator.ownership.consumer(partition)
        aggregator.ownership.consumers[partition].missing = ""
    metrics.processed(time.time(), pending=3, partition=2)

    def status() -> dict[str, ActorStatus]:
        problem = aggregator.problem()
        return {"aggregator": ActorStatus(name="aggregator", phase="running", problem=problem)}

    api = new_fleet_api(bus, prefix, metrics, status)
    await fleet.start_supervisor(api)
    url = f"http://127.0.0.1:{api.port}/healthz"
    metrics.processed(time.time() - 100, pending=42, partition=5)
    assert 99 < metrics.oldest_unprocessed(5) < 110 and metrics.oldest_unprocessed(2) < 5
    gauge = metrics.registry.get_sample_value(
        "fleet_aggregator_oldest_unprocessed_seconds", {"partition": "5"}
    )
    assert gauge is not None and 99 < gauge < 110
    assert (
        metrics.registry.get_sample_value("fleet_aggregator_pending_heartbeats", {"partition": "5"})
        == 42
    )
    async with aiohttp.ClientSession() as session:
        async with session.get(url) as answer:
            text = await answer.text()
            assert answer.status == 503
            assert "partition 5" in text and ("100s behind" in text or "101s behind" in text)
        metrics.processed(time.time(), pending=0, partition=5)
        assert metrics.oldest_unprocessed(5) == 0.0
        async with session.get(url) as answer:
            assert answer.status == 200


def test_standby_is_not_behind(bus: NatsBus, prefix: str) -> None:
    """An aggregator that holds no partition (no consumer) reports no lag problem,
    whatever its last figures were."""
    metrics = AggregatorMetrics()
    aggregator = new_aggregator(bus, prefix, metrics, max_lag=30.0)
    metrics.processed(time.time() - 1000, pending=5)
    assert metrics.oldest_unprocessed() > 900
    assert aggregator.problem() == ""
