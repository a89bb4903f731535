"""Labels: operator-given and engine-derived labels travel in heartbeats into NodeRecord,
and ``GET /nodes?label=`` and ``fleetctl nodes -l`` filter by them (AND)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import aiohttp
import pytest

from actors.cli.render import describe
from actors.fleet.labels import BadSelector, matches, parse_selector, parse_selectors
from actors.fleet.metrics import AggregatorMetrics
from actors.runtime.bus import NatsBus
from tests.support.fake_http import json_body, text
from tests.support.fleet import Fleet, new_aggregator, new_fleet_api, wait_for, wait_record

MODELS = {"object": "list", "data": [{"id": "meta-llama/Llama-3.1-8B-Instruct", "object": "model"}]}


def test_selectors_parse_and_refuse() -> None:
    """key=value parses; no '=', a bad key or a value with a space or comma is refused."""
    assert parse_selector("zone=us-east-1a") == ("zone", "us-east-1a")
    assert parse_selector("empty=") == ("empty", "")
    for bad in ["novalue", "=v", "bad key=v", "k=a b", "k=a,b", "-k=v", "k" * 64 + "=v"]:
        with pytest.raises(BadSelector):
            parse_selector(bad)
    with pytest.raises(Exception, match="at most 32"):
        parse_selectors([f"k{i}=v" for i in range(33)])


def test_matching_is_and_and_knows_joined_values() -> None:
    """Every selector must match; a '+'-joined value matches any one of its items."""
    labels = {"gpu": "h100", "model": "llama+mistral"}
    assert matches(labels, [])
    assert matches(labels, [("gpu", "h100"), ("model", "mistral")])
    assert matches(labels, [("model", "llama+mistral")])
    assert not matches(labels, [("gpu", "h100"), ("model", "qwen")])
    assert not matches(labels, [("zone", "a")])


async def fleetctl(*args: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "actors.cli.fleetctl", *args),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    stdout, stderr = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode is not None
    return process.returncode, stdout.decode(), stderr.decode()


@pytest.mark.slow
async def test_labels_reach_records_and_filter_listings(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """Two agents with --label-style labels (one serving a vLLM model) show their labels in
    NodeRecord; /nodes?label= and fleetctl nodes -l filter by them with AND; describe
    shows them."""
    metrics = AggregatorMetrics()
    api = new_fleet_api(bus, prefix, metrics)
    await fleet.start_supervisor(new_aggregator(bus, prefix, metrics), api)
    engine = await fleet.serve(
        {"/health": text(""), "/metrics": text(""), "/v1/models": json_body(MODELS)}
    )
    await fleet.start_agent(
        fleet.config(
            "n1",
            labels={"gpu": "h100", "rack": "r1"},
            engines=[f"vllm={engine}"],
            engine_interval=0.2,
        )
    )
    await fleet.start_agent(fleet.config("n2", labels={"gpu": "a100", "rack": "r1"}))
    n1 = await wait_record(bus, prefix, "n1", lambda r: "model" in r.labels)
    assert n1.labels == {
        "gpu": "h100",
        "rack": "r1",
        "gpu.count": "2",
        "gpu.product": "NVIDIA-H100-80GB-HBM3",
        "gpu.memory": "81559",
        "model": "meta-llama/Llama-3.1-8B-Instruct",
    }
    assert n1.heartbeat is not None and n1.heartbeat.labels == n1.labels
    await wait_record(bus, prefix, "n2", lambda r: r.labels.get("gpu") == "a100")
    await wait_for(
        lambda: "model" in api.feed.records.get("n1", n1).labels and "n2" in api.feed.records
    )
    base = f"http://127.0.0.1:{api.port}/nodes"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:

        async def listed(query: str) -> list[str]:
            async with session.get(base + query) as response:
                assert response.status == 200
                return [node["node_id"] for node in await response.json()]

        assert await listed("?label=rack=r1") == ["n1", "n2"]
        assert await listed("?label=rack=r1&label=gpu=h100") == ["n1"]
        assert await listed("?label=model=meta-llama/Llama-3.1-8B-Instruct") == ["n1"]
        assert await listed("?label=gpu=h100&label=rack=r2") == []
        async with session.get(base + "?label=nope") as response:
            assert response.status == 400
            assert "expected key=value" in (await response.json())["error"]
    code, out, err = await fleetctl(
        "nodes",
        "--server",
        fleet.url,
        "--prefix",
        prefix,
        "-l",
        "rack=r1",
        "-l",
        "gpu=a100",
        "-o",
        "json",
    )
    assert (code, err) == (0, "")
    assert [record["node_id"] for record in json.loads(out)] == ["n2"]
    code, out, err = await fleetctl("nodes", "--server", fleet.url, "-l", "bad")
    assert code == 1 and err.startswith("error: label selector 'bad'")
    assert (
        "Labels:          gpu=h100 gpu.count=2 gpu.memory=81559 gpu.product=NVIDIA-H100-80GB-HBM3 "
        "model=meta-llama/Llama-3.1-8B-Instruct rack=r1 (the node's claims)"
    ) in (describe.describe(n1, [], [], n1.last_seen))
