"""The agent's HTTP endpoints (/metrics, /healthz, /status, /v1/node/inventory) and
``node-agent status``."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from actors.cli.node_agent import main
from actors.node.agent import NodeAgent
from actors.node.http_api import HttpApiActor
from actors.runtime.bus import NatsBus
from actors.runtime.supervisor import ActorStatus
from schemas import codec
from schemas.inventory import NodeInventory
from tests.support.fake_http import serve, text
from tests.support.fleet import Fleet, node_events, wait_for

VLLM_METRICS = "vllm:num_requests_running 1\nvllm:num_requests_waiting 0\n"
TIMEOUT = aiohttp.ClientTimeout(total=5)


async def get(url: str) -> tuple[int, str]:
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        async with session.get(url) as response:
            return response.status, await response.text()


def http_actor(agent: NodeAgent) -> HttpApiActor:
    assert agent.supervisor is not None
    found = [actor for actor in agent.supervisor.actors if isinstance(actor, HttpApiActor)]
    assert len(found) == 1
    return found[0]


@pytest.fixture
async def agent_url(fleet: Fleet) -> str:
    """A running agent with 2 fake GPUs, one (fake) vLLM and its health report; its URL."""
    vllm = await fleet.serve({"/health": text(""), "/metrics": text(VLLM_METRICS)})
    config = fleet.config(
        engines=[f"vllm={vllm}"],
        engine_interval=0.2,
        # One health report at start and no other during the test, so pages agree.
        health_interval=3600.0,
        # The stand-in never finishes its requests: stop without draining for them.
        shutdown_drain=False,
    )
    agent = await fleet.start_agent(config)
    assert agent.supervisor is not None and await agent.supervisor.wait_ready(10)
    http = http_actor(agent)
    await wait_for(lambda: http.health is not None and http.engine is not None)
    await wait_for(lambda: agent.metrics.value("node_agent_sequence_number"))
    return f"http://127.0.0.1:{http.port}"


async def test_metrics_page_is_prometheus_text_with_agent_metrics(agent_url: str) -> None:
    """/metrics parses as Prometheus text and carries the agent, engine and per-GPU series."""
    status, body = await get(f"{agent_url}/metrics")
    assert status == 200
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(body)
        for sample in family.samples
    }
    names = {name for name, _ in samples}
    for expected in [
        "node_agent_heartbeat_total",
        "node_agent_heartbeat_failures_total",
        "node_agent_health_score",
        "node_agent_engine_healthy",
        "node_agent_uptime_seconds",
        "node_agent_sequence_number",
        "node_agent_gpu_temperature_celsius",
        "node_agent_gpu_utilization_percent",
        "node_agent_gpu_memory_used_bytes",
    ]:
        assert expected in names, expected
    _, status_body = await get(f"{agent_url}/status")
    health = codec.decode(status_body.encode(), dict[str, Any])["health"]
    assert samples[("node_agent_health_score", ())] == health["score"]
    assert samples[("node_agent_sequence_number", ())] >= 1
    gpu_labels = {
        labels for name, labels in samples if name == "node_agent_gpu_temperature_celsius"
    }
    assert len(gpu_labels) == 2 and all(
        dict(labels).keys() == {"gpu", "uuid"} for labels in gpu_labels
    )
    engines = [value for (name, _), value in samples.items() if name == "node_agent_engine_healthy"]
    assert engines == [1.0]


async def test_status_page_and_cli(agent_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """/status is JSON with node, seq, health, engine, latency and every actor; the
    ``node-agent status`` command prints it readably."""
    status, body = await get(f"{agent_url}/status")
    assert status == 200
    document: dict[str, Any] = codec.decode(body.encode(), dict[str, Any])
    assert document["node"] == "n1" and document["cluster"] == "c1"
    assert document["schedulability"] == "schedulable" and document["seq"] >= 1
    health = document["health"]
    assert 0 <= health["score"] <= 100 and health["components"]
    assert document["engine"]["engines"][0]["kind"] == "vllm"
    assert document["engine"]["in_flight"] == 1
    phases = {name: actor["phase"] for name, actor in document["actors"].items()}
    assert phases == {
        name: "running"
        for name in [
            "inventory",
            "heartbeat",
            "health",
            "engine",
            "latency",
            "http_api",
            "commands",
            "spot",
            "gateway",
            "scheduler",
            "workloads",
            "standing",
            "settings",
        ]
    }

    assert document["gpu_source"] == "fake" and len(document["gpus"]) == 2
    assert document["passthrough_gpus"] == []

    assert await asyncio.to_thread(main, ["status", "--url", agent_url]) == 0
    out = capsys.readouterr().out
    assert "n1 (cluster c1)" in out and f"{health['status']} {health['score']}/100" in out
    assert "vllm" in out and "healthy, running 1" in out and "heartbeat" in out
    assert "gpus      2 (fake)" in out
    gpu_rows = [line.split() for line in out.splitlines() if line.startswith("  0 ")]
    assert gpu_rows and gpu_rows[0][1:5] == ["NVIDIA", "H100", "80GB", "HBM3"]


async def test_inventory_page_is_the_node_in_one_read(agent_url: str) -> None:
    """/v1/node/inventory decodes as NodeInventory: the sample's 2 GPUs and capacity, the
    engine, and the labels the heartbeat carries with the node's own found labels."""
    status, body = await get(f"{agent_url}/v1/node/inventory")
    assert status == 200
    inventory = codec.decode(body.encode(), NodeInventory)
    assert (inventory.node_id, inventory.cluster) == ("n1", "c1")
    assert inventory.sample is not None and len(inventory.sample.gpus) == 2
    assert inventory.sample.capacity.gpus_total == 2
    assert inventory.sample.capacity.cpu_cores_available is not None
    assert inventory.engine is not None and inventory.engine.engines[0].kind == "vllm"
    assert inventory.found_labels == {
        "gpu.count": "2",
        "gpu.product": "NVIDIA-H100-80GB-HBM3",
        "gpu.memory": "81559",
    }
    assert inventory.labels == inventory.found_labels


async def test_status_cli_says_when_agent_is_unreachable(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``node-agent status`` against nothing is one clear error line and exit 1."""
    async with serve({}) as gone:
        pass  # closed again: connections are refused
    assert await asyncio.to_thread(main, ["status", "--url", gone, "--timeout", "2"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: cannot reach the agent") and err.count("\n") == 1


async def test_healthz_follows_actor_phases(fleet: Fleet, bus: NatsBus) -> None:
    """/healthz is 200 while every actor runs and 503, naming it, when one does not."""
    phases = {
        "heartbeat": ActorStatus(name="heartbeat", phase="running"),
        "inventory": ActorStatus(name="inventory", phase="running"),
    }
    config = fleet.config()
    http = HttpApiActor(config, bus, node_events(config), lambda: phases)
    supervisor = await fleet.start_supervisor(http, ready_timeout=5)
    phases["http_api"] = supervisor.status["http_api"]
    status, _ = await get(f"http://127.0.0.1:{http.port}/healthz")
    assert status == 200
    phases["inventory"].phase = "backoff"
    status, body = await get(f"http://127.0.0.1:{http.port}/healthz")
    assert status == 503 and "inventory" in body
