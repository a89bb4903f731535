"""SIGTERM is a bounded drain by default: a real ``node-agent start`` whose engine (a vLLM
stand-in) reports in-flight work tells the fleet it is draining, keeps running and beating
until the work is done (or ``shutdown_timeout`` passes), exits 0, and does not deregister."""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from pathlib import Path

import pytest
from aiohttp import web
from nats.aio.msg import Msg

from actors.fleet.storage.registry import approve
from schemas import codec, signing
from schemas.messages import Heartbeat
from schemas.subjects import Subjects
from tests.support.fake_http import text
from tests.support.fleet import Fleet, wait_for, wait_record


class Vllm:
    """A vLLM stand-in whose running-request gauge the test sets."""

    def __init__(self) -> None:
        self.running = 3

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            text=(
                "# TYPE vllm:num_requests_running gauge\n"
                f'vllm:num_requests_running{{model_name="m"}} {self.running}.0\n'
                "# TYPE vllm:num_requests_waiting gauge\n"
                'vllm:num_requests_waiting{model_name="m"} 0.0\n'
            )
        )


async def start_agent(fleet: Fleet, engine: str, *flags: str) -> asyncio.subprocess.Process:
    """An approved ``node-agent start`` child with fake GPUs and one vLLM engine."""
    config = fleet.config()
    key = signing.load_or_create_key_file(config.key_path)
    await approve(fleet.bus, Subjects(fleet.prefix), "n1", key.public_key)
    process = await asyncio.create_subprocess_exec(
        str(Path(sys.executable).parent / "node-agent"),
        "start",
        *("--server", fleet.url, "--prefix", fleet.prefix, "--node-id", "n1"),
        *("--cluster", "c1", "--state-dir", config.state_dir, "--fake-gpus", "1"),
        *("--heartbeat-interval", "0.5", "--stale-after", "2", "--http-port", "0"),
        *("--engine", f"vllm={engine}", "--engine-interval", "0.2"),
        *flags,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )

    async def kill() -> None:
        if process.returncode is None:
            process.kill()
            await process.wait()

    fleet.stack.push_async_callback(kill)
    return process


async def heartbeats(fleet: Fleet) -> list[Heartbeat]:
    """Every heartbeat of n1 from now on, as the aggregators get them."""
    beats: list[Heartbeat] = []

    async def collect(msg: Msg) -> None:
        beats.append(codec.decode(msg.data, Heartbeat, msg.subject))

    subscription = await fleet.bus.nc.subscribe(
        Subjects(fleet.prefix).heartbeat("c1", "n1"), cb=collect
    )
    fleet.stack.push_async_callback(subscription.unsubscribe)
    await fleet.bus.flush()
    return beats


@pytest.mark.slow
async def test_sigterm_drains_in_flight_work_then_exits(fleet: Fleet) -> None:
    """With 3 requests in flight, SIGTERM makes the node report draining while the agent
    keeps beating; once the engine reports 0 the agent exits 0, not deregistered."""
    vllm = Vllm()
    url = await fleet.serve({"/health": text(""), "/metrics": vllm.metrics})
    await fleet.start_aggregator()
    beats = await heartbeats(fleet)
    process = await start_agent(fleet, url)
    await wait_for(lambda: any(b.jobs and b.jobs.running == 3 for b in beats))
    process.send_signal(signal.SIGTERM)
    draining = await wait_for(lambda: [b for b in beats if b.schedulability == "draining"])
    # Still running and still beating after it said so: the drain waits for the work.
    seen = draining[0].seq
    await wait_for(lambda: any(b.seq > seen + 1 for b in beats))
    assert process.returncode is None
    assert all(not b.deregistering for b in beats)
    vllm.running = 0
    _, stderr = await asyncio.wait_for(process.communicate(), 15)
    assert process.returncode == 0, stderr.decode()
    record = await wait_record(fleet.bus, fleet.prefix, "n1", lambda r: True)
    assert record.state != "deregistered"


@pytest.mark.slow
async def test_sigterm_drain_is_bounded_by_shutdown_timeout(fleet: Fleet) -> None:
    """Work that never finishes holds SIGTERM for shutdown_timeout, then the agent exits 0."""
    url = await fleet.serve({"/health": text(""), "/metrics": Vllm().metrics})
    await fleet.start_aggregator()
    beats = await heartbeats(fleet)
    process = await start_agent(fleet, url, "--shutdown-timeout", "1.5")
    await wait_for(lambda: any(b.jobs and b.jobs.running == 3 for b in beats))
    started = time.monotonic()
    process.send_signal(signal.SIGTERM)
    _, stderr = await asyncio.wait_for(process.communicate(), 15)
    took = time.monotonic() - started
    assert process.returncode == 0, stderr.decode()
    assert 1.5 <= took < 8, took
    assert any(b.schedulability == "draining" for b in beats)
