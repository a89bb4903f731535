"""Engine actor against local servers that answer as each engine's documentation says.

Responses reproduced from: vLLM docs "Production Metrics" (``vllm:num_requests_running``,
``vllm:num_requests_waiting``, labelled by model_name) and its ``/health`` (200, empty);
llama.cpp ``tools/server/README.md`` (``/health`` 200 ``{"status": "ok"}`` or 503 while
loading; ``/slots`` with ``is_processing``; ``/metrics`` ``llamacpp:requests_processing`` /
``llamacpp:requests_deferred``, 501 without ``--metrics``); SGLang docs "Production
Metrics" (``sglang:num_running_reqs``, ``sglang:num_queue_reqs``) and its ``/health``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from nats.aio.msg import Msg

from actors.node.engine import EngineActor
from actors.runtime.bus import NatsBus
from actors.runtime.embedded import NatsServer
from schemas import codec
from schemas.events import Engine, EngineStatus
from schemas.subjects import EVENT_ENGINE, Subjects
from tests.support.fake_http import json_body, serve, text
from tests.support.fleet import Fleet, agent_config, node_events, wait_for

VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
vllm:num_requests_running{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 4.0
vllm:num_requests_waiting{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1234.0
"""

SGLANG_METRICS = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 7.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.0
"""

LLAMACPP_METRICS = """\
# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 2
# HELP llamacpp:requests_deferred Number of requests deferred.
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 5
"""

LLAMACPP_SLOTS = [
    {"id": 0, "n_ctx": 4096, "is_processing": True},
    {"id": 1, "n_ctx": 4096, "is_processing": False},
    {"id": 2, "n_ctx": 4096, "is_processing": True},
]
LLAMACPP_OK = {"status": "ok"}
LLAMACPP_LOADING = {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}
NO_METRICS = "This server does not support metrics endpoint."


async def hang(request: web.Request) -> web.Response:
    await asyncio.sleep(30)
    return web.Response(text="too late")


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.5)) as client:
        yield client


def actor(bus: NatsBus, prefix: str, tmp_path: Path, *specs: str, **settings: Any) -> EngineActor:
    config = agent_config("nats://unused", prefix, tmp_path, engines=list(specs), **settings)
    return EngineActor(config, bus, node_events(config))


async def probe_one(
    bus: NatsBus, prefix: str, tmp_path: Path, session: aiohttp.ClientSession, spec: str
) -> EngineStatus:
    engine = await actor(bus, prefix, tmp_path, spec).check(session)
    assert len(engine.engines) == 1
    return engine.engines[0]


async def test_vllm_load_is_summed_over_label_sets(
    bus: NatsBus, prefix: str, tmp_path: Path, session: aiohttp.ClientSession
) -> None:
    """vLLM: running and waiting are summed over every label set of /metrics."""
    async with serve({"/health": text(""), "/metrics": text(VLLM_METRICS)}) as url:
        status = await probe_one(bus, prefix, tmp_path, session, f"vllm={url}")
    assert status.healthy and status.in_flight == 5 and status.waiting == 4
    assert status.kind == "vllm" and status.url == url and status.reason == ""


async def test_sglang_load_from_metrics(
    bus: NatsBus, prefix: str, tmp_path: Path, session: aiohttp.ClientSession
) -> None:
    """SGLang: /health 200 and num_running_reqs / num_queue_reqs give the load."""
    async with serve({"/health": text(""), "/metrics": text(SGLANG_METRICS)}) as url:
        status = await probe_one(bus, prefix, tmp_path, session, f"sglang={url}")
    assert status.healthy and status.in_flight == 7 and status.waiting == 1


async def test_llamacpp_metrics_and_slots_fallback(
    bus: NatsBus, prefix: str, tmp_path: Path, session: aiohttp.ClientSession
) -> None:
    """llama.cpp: /metrics when enabled; without it, busy slots from /slots."""
    with_metrics = {"/health": json_body(LLAMACPP_OK), "/metrics": text(LLAMACPP_METRICS)}
    async with serve(with_metrics) as url:
        status = await probe_one(bus, prefix, tmp_path, session, f"llamacpp={url}")
    assert status.healthy and status.in_flight == 2 and status.waiting == 5

    slots_only = {
        "/health": json_body(LLAMACPP_OK),
        "/metrics": text(NO_METRICS, status=501),
        "/slots": json_body(LLAMACPP_SLOTS),
    }
    async with serve(slots_only) as url:
        status = await probe_one(bus, prefix, tmp_path, session, f"llamacpp={url}")
    assert status.healthy and status.in_flight == 2 and status.waiting is None


async def test_llamacpp_loading_is_unhealthy(
    bus: NatsBus, prefix: str, tmp_path: Path, session: aiohttp.ClientSession
) -> None:
    """llama.cpp answering 503 while it loads the model is unhealthy, saying so."""
    async with serve({"/health": json_body(LLAMACPP_LOADING, status=503)}) as url:
        status = await probe_one(bus, prefix, tmp_path, session, f"llamacpp={url}")
    assert not status.healthy and "loading" in status.reason


async def test_hung_refused_and_garbage_engines_are_unhealthy(
    bus: NatsBus, prefix: str, tmp_path: Path, session: aiohttp.ClientSession
) -> None:
    """A hung, a refusing and a garbage-talking engine are each unhealthy with a reason,
    probed concurrently within about one timeout, and the healthy one is unaffected."""
    async with (
        serve({"/health": hang}) as hung,
        serve({"/health": text(""), "/metrics": text("<html>oops</html>")}) as garbage,
        serve({"/health": text(""), "/metrics": text(VLLM_METRICS)}) as good,
    ):
        async with serve({}) as gone:
            pass  # its port is now closed: connections are refused
        specs = [f"vllm={hung}", f"vllm={gone}", f"sglang={garbage}", f"vllm={good}"]
        started = time.monotonic()
        engine = await actor(bus, prefix, tmp_path, *specs).check(session)
        elapsed = time.monotonic() - started
    by_url = {status.url: status for status in engine.engines}
    assert not by_url[hung].healthy and "no answer" in by_url[hung].reason
    assert not by_url[gone].healthy and "cannot connect" in by_url[gone].reason
    assert not by_url[garbage].healthy and "/metrics has no" in by_url[garbage].reason
    assert by_url[good].healthy
    assert engine.in_flight == 5
    assert elapsed < 5.0  # generous: one 0.5 s timeout, never the 30 s hang


async def test_actor_publishes_engine_event(
    fleet: Fleet, bus: NatsBus, prefix: str, tmp_path: Path
) -> None:
    """The actor publishes Engine on fleet.evt.<node>.engine with the total in flight."""
    got: list[Engine] = []

    async def collect(msg: Msg) -> None:
        got.append(codec.decode(msg.data, Engine, msg.subject))

    await bus.subscribe(Subjects(prefix).event("n1", EVENT_ENGINE), collect)
    await bus.flush()
    vllm = await fleet.serve({"/health": text(""), "/metrics": text(VLLM_METRICS)})
    sg = await fleet.serve({"/health": text(""), "/metrics": text(SGLANG_METRICS)})
    supervisor = await fleet.start_supervisor(
        actor(bus, prefix, tmp_path, f"vllm={vllm}", f"sglang={sg}", engine_interval=0.2)
    )
    await wait_for(lambda: len(got) >= 2)
    assert got[-1].in_flight == 12
    assert [status.kind for status in got[-1].engines] == ["vllm", "sglang"]
    assert supervisor.status["engine"].restarts == 0


async def test_no_engines_publishes_empty_engine(
    nats_server: NatsServer, bus: NatsBus, prefix: str, tmp_path: Path
) -> None:
    """With no engine configured the event says so: no engines, nothing in flight."""
    engine = await actor(bus, prefix, tmp_path).check(None)
    assert engine.engines == [] and engine.in_flight is None
