"""The node's OpenAI-compatible gateway against a real nats-server and in-process engines
that answer like llama.cpp's server: routing by load, limits, loading and unknown models,
streams passed through chunk by chunk, and drains that wait for the gateway's requests."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import aiohttp
import nats
import pytest
from aiohttp import web
from nats.aio.msg import Msg

from actors.node.gateway.actor import PORT_FILE, GatewayActor
from actors.runtime.bus import NatsBus
from actors.runtime.embedded import NatsServer
from schemas import codec, signing
from schemas.events import (
    Capacity,
    Gateway,
    Gpu,
    NodeState,
    Sample,
    Workload,
    Workloads,
    WorkloadState,
)
from schemas.messages import Drain
from schemas.subjects import (
    EVENT_GATEWAY,
    EVENT_SAMPLE,
    EVENT_STATE,
    EVENT_WORKLOADS,
    Subjects,
)
from tests.support.commanding import Results, send
from tests.support.fleet import Fleet, node_events, wait_for

MODEL = "tiny.gguf"
GIB = 1024**3


class FakeLlama:
    """An in-process stand-in for llama.cpp's HTTP server as its README documents it
    (tools/server/README.md): ``GET /health`` is 503 ``{"error": {"code": 503, "message":
    "Loading model", "type": "unavailable_error"}}`` while loading, then 200 ``{"status":
    "ok"}``; ``GET /v1/models`` lists the model; ``POST /v1/chat/completions`` and
    ``/v1/completions`` answer an OpenAI completion, or with ``"stream": true`` server-sent
    events ``data: {chunk}`` ending in ``data: [DONE]``. The first chunk is sent at once,
    the others only once ``release`` is set, so a test controls when an answer ends."""

    def __init__(self, model: str = MODEL) -> None:
        self.model = model
        self.release = asyncio.Event()
        self.received = 0
        self.sent_last = False
        self.port = 0

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": self.model, "object": "model"}]}
        )

    async def complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received += 1
        if not body.get("stream"):
            await self.release.wait()
            return web.json_response(
                {
                    "object": "chat.completion",
                    "model": self.model,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}],
                }
            )
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for n, word in enumerate(["one", "two", "three"]):
            if n == 1:
                await self.release.wait()
            chunk = {"object": "chat.completion.chunk", "choices": [{"delta": {"content": word}}]}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        self.sent_last = True
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    @classmethod
    async def started(cls, stack: AsyncExitStack, model: str = MODEL) -> FakeLlama:
        fake = cls(model)
        app = web.Application()
        app.router.add_get("/health", fake.health)
        app.router.add_get("/v1/models", fake.models)
        app.router.add_post("/v1/chat/completions", fake.complete)
        app.router.add_post("/v1/completions", fake.complete)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        fake.port = runner.addresses[0][1]
        # Release before cleanup, so a held handler never holds the test's teardown.
        stack.push_async_callback(runner.cleanup)
        stack.callback(fake.release.set)
        return fake


def workload(name: str, port: int, state: WorkloadState = "ready", **fields: Any) -> Workload:
    return Workload(
        name=name, engine="llamacpp", state=state, since=time.time(), port=port, model=MODEL,
        **fields,
    )  # fmt: skip


def sample(free_gib: list[int]) -> Sample:
    """A sample whose GPU ``i`` has ``free_gib[i]`` GiB free of 80."""
    capacity = Capacity(
        cpu_cores=8, cpu_percent=1, load_avg_1m=0.1, memory_total=GIB, memory_available=GIB,
        gpus_total=len(free_gib), gpus_available=len(free_gib), storage_total=GIB,
        storage_available=GIB,
    )  # fmt: skip
    gpus = [
        Gpu(
            index=i,
            uuid=f"GPU-{i}",
            name="H100",
            pci_bus_id=f"0:{i}",
            memory_total=80 * GIB,
            memory_used=(80 - free) * GIB,
        )
        for i, free in enumerate(free_gib)
    ]
    return Sample(ts=time.time(), capacity=capacity, gpus=gpus)


@pytest.fixture
async def stack() -> AsyncIterator[AsyncExitStack]:
    async with AsyncExitStack() as exits:
        yield exits


@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
        yield session


async def start_gateway(fleet: Fleet, **settings: Any) -> tuple[GatewayActor, str]:
    """A gateway actor of node n1 (listening from the start) and its base URL."""
    values: dict[str, Any] = {"gateway": "on", "gateway_port": 0, "gateway_max_in_flight": 1}
    config = fleet.config(**(values | settings))
    gateway = GatewayActor(config, fleet.bus, node_events(config))
    await fleet.start_supervisor(gateway)
    port = await wait_for(lambda: gateway.port)
    return gateway, f"http://127.0.0.1:{port}"


async def publish_workloads(fleet: Fleet, gateway: GatewayActor, *workloads: Workload) -> None:
    """Publish the node's workloads, as its own workload actor would, and wait until
    the gateway knows them."""
    await fleet.publish_event(EVENT_WORKLOADS, Workloads(ts=time.time(), workloads=[*workloads]))
    names = {(w.name, w.state, w.port) for w in workloads if w.state != "stopped"}
    await wait_for(
        lambda: (
            {
                (lane.workload.name, lane.workload.state, lane.workload.port)
                for lane in gateway.lanes.values()
            }
            == names
        )
    )


def chat(stream: bool = False, model: str = MODEL) -> dict[str, Any]:
    return {"model": model, "stream": stream, "messages": [{"role": "user", "content": "hi"}]}


async def post(
    client: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    path: str = "/v1/chat/completions",
) -> tuple[int, dict[str, Any], dict[str, str]]:
    async with client.post(url + path, json=body) as response:
        return response.status, await response.json(), dict(response.headers)


def is_openai_error(body: dict[str, Any], code: str) -> bool:
    error = body.get("error", {})
    return set(error) == {"message", "type", "param", "code"} and error["code"] == code


async def test_routes_by_load_then_free_gpu_memory(
    fleet: Fleet, stack: AsyncExitStack, client: aiohttp.ClientSession
) -> None:
    """Of two idle workloads of one model the one with more free GPU memory gets the
    first request; the second goes to the other, which now has fewer in flight."""
    gateway, url = await start_gateway(fleet)
    roomy, tight = await FakeLlama.started(stack), await FakeLlama.started(stack)
    await fleet.publish_event(EVENT_SAMPLE, sample([10, 70]))
    await wait_for(lambda: gateway.free_memory.get(1) == 70 * GIB)
    await publish_workloads(
        fleet, gateway, workload("a", tight.port, gpus=[0]), workload("b", roomy.port, gpus=[1])
    )
    first = asyncio.create_task(post(client, url, chat()))
    await wait_for(lambda: roomy.received == 1)
    second = asyncio.create_task(post(client, url, chat()))
    await wait_for(lambda: tight.received == 1)
    assert roomy.received == 1 and gateway.in_flight == 2
    roomy.release.set()
    tight.release.set()
    for task in (first, second):
        status, body, _ = await task
        assert status == 200 and body["choices"][0]["message"]["content"] == "hi"
    async with client.get(f"{url}/v1/models") as response:
        listed = await response.json()
    assert listed["object"] == "list" and [m["id"] for m in listed["data"]] == [MODEL]
    metrics = gateway.events.metrics
    assert metrics.value("node_agent_gateway_requests_total", {"model": MODEL, "code": "200"}) == 2
    assert metrics.value("node_agent_gateway_request_duration_seconds_count", {"model": MODEL}) == 2


async def test_429_beyond_max_pending(
    fleet: Fleet, stack: AsyncExitStack, client: aiohttp.ClientSession
) -> None:
    """With one in flight and max_pending waiting, the next request is answered 429 with
    Retry-After in OpenAI's error format; the waiting one is served afterwards."""
    gateway, url = await start_gateway(fleet)
    engine = await FakeLlama.started(stack)
    await publish_workloads(fleet, gateway, workload("a", engine.port, max_pending=1))
    held = asyncio.create_task(post(client, url, chat()))
    queued = asyncio.create_task(post(client, url, chat()))
    await wait_for(lambda: gateway.in_flight == 1 and gateway.waiting == 1)
    metrics = gateway.events.metrics
    assert metrics.value("node_agent_gateway_queue_depth", {"model": MODEL}) == 1
    status, body, headers = await post(client, url, chat())
    assert status == 429 and is_openai_error(body, "queue_full")
    assert headers["Retry-After"] == "1"
    assert engine.received == 1
    engine.release.set()
    assert [(await task)[0] for task in (held, queued)] == [200, 200]
    assert engine.received == 2 and gateway.in_flight == gateway.waiting == 0
    assert metrics.value("node_agent_gateway_requests_total", {"model": MODEL, "code": "429"}) == 1


