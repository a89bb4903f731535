"""/metrics of a running agent with fake GPUs: the series GPU alerting needs exist, and
the score and the status agree once the node is unhealthy."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from actors.node.agent import NodeAgent
from actors.node.http_api import HttpApiActor
from actors.runtime.bus import NatsBus
from schemas.events import Inject
from schemas.subjects import EVENT_INJECT
from tests.support.fleet import Fleet, wait_for, wait_record

README = Path(__file__).parents[2] / "docs" / "metrics.md"
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
TIMEOUT = aiohttp.ClientTimeout(total=5)


async def scrape(url: str) -> Samples:
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        async with session.get(f"{url}/metrics") as response:
            assert response.status == 200
            body = await response.text()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(body)
        for sample in family.samples
    }


def values(samples: Samples, name: str, **labels: str) -> list[float]:
    """Every value of ``name`` whose labels include ``labels``."""
    return [
        value
        for (found, pairs), value in samples.items()
        if found == name and labels.items() <= dict(pairs).items()
    ]


def one(samples: Samples, name: str, **labels: str) -> float:
    [value] = values(samples, name, **labels)
    return value


async def scrape_when(url: str, ready: Callable[[Samples], Any]) -> Samples | None:
    """One scrape of ``url``, if ``ready`` says it shows what the test waits for."""
    samples = await scrape(url)
    return samples if ready(samples) else None


def agent_url(agent: NodeAgent) -> str:
    assert agent.supervisor is not None
    [http] = [actor for actor in agent.supervisor.actors if isinstance(actor, HttpApiActor)]
    return f"http://127.0.0.1:{http.port}"


async def test_lost_gpu_and_xid_79_show_in_metrics_with_agreeing_score(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    await fleet.start_aggregator()
    agent = await fleet.start_agent()
    assert agent.supervisor is not None and await agent.supervisor.wait_ready(10)
    await wait_record(bus, prefix, "n1", lambda r: r.health_status == "healthy")
    url = agent_url(agent)

    healthy = await wait_for(
        lambda: scrape_when(url, lambda s: values(s, "node_agent_health_status"))
    )
    assert one(healthy, "node_agent_health_status", status="healthy") == 1
    assert one(healthy, "node_agent_health_score") >= 80
    assert one(healthy, "node_agent_health_check", check="xid", status="ok") == 1
    assert one(healthy, "node_agent_schedulability", schedulability="schedulable") == 1
    assert values(healthy, "node_agent_spot_notice") == []
    for name in [
        "node_agent_gpu_temperature_celsius",
        "node_agent_gpu_power_watts",
        "node_agent_gpu_power_limit_watts",
        "node_agent_gpu_memory_total_bytes",
        "node_agent_gpu_lost",
    ]:
        assert len(values(healthy, name)) == 2, name
    assert values(healthy, "node_agent_gpu_ecc_errors_total", type="uncorrected") == [0, 0]
    assert values(healthy, "node_agent_gpu_lost") == [0, 0]

    xid = Inject(ts=time.time(), node_id="n1", fault="xid", gpu=0, value=79)
    await fleet.publish_event(EVENT_INJECT, xid)
    lost = Inject(ts=time.time(), node_id="n1", fault="gpu-lost", gpu=1)
    await fleet.publish_event(EVENT_INJECT, lost)

    def broken(samples: Samples) -> bool:
        return values(samples, "node_agent_health_check", check="nvml", status="unhealthy") == [
            1
        ] and values(samples, "node_agent_health_check", check="xid", status="unhealthy") == [1]

    sick = await wait_for(lambda: scrape_when(url, broken))
    assert one(sick, "node_agent_health_status", status="unhealthy") == 1
    assert one(sick, "node_agent_health_status", status="healthy") == 0
    assert one(sick, "node_agent_health_score") < 50
    assert one(sick, "node_agent_gpu_xid_errors_total", gpu="0", xid="79") == 1
    assert one(sick, "node_agent_gpu_lost", gpu="1") == 1
    assert one(sick, "node_agent_gpu_lost", gpu="0") == 0
    # The lost GPU keeps its series, with no reading rather than a made-up 0.
    assert math.isnan(one(sick, "node_agent_gpu_temperature_celsius", gpu="1"))
    assert math.isnan(one(sick, "node_agent_gpu_memory_used_bytes", gpu="1"))
    assert one(sick, "node_agent_gpu_memory_used_bytes", gpu="0") > 0
    assert undocumented(sick) == set()
    # The record says what /metrics says.
    record = await wait_record(bus, prefix, "n1", lambda r: r.state == "unhealthy")
    assert record.health_score is not None and record.health_score < 50


def undocumented(samples: Samples) -> set[str]:
    """Series names a scrape shows that the README's metrics tables do not list (the
    client library's own ``_created`` companions aside)."""
    readme = README.read_text()
    names = {name for name, _ in samples if not name.endswith("_created")}
    return {name for name in names if f"| `{name}" not in readme}
