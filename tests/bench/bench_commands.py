"""Benchmarks of the command path (a script, not collected by pytest):

(a) a spot termination notice appearing at a local fake AWS metadata endpoint -> the node's
    ``draining`` state visible in ``fleet_nodes``, at the default 1 s poll (target p99 <= 1.5 s);
(b) a signed drain command published (as ``fleetctl drain`` does) -> the node's first
    CommandResult on loopback (target p99 <= 100 ms).

Run: ``python tests/bench/bench_commands.py [--trials N]``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from nats.aio.msg import Msg

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from actors.fleet.operator.commands import new_command, publish_command
from actors.fleet.storage.streams import provision
from actors.node.agent import NodeAgent
from actors.runtime.bus import NatsBus
from actors.runtime.embedded import NatsServer
from schemas import codec, signing
from schemas.events import Engine
from schemas.messages import CommandResult, Drain
from schemas.subjects import EVENT_ENGINE, Subjects
from tests.support.fleet import agent_config, approved_agent, start_aggregator, wait_record
from tests.support.metadata_fakes import FakeAws

PREFIX = "bench"


async def set_in_flight(agent: NodeAgent, count: int) -> None:
    """Pretend to be the agent's engine actor reporting ``count`` in-flight requests: through
    its process's event channel, on its connection, as its actors take events."""
    assert agent.bus is not None
    subject = Subjects(PREFIX).event(agent.config.node_id, EVENT_ENGINE)
    await agent.events.publish(agent.bus, subject, Engine(ts=time.time(), in_flight=count))
    await agent.bus.flush()


def percentiles(samples: list[float]) -> str:
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return (
        f"n={len(ordered)} p50={statistics.median(ordered) * 1000:.1f} ms "
        f"p99={p99 * 1000:.1f} ms max={ordered[-1] * 1000:.1f} ms"
    )


async def notice_to_draining(server: NatsServer, bus: NatsBus, store: Path, trials: int) -> None:
    samples = []
    for trial in range(trials):
        node = f"spot{trial}"
        fake = await FakeAws().start()
        config = agent_config(
            server.url,
            PREFIX,
            store,
            node=node,
            heartbeat_interval=5.0,
            stale_after=15.0,
            spot_provider="aws",
            metadata_url=fake.url,
        )
        agent = await approved_agent(bus, config)
        try:
            await wait_record(bus, PREFIX, node, lambda r: r.state == "active")
            # Work in flight keeps the node draining while we look; the notice lands at a
            # random point of the 1 s poll period.
            await set_in_flight(agent, 1)
            await asyncio.sleep(random.uniform(0, 1))
            start = time.perf_counter()
            fake.action = {
                "action": "terminate",
                "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 120)),
            }
            await wait_record(bus, PREFIX, node, lambda r: r.state == "draining", 10)
            samples.append(time.perf_counter() - start)
            await set_in_flight(agent, 0)
            assert agent.supervisor is not None
            await asyncio.wait_for(agent.supervisor.finished.wait(), 10)
        finally:
            await agent.stop()
            await fake.stop()
    print(f"(a) notice -> draining in fleet_nodes (1 s poll): {percentiles(samples)}")


async def drain_to_first_result(server: NatsServer, bus: NatsBus, store: Path, trials: int) -> None:
    operator = signing.KeyPair.generate()
    config = agent_config(
        server.url, PREFIX, store, node="cmd0", trust_operators=[operator.public_key]
    )
    agent = await approved_agent(bus, config)
    subjects = Subjects(PREFIX)
    first: dict[str, float] = {}
    done: dict[str, asyncio.Event] = {}

    async def on_result(msg: Msg) -> None:
        result = codec.decode(msg.data, CommandResult, msg.subject)
        first.setdefault(result.command_id, time.perf_counter())
        if result.status == "done" and result.command_id in done:
            done[result.command_id].set()

    await bus.subscribe(subjects.result("c1", "cmd0"), on_result)
    await bus.flush()
    assert agent.supervisor is not None and await agent.supervisor.wait_ready(10)
    samples = []
    try:
        for _ in range(trials):
            command = new_command("cmd0", "c1", Drain(deadline=5))
            done[command.id] = asyncio.Event()
            start = time.perf_counter()
            await publish_command(bus, subjects, operator, command)
            await asyncio.wait_for(done[command.id].wait(), 10)
            samples.append(first[command.id] - start)
    finally:
        await agent.stop()
    print(f"(b) drain publish -> first CommandResult (loopback): {percentiles(samples)}")


async def main(trials: int) -> None:
    logging.basicConfig(level=logging.ERROR)
    with tempfile.TemporaryDirectory() as scratch:
        server = NatsServer(Path(scratch) / "nats")
        server.start()
        try:
            bus = await NatsBus.connect(server.url, "bench")
            await provision(bus.js, Subjects(PREFIX))
            aggregator = await start_aggregator(bus, PREFIX)
            store = Path(scratch) / "nodes"
            await notice_to_draining(server, bus, store, trials)
            await drain_to_first_result(server, bus, store, max(100, trials))
            await aggregator.stop()
            await bus.close()
        finally:
            server.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    asyncio.run(main(parser.parse_args().trials))