async def test_loading_model_503_and_unknown_model_404(
    fleet: Fleet, stack: AsyncExitStack, client: aiohttp.ClientSession
) -> None:
    """A model only loading answers 503 with Retry-After and is not listed; a model the
    node does not serve answers 404; both in OpenAI's error format."""
    gateway, url = await start_gateway(fleet)
    engine = await FakeLlama.started(stack)
    await publish_workloads(fleet, gateway, workload("a", engine.port, state="starting"))
    status, body, headers = await post(client, url, chat(), "/v1/completions")
    assert status == 503 and is_openai_error(body, "model_loading")
    assert int(headers["Retry-After"]) > 0
    status, body, _ = await post(client, url, chat(model="nope"))
    assert status == 404 and is_openai_error(body, "model_not_found")
    assert body["error"]["type"] == "invalid_request_error"
    async with client.get(f"{url}/v1/models") as response:
        assert (await response.json())["data"] == []
    assert engine.received == 0
    metrics = gateway.events.metrics
    assert metrics.value("node_agent_gateway_requests_total", {"model": "unknown", "code": "404"})


async def test_stream_passes_through_chunk_by_chunk(
    fleet: Fleet, stack: AsyncExitStack, client: aiohttp.ClientSession
) -> None:
    """A streamed answer's first event reaches the client while the engine still holds
    the rest; the whole stream arrives unchanged, ending in [DONE]."""
    gateway, url = await start_gateway(fleet)
    engine = await FakeLlama.started(stack)
    await publish_workloads(fleet, gateway, workload("a", engine.port))
    async with client.post(f"{url}/v1/chat/completions", json=chat(stream=True)) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/event-stream")
        first = await asyncio.wait_for(response.content.readuntil(b"\n\n"), 5)
        assert b'"one"' in first and not engine.sent_last
        engine.release.set()
        rest = await response.content.read()
    assert engine.sent_last
    assert rest.count(b"data: ") == 3 and rest.endswith(b"data: [DONE]\n\n")


