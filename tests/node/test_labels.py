"""Node labels: given as --label flags, NODE_AGENT_LABELS or a TOML [labels] table,
validated, and ahead of the node's own (its identity: GPUs and cloud; served models),
which never overwrite them, in each heartbeat."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest

from actors.cli.common import settings_from
from actors.cli.node_agent import parser
from actors.node.cloud import Metadata, Provider
from actors.node.config import ENV_PREFIX, AgentConfig
from actors.node.engine import EngineActor
from actors.node.inventory.fake_gpus import NAME, FakeGpus
from actors.node.labels import (
    clashes,
    cloud_labels,
    found_labels,
    gpu_labels,
    node_labels,
    served_models,
)
from actors.runtime.bus import NatsBus
from actors.runtime.config import ConfigError, build
from schemas.base import MAX_LABELS
from schemas.events import Capacity, Engine, EngineStatus, HostFacts, Sample
from schemas.pci import PassthroughGpu
from tests.support.fake_http import json_body, serve, text
from tests.support.fleet import Fleet, agent_config, node_events, wait_record
from tests.support.metadata_fakes import FakeAws, FakeAzure, FakeGcp, FakeServer


def test_label_flags_env_and_toml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--label is repeatable, NODE_AGENT_LABELS is comma separated, TOML is a table;
    flags beat env beats TOML as a whole."""
    toml = tmp_path / "agent.toml"
    toml.write_text('[labels]\nrack = "r7"\ntier = "gold"\n')
    from_toml = build(AgentConfig, ENV_PREFIX, file=toml, env={})
    assert from_toml.labels == {"rack": "r7", "tier": "gold"}
    from_env = build(AgentConfig, ENV_PREFIX, env={"NODE_AGENT_LABELS": "a=1,b=two"})
    assert from_env.labels == {"a": "1", "b": "two"}
    monkeypatch.delenv("NODE_AGENT_LABELS", raising=False)
    args = parser().parse_args(["start", "--label", "gpu=h100", "--label", "team=ml"])
    assert settings_from(args, AgentConfig, ENV_PREFIX).labels == {"gpu": "h100", "team": "ml"}


@pytest.mark.parametrize(
    ("items", "message"),
    [
        (["novalue"], "labels: 'novalue' is not KEY=VALUE"),
        (["bad key=v"], "labels"),
        (["k=has space"], "labels"),
        ([f"k{i}=v" for i in range(33)], "labels"),
        (["k=" + "v" * 129], "labels"),
    ],
)
def test_bad_labels_are_one_line(items: list[str], message: str) -> None:
    """Labels without '=', bad keys or values, too long or too many: one ConfigError line."""
    with pytest.raises(ConfigError) as caught:
        build(AgentConfig, ENV_PREFIX, env={}, flags={"labels": items})
    assert message in str(caught.value) and "\n" not in str(caught.value)


def engine_with(*models: list[str]) -> Engine:
    return Engine(
        ts=1.0,
        engines=[
            EngineStatus(kind="vllm", url="http://x", healthy=True, models=names)
            for names in models
        ],
    )


def test_models_label_is_cleaned_sorted_and_bounded() -> None:
    """Served models become one 'model' label: deduplicated, sorted, '+'-joined, charset
    cleaned, cut at whole names; operator labels win over automatic ones."""
    engine = engine_with(["b/model one"], ["a+b", "b/model one"])
    assert served_models(engine) == "a_b+b/model_one"
    assert served_models(engine_with(["x" * 100, "y" * 100])) == "x" * 100
    assert served_models(None) == ""
    found = found_labels(None, {"zone": "z_1"}, engine)
    labels = node_labels({"model": "pinned", "gpu": "h100"}, found)
    assert labels == {"model": "pinned", "gpu": "h100", "zone": "z_1"}


@pytest.mark.parametrize("kind", ["vllm", "sglang", "llamacpp"])
async def test_engines_report_served_models(
    bus: NatsBus, prefix: str, tmp_path: Path, kind: str
) -> None:
    """Each engine kind's /v1/models (OpenAI list format) gives its served model names;
    an engine without it reports none."""
    health = json_body({"status": "ok"}) if kind == "llamacpp" else text("")
    models = {"object": "list", "data": [{"id": "m-1", "object": "model"}, {"id": "m-2"}]}
    routes = {"/health": health, "/metrics": text(""), "/v1/models": json_body(models)}
    async with (
        serve(routes) as url,
        serve({"/health": health, "/metrics": text("")}) as bare,
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session,
    ):
        config = agent_config(
            "nats://unused", prefix, tmp_path, engines=[f"{kind}={url}", f"{kind}={bare}"]
        )
        engine = await EngineActor(config, bus, node_events(config)).check(session)
    assert [e.models for e in engine.engines] == [["m-1", "m-2"], []]
    assert engine.engines[0].url == url


