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
    """The owner 100 s behind with heartbeats pending reports a problem (503 on
    /healthz, naming the lag); caught up (nothing pending) it is healthy again, and the
    gauge says 0."""
    metrics = AggregatorMetrics()
    aggregator = new_aggregator(bus, prefix, metrics, max_lag=30.0)
    aggregator._consumer = aggregator.consumer()  # as while it holds the lease
    aggregator._consumer.missing = ""

    def status() -> dict[str, ActorStatus]:
        problem = aggregator.problem()
        return {"aggregator": ActorStatus(name="aggregator", phase="running", problem=problem)}

    api = new_fleet_api(bus, prefix, metrics, status)
    await fleet.start_supervisor(api)
    url = f"http://127.0.0.1:{api.port}/healthz"
    metrics.processed(time.time() - 100, pending=42)
    assert 99 < metrics.oldest_unprocessed() < 110
    async with aiohttp.ClientSession() as session:
        async with session.get(url) as answer:
            assert answer.status == 503
            assert "100s behind" in (await answer.text()) or "101s behind" in (await answer.text())
        metrics.processed(time.time(), pending=0)
        assert metrics.oldest_unprocessed() == 0.0
        async with session.get(url) as answer:
            assert answer.status == 200


def test_standby_is_not_behind(bus: NatsBus, prefix: str) -> None:
    """An aggregator that does not hold the lease (no consumer) reports no lag problem,
    whatever its last figures were."""
    metrics = AggregatorMetrics()
    aggregator = new_aggregator(bus, prefix, metrics, max_lag=30.0)
    metrics.processed(time.time() - 1000, pending=5)
    assert metrics.oldest_unprocessed() > 900
    assert aggregator.problem() == ""