async def test_client_leaving_a_stream_frees_its_slot(
    fleet: Fleet, stack: AsyncExitStack, client: aiohttp.ClientSession
) -> None:
    """A client that hangs up mid-stream leaves nothing held: once the engine sends again
    the gateway lets go of it, and the workload's slot serves the next request."""
    gateway, url = await start_gateway(fleet)
    engine = await FakeLlama.started(stack)
    await publish_workloads(fleet, gateway, workload("a", engine.port))
    response = await client.post(f"{url}/v1/chat/completions", json=chat(stream=True))
    await asyncio.wait_for(response.content.readuntil(b"\n\n"), 5)
    response.close()
    engine.release.set()
    await wait_for(lambda: gateway.in_flight == 0)
    assert (await post(client, url, chat()))[0] == 200


async def test_draining_node_routes_nothing_new_cordoned_still_serves(
    fleet: Fleet, stack: AsyncExitStack, client: aiohttp.ClientSession
) -> None:
    """While the node is draining every new request is answered 503 node_draining; a
    cordoned node keeps serving (a cordon stops placing workloads, not answering)."""
    gateway, url = await start_gateway(fleet)
    engine = await FakeLlama.started(stack)
    engine.release.set()
    await publish_workloads(fleet, gateway, workload("a", engine.port))
    await fleet.publish_event(EVENT_STATE, NodeState(ts=time.time(), schedulability="cordoned"))
    await wait_for(lambda: gateway.schedulability == "cordoned")
    status, _, headers = await post(client, url, chat())
    # One request per connection, said before the answer, so a keep-alive client never
    # sends its next request on a connection the gateway closes.
    assert status == 200 and headers["Connection"] == "close"
    assert (await post(client, url, chat()))[0] == 200
    await fleet.publish_event(EVENT_STATE, NodeState(ts=time.time(), schedulability="draining"))
    await wait_for(lambda: gateway.schedulability == "draining")
    status, body, headers = await post(client, url, chat())
    assert status == 503 and is_openai_error(body, "node_draining")
    assert "Retry-After" in headers and engine.received == 2