async def test_cloud_facts_from_each_metadata_service(fleet: Fleet, bus: NatsBus) -> None:
    """Region, zone, instance type and spot/on-demand, read from each cloud's documented
    metadata answers (the fakes of tests/support/metadata_fakes.py)."""
    aws = await fleet.start_fake(FakeAws())
    gcp = await fleet.start_fake(FakeGcp())
    azure = await fleet.start_fake(FakeAzure())
    got = {}
    fakes: list[tuple[Provider, FakeServer]] = [("aws", aws), ("gcp", gcp), ("azure", azure)]
    async with aiohttp.ClientSession() as session:
        for provider, fake in fakes:
            config = fleet.config(spot_provider=provider, metadata_url=fake.url)
            metadata = Metadata(config, aiohttp.ClientTimeout(total=2))
            got[provider] = cloud_labels(await metadata.facts(session, provider))
    assert got == {
        "aws": {
            "provider": "aws",
            "region": "us-east-1",
            "zone": "us-east-1a",
            "instance_type": "p5.48xlarge",
            "lifecycle": "spot",
        },
        "gcp": {
            "provider": "gcp",
            "region": "us-central1",
            "zone": "us-central1-a",
            "instance_type": "a3-highgpu-8g",
            "lifecycle": "on-demand",
        },
        "azure": {
            "provider": "azure",
            "region": "eastus",
            "zone": "2",
            "instance_type": "Standard_ND96isr_H100_v5",
            "lifecycle": "spot",
        },
    }


async def test_cloud_labels_reach_the_record_despite_metadata_errors(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """An agent on AWS whose metadata service first fails (503) still gets its placement
    labels into its heartbeats and record, next to the operator's."""
    aws = await fleet.start_fake(FakeAws())
    aws.failures = [503, 503]
    await fleet.start_aggregator()
    config = fleet.config(
        spot_provider="aws", metadata_url=aws.url, spot_poll_interval=0.1, labels={"team": "ml"}
    )
    await fleet.start_agent(config)
    record = await wait_record(bus, prefix, "n1", lambda r: "zone" in r.labels)
    assert record.labels == {
        "team": "ml",
        "gpu.count": "2",
        "gpu.product": "NVIDIA-H100-80GB-HBM3",
        "gpu.memory": "81559",
        "provider": "aws",
        "region": "us-east-1",
        "zone": "us-east-1a",
        "instance_type": "p5.48xlarge",
        "lifecycle": "spot",
    }


def sample_of(gpus: int, passthrough: int = 0, error: str = "", driver: str = "") -> Sample:
    """A sample with ``gpus`` stand-in H100s (as NVML would name them) and ``passthrough``
    vfio-bound ones."""
    source = FakeGpus(gpus, "n1").read()
    bound = [
        PassthroughGpu(pci_bus_id=f"0000:{0x40 + i:02x}:00.0", device_id="0x2330", name=NAME)
        for i in range(passthrough)
    ]
    return Sample(
        ts=1.0,
        capacity=Capacity(
            cpu_cores=8,
            cpu_percent=0.0,
            load_avg_1m=0.0,
            memory_total=1,
            memory_available=1,
            gpus_total=gpus,
            gpus_available=gpus,
            storage_total=1,
            storage_available=1,
        ),
        gpus=source,
        gpu_source="nvml",
        gpu_error=error,
        host=HostFacts(uptime_s=1.0, memory_used_pct=1.0, gpu_driver_version=driver),
        passthrough_gpus=bound,
    )


def test_gpu_labels_say_what_the_sample_found() -> None:
    """Product (NVML's name, '-'-joined), count (passthrough included), memory in MiB,
    passthrough and driver; a node without GPUs says gpu.count 0; nothing before a sample,
    nor while NVML fails with no GPU read (0 would be a false claim)."""
    assert gpu_labels(sample_of(8, driver="580.159.04")) == {
        "gpu.count": "8",
        "gpu.product": "NVIDIA-H100-80GB-HBM3",
        "gpu.memory": "81559",
        "driver": "580.159.04",
    }
    assert gpu_labels(sample_of(0, passthrough=2)) == {
        "gpu.count": "2",
        "gpu.product": "NVIDIA-H100-80GB-HBM3",
        "gpu.passthrough": "2",
    }
    assert gpu_labels(sample_of(0)) == {"gpu.count": "0"}
    assert gpu_labels(sample_of(0, error="Driver Not Loaded")) == {}
    assert gpu_labels(None) == {}


def test_an_operators_labels_are_never_overwritten() -> None:
    """An operator's label keeps its value whatever the node finds (the clash is named);
    operator labels come first, so at MAX_LABELS it is the node's own that are left out."""
    found = found_labels(sample_of(8), {"provider": "aws", "zone": "us-east-1a"})
    given = {"gpu.count": "16", "rack": "r7"}
    labels = node_labels(given, found)
    assert labels["gpu.count"] == "16" and labels["rack"] == "r7"
    assert labels["provider"] == "aws" and labels["gpu.product"] == "NVIDIA-H100-80GB-HBM3"
    assert clashes(given, found) == {"gpu.count": ("16", "8")}
    full = {f"k{i}": "v" for i in range(MAX_LABELS)}
    assert node_labels(full, found) == full


async def test_a_clash_is_logged_once_and_the_operator_wins(
    fleet: Fleet, bus: NatsBus, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """An agent told gpu.count=16 on a 2-GPU node: its record says 16 (the operator's),
    the rest of its identity labels are its own, and one warning names both values."""
    await fleet.start_aggregator()
    await fleet.start_agent(fleet.config(labels={"gpu.count": "16"}))
    record = await wait_record(bus, prefix, "n1", lambda r: "gpu.product" in r.labels)
    assert record.labels["gpu.count"] == "16" and record.labels["gpu.memory"] == "81559"
    await wait_record(bus, prefix, "n1", lambda r: r.last_seq >= record.last_seq + 2)
    warned = [
        entry
        for entry in caplog.records
        if entry.msg == "an operator's label overrides what the node found"
    ]
    assert len(warned) == 1
    assert (warned[0].label, warned[0].operator, warned[0].found) == ("gpu.count", "16", "2")  # type: ignore[attr-defined]
