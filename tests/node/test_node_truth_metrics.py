"""The seed's ``node_agent_vllm_healthy`` gauge: an alias of the engine-health gauge for
vLLM engines, so dashboards built on the seed keep working."""

from __future__ import annotations

import time

from actors.node.metrics import AgentMetrics
from schemas.events import Engine, EngineStatus


def test_vllm_healthy_is_an_alias_of_engine_healthy_for_vllm() -> None:
    """Each vLLM engine's health shows under both names; other kinds only under the new."""
    metrics = AgentMetrics()
    vllm = "http://127.0.0.1:8000"
    sglang = "http://127.0.0.1:30000"
    metrics.observe_engine(
        Engine(
            ts=time.time(),
            engines=[
                EngineStatus(kind="vllm", url=vllm, healthy=True),
                EngineStatus(kind="sglang", url=sglang, healthy=False),
            ],
        )
    )
    assert metrics.value("node_agent_vllm_healthy", {"url": vllm}) == 1
    assert metrics.value("node_agent_engine_healthy", {"kind": "vllm", "url": vllm}) == 1
    assert metrics.value("node_agent_vllm_healthy", {"url": sglang}) is None
    metrics.observe_engine(
        Engine(ts=time.time(), engines=[EngineStatus(kind="vllm", url=vllm, healthy=False)])
    )
    assert metrics.value("node_agent_vllm_healthy", {"url": vllm}) == 0
    assert metrics.value("node_agent_engine_healthy", {"kind": "vllm", "url": vllm}) == 0