async def test_auto_gateway_listens_once_a_workload_exists(fleet: Fleet) -> None:
    """``gateway = auto`` does not listen on a node without workloads, does once the node
    runs one (writing its port file), and stops when none is left."""
    config = fleet.config(gateway="auto", gateway_port=0)
    gateway = GatewayActor(config, fleet.bus, node_events(config))
    await fleet.start_supervisor(gateway)
    port_file = Path(config.state_dir) / PORT_FILE
    assert gateway.port is None and not port_file.exists()
    await fleet.publish_event(
        EVENT_WORKLOADS, Workloads(ts=time.time(), workloads=[workload("a", 1, state="starting")])
    )
    port = await wait_for(lambda: gateway.port)
    assert port_file.read_text().strip() == str(port)
    await fleet.publish_event(
        EVENT_WORKLOADS, Workloads(ts=time.time(), workloads=[workload("a", 1, state="stopped")])
    )
    await wait_for(lambda: gateway.port is None and not port_file.exists())


async def test_drain_waits_for_a_gateway_stream(
    fleet: Fleet,
    bus: NatsBus,
    prefix: str,
    stack: AsyncExitStack,
    client: aiohttp.ClientSession,
) -> None:
    """A drain of an agent whose gateway holds a stream completes only after the stream
    ends, uncut; meanwhile the gateway routes no new request."""
    operator = signing.KeyPair.generate()
    results = await Results().start(bus, prefix)
    config = fleet.config(trust_operators=[operator.public_key], gateway="on", gateway_port=0)
    agent = await fleet.start_agent(config)
    assert agent.supervisor is not None and await agent.supervisor.wait_ready(10)
    port_file = Path(config.state_dir) / PORT_FILE
    port = await wait_for(lambda: port_file.exists() and port_file.read_text().strip())
    url = f"http://127.0.0.1:{port}"
    engine = await FakeLlama.started(stack)
    await fleet.publish_event(
        EVENT_WORKLOADS, Workloads(ts=time.time(), workloads=[workload("a", engine.port)])
    )

    async def models() -> bool:
        async with client.get(f"{url}/v1/models") as response:
            return bool((await response.json())["data"])

    await wait_for(models)
    seen: list[Gateway] = []

    async def on_gateway(msg: Msg) -> None:
        seen.append(codec.decode(msg.data, Gateway, msg.subject))

    await bus.subscribe(Subjects(prefix).event("n1", EVENT_GATEWAY), on_gateway)
    await bus.flush()
    async with client.post(f"{url}/v1/chat/completions", json=chat(stream=True)) as stream:
        first = await asyncio.wait_for(stream.content.readuntil(b"\n\n"), 5)
        # The node's actors have been told of the stream (as the test is) before the drain.
        await wait_for(lambda: seen and seen[-1].in_flight == 1)
        drain = await send(bus, prefix, operator, Drain(deadline=30))
        await wait_for(lambda: any(r.in_flight == 1 for r in results.of(drain.id)))
        status, body, _ = await post(client, url, chat())
        assert status == 503 and is_openai_error(body, "node_draining")
        assert "done" not in results.statuses(drain.id)
        engine.release.set()
        rest = await stream.content.read()
    assert b'"one"' in first and rest.endswith(b"data: [DONE]\n\n")
    final = await results.final(drain.id)
    assert final.status == "done" and final.schedulability == "drained"
    assert final.detail.startswith("drained")


async def test_workloads_not_signed_by_the_node_are_ignored(
    fleet: Fleet, nats_server: NatsServer, prefix: str, stack: AsyncExitStack
) -> None:
    """A workloads event published unsigned, or signed by a key other than the node's, by
    a plain nats-py client is dropped and counted: it cannot point the gateway anywhere."""
    gateway, _ = await start_gateway(fleet)
    engine = await FakeLlama.started(stack)
    raw = await nats.connect(nats_server.url)
    stack.push_async_callback(raw.close)
    subject = Subjects(prefix).event("n1", EVENT_WORKLOADS)
    body = codec.encode(Workloads(ts=time.time(), workloads=[workload("evil", engine.port)]))
    await raw.publish(subject, body)
    stranger = signing.KeyPair.generate()
    await raw.publish(subject, body, headers=stranger.headers(body))
    await raw.flush()
    metrics = gateway.events.metrics

    def dropped(reason: str) -> float | None:
        labels = {"actor": "gateway", "reason": reason}
        return metrics.value("node_agent_events_dropped_total", labels)

    await wait_for(lambda: dropped("unsigned") and dropped("untrusted_key"))
    assert gateway.lanes == {}


