"""Node labels: given as --label flags, NODE_AGENT_LABELS or a TOML [labels] table,
validated, merged over the automatic ones (served models) into each heartbeat."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest

from actors.cli.common import settings_from
from actors.cli.node_agent import parser
from actors.node.config import ENV_PREFIX, AgentConfig
from actors.node.engine import EngineActor
from actors.node.labels import cloud_labels, node_labels, served_models
from actors.node.spot import Provider, SpotActor
from actors.runtime.bus import NatsBus
from actors.runtime.config import ConfigError, build
from schemas.events import Engine, EngineStatus
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
    labels = node_labels({"model": "pinned", "gpu": "h100"}, engine, {"zone": "z 1"})
    assert labels == {"zone": "z_1", "model": "pinned", "gpu": "h100"}


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
            spot = SpotActor(config, bus, node_events(config))
            got[provider] = cloud_labels(await spot.facts(session, provider, fake.url))
    assert got == {
        "aws": {
            "region": "us-east-1",
            "zone": "us-east-1a",
            "instance_type": "p5.48xlarge",
            "lifecycle": "spot",
        },
        "gcp": {
            "region": "us-central1",
            "zone": "us-central1-a",
            "instance_type": "a3-highgpu-8g",
            "lifecycle": "on-demand",
        },
        "azure": {
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
        "region": "us-east-1",
        "zone": "us-east-1a",
        "instance_type": "p5.48xlarge",
        "lifecycle": "spot",
        "team": "ml",
    }