async def test_unreachable_workload_is_502_and_addressable_by_name(
    fleet: Fleet, stack: AsyncExitStack, client: aiohttp.ClientSession
) -> None:
    """A request may name the workload instead of its model; a workload that refuses the
    connection is answered 502 in OpenAI's error format, and nothing stays held."""
    gateway, url = await start_gateway(fleet)
    engine = await FakeLlama.started(stack)
    await stack.aclose()  # the engine is gone: its port refuses connections
    await publish_workloads(fleet, gateway, workload("a", engine.port))
    status, body, _ = await post(client, url, chat(model="a"))
    assert status == 502 and is_openai_error(body, "upstream_unreachable")
    assert gateway.in_flight == gateway.waiting == 0
    metrics = gateway.events.metrics
    assert metrics.value("node_agent_gateway_requests_total", {"model": MODEL, "code": "502"})


async def test_invalid_utf8_body_is_400_not_500(
    fleet: Fleet, stack: AsyncExitStack, client: aiohttp.ClientSession
) -> None:
    """A body with bytes that are not UTF-8, in the model or in a field routing skips,
    is answered 400 invalid_json in OpenAI's error format and never reaches the engine."""
    gateway, url = await start_gateway(fleet)
    engine = await FakeLlama.started(stack)
    await publish_workloads(fleet, gateway, workload("a", engine.port))
    bodies = [b'{"model": "tiny\xff.gguf"}', b'{"model": "tiny.gguf", "x": "\xc3"}']
    for raw in bodies:
        headers = {"Content-Type": "application/json"}
        async with client.post(f"{url}/v1/chat/completions", data=raw, headers=headers) as got:
            assert got.status == 400
            assert is_openai_error(await got.json(), "invalid_json")
    assert engine.received == 0
    metrics = gateway.events.metrics
    assert metrics.value("node_agent_gateway_requests_total", {"model": "unknown", "code": "400"})
    assert not metrics.value(
        "node_agent_gateway_requests_total", {"model": "unknown", "code": "500"}
    )


async def test_headers_sent_slowly_are_cut_off_at_the_header_timeout(fleet: Fleet) -> None:
    """A client that sends part of its headers and then nothing is disconnected after
    gateway_header_timeout, long before gateway_request_timeout."""
    _, url = await start_gateway(fleet, gateway_header_timeout=0.5, gateway_request_timeout=600)
    port = int(url.rsplit(":", 1)[1])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
    await writer.drain()
    async with asyncio.timeout(10):
        assert await reader.read() == b""
    writer.close()


async def test_web_pages_cannot_use_the_loopback_gateway(
    fleet: Fleet, stack: AsyncExitStack, client: aiohttp.ClientSession
) -> None:
    """A DNS-rebinding page (a foreign Host) is 421 and another site's page (its Origin,
    or Sec-Fetch-Site: cross-site) is 403, none reaching the engine; a program, and a
    page served by the gateway's own origin, are answered."""
    gateway, url = await start_gateway(fleet, gateway_max_in_flight=4)
    engine = await FakeLlama.started(stack)
    engine.release.set()
    await publish_workloads(fleet, gateway, workload("a", engine.port))
    own = url.removeprefix("http://")
    refused = [
        ({"Host": f"rebind.attacker.example:{gateway.port}"}, 421, "misdirected_request"),
        ({"Origin": "http://evil.example"}, 403, "cross_site_request"),
        ({"Origin": "null"}, 403, "cross_site_request"),
        ({"Sec-Fetch-Site": "cross-site"}, 403, "cross_site_request"),
        (
            {
                "Host": f"rebind.attacker.example:{gateway.port}",
                "Origin": f"http://rebind.attacker.example:{gateway.port}",
                "Sec-Fetch-Site": "same-origin",
            },
            421,
            "misdirected_request",
        ),
    ]
    for headers, status, code in refused:
        async with client.post(f"{url}/v1/chat/completions", json=chat(), headers=headers) as got:
            assert (got.status, is_openai_error(await got.json(), code)) == (status, True), headers
    assert engine.received == 0
    for headers in ({}, {"Origin": f"http://{own}", "Sec-Fetch-Site": "same-origin"}):
        async with client.post(f"{url}/v1/chat/completions", json=chat(), headers=headers) as got:
            assert got.status == 200, headers
    assert engine.received == 2
