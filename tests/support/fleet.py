"""Test helpers: an aggregator and node agents running in the test's event loop, and the
``Fleet`` that starts them for a test and stops them all when it ends."""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import Callable, Iterable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import nats.errors
from nats.aio.client import Client

from actors.fleet.aggregator.actor import AggregatorActor
from actors.fleet.config import MIB, AggregatorConfig
from actors.fleet.live import reader as live
from actors.fleet.live.feed import NodeFeed, followed
from actors.fleet.live.held import Held
from actors.fleet.metrics import AggregatorMetrics
from actors.fleet.operator.forget import ForgetActor
from actors.fleet.storage.records import read_record
from actors.fleet.storage.registry import NotFound, approve
from actors.fleet.storage.streams import StreamLimits
from actors.fleet.views.api import FleetApiActor
from actors.node import labels
from actors.node.agent import NodeAgent
from actors.node.config import AgentConfig
from actors.node.events import NodeEvents
from actors.node.metrics import AgentMetrics
from actors.runtime.bus import NatsBus
from actors.runtime.config import Layers
from actors.runtime.supervisor import Actor, StatusSource, Supervisor
from schemas import codec, signing
from schemas.events import CloudFacts, Event
from schemas.messages import Heartbeat, NodeRecord
from schemas.settings import SettingsStatus
from schemas.subjects import Subjects
from tests.support.fake_http import Handler, serve
from tests.support.metadata_fakes import FakeServer

Fake = TypeVar("Fake", bound=FakeServer)


TEST_BUDGETS = AggregatorConfig(
    heartbeats_max_bytes=8 * MIB,
    records_max_bytes=8 * MIB,
    commands_max_bytes=4 * MIB,
    results_max_bytes=4 * MIB,
    alerts_max_bytes=4 * MIB,
    trust_max_bytes=1 * MIB,
    enroll_max_bytes=1 * MIB,
    fetch_linger=0.02,
    lease_ttl=1.5,
)
"""Stream budgets for tests: the server reserves every stream's max_bytes, and a module's
tests each provision their own prefix on one server, so the production defaults (424 MiB
a prefix) would need tens of GB of disk for a module. checkpoint_interval is the default
(60 s), as users run it: a test reads nodes live (:func:`wait_record`) or waits for a
change the aggregators write at once, never for a checkpoint (a test about checkpoints
sets its own)."""
TEST_LIMITS = StreamLimits.of(TEST_BUDGETS)


def heartbeat(node: str = "n1", seq: int = 1, **changes: object) -> Heartbeat:
    """A heartbeat of node ``node`` in cluster c1, stamped now, with ``changes``."""
    beat = Heartbeat(
        node_id=node,
        cluster="c1",
        seq=seq,
        boot_id="b1",
        ts=time.time(),
        agent_version="test",
        interval=0.5,
        stale_after=2.0,
    )
    return msgspec.structs.replace(beat, **changes)


def agent_shaped(beat: Heartbeat, zone: str = "us-east-1a") -> Heartbeat:
    """``beat`` (a simulator's) with what a real agent on a cloud GPU node adds, decoded
    anew as every heartbeat received is (objects of its own): its labels (its GPUs' and
    its cloud's, as ``actors/node/labels.py`` finds them), the engines it can run, what
    it made of the fleet's settings, when it started and when it beat before."""
    cloud = labels.cloud_labels(
        CloudFacts(
            ts=beat.ts,
            provider="aws",
            region="us-east-1",
            zone=zone,
            instance_type="p5.48xlarge",
            lifecycle="on-demand",
        )
    )
    shaped = msgspec.structs.replace(
        beat,
        labels=labels.found_labels(beat.sample, cloud),
        capabilities=["vllm", "container:vllm"],
        settings=SettingsStatus(revision=3, applied={"heartbeat_interval": "fleet-1"}),
        started=beat.ts - 3600.0,
        previous_ts=beat.ts - 10.0,
    )
    return codec.decode(codec.encode(shaped), Heartbeat)


def new_aggregator(
    bus: NatsBus, prefix: str, metrics: AggregatorMetrics | None = None, **settings: Any
) -> AggregatorActor:
    """Every test and benchmark builds its aggregator here, so a change to the constructor
    is one edit; its stream budgets are the tests' small ones unless a test says."""
    config = msgspec.structs.replace(TEST_BUDGETS, prefix=prefix, **settings)
    return AggregatorActor(config, bus, metrics)


def new_fleet_api(
    bus: NatsBus,
    prefix: str,
    metrics: AggregatorMetrics,
    actor_status: StatusSource = dict,
    live: Held | None = None,
) -> FleetApiActor:
    """The fleet HTTP API on a free loopback port, built in one place like the aggregator;
    its /healthz asks ``actor_status``; ``live``: the nodes the aggregator beside it holds
    (its ``view``)."""
    config = AggregatorConfig(prefix=prefix, http_port=0)
    return FleetApiActor(config, bus, metrics, actor_status, live)


async def supervised(actors: list[Actor], ready_timeout: float = 10.0) -> Supervisor:
    """``actors`` under a supervisor once every one is ready; stopped again if not, so a
    failed start leaves nothing running."""
    supervisor = Supervisor(actors)
    supervisor.start()
    if not await supervisor.wait_ready(ready_timeout):
        await supervisor.stop()
        names = ", ".join(actor.name for actor in actors)
        raise AssertionError(f"{names} not ready within {ready_timeout:g}s")
    return supervisor


async def start_aggregator(
    bus: NatsBus, prefix: str, ready_timeout: float = 10.0, **settings: Any
) -> Supervisor:
    """An aggregator under a supervisor, which restarts it until provisioning succeeds,
    with the forget service that runs beside it."""
    aggregator = new_aggregator(bus, prefix, **settings)
    return await supervised([aggregator, ForgetActor(aggregator.config, bus)], ready_timeout)


def agent_config(
    server: str, prefix: str, state_dir: Path, node: str = "n1", **settings: Any
) -> AgentConfig:
    values: dict[str, Any] = dict(
        server=server,
        prefix=prefix,
        node_id=node,
        cluster="c1",
        state_dir=str(state_dir / node),
        heartbeat_interval=0.5,
        stale_after=2.0,
        sample_interval=0.5,
        health_interval=0.5,
        fake_gpus=2,
        http_port=0,
        gateway_port=0,
        # SIGTERM drains in-flight work (pretend engines' included) for this long at most.
        shutdown_timeout=2.0,
        # No --version runs per test agent (a test that wants them says so).
        version_programs=[],
        # No Slurm unless a test asks: CI machines have Slurm's tools installed.
        scheduler="none",
    )
    values.update(settings)
    return AgentConfig(**values)


DIRECT_CHANNELS: weakref.WeakValueDictionary[Path, NodeEvents] = weakref.WeakValueDictionary()
"""The event channel :func:`node_events` last made for each node key file (while actors
use it), which :meth:`Fleet.publish_event` speaks through to actors a test runs directly."""


def node_events(config: AgentConfig) -> NodeEvents:
    """The node's event channel as its agent builds it, for actors a test runs directly;
    the node key is the agent's own (created if missing), so the two agree."""
    key = signing.load_or_create_key_file(config.key_path)
    events = DIRECT_CHANNELS[config.key_path] = NodeEvents(config, key, AgentMetrics())
    return events


async def approved_agent(
    bus: NatsBus, config: AgentConfig, layers: Layers[AgentConfig] | None = None
) -> NodeAgent:
    """Create the node's key, approve it, and start the agent (with ``layers``: where its
    config came from, flags and environment included, as ``node-agent start`` has them)."""
    key = signing.load_or_create_key_file(config.key_path)
    await approve(bus, Subjects(config.prefix), config.node_id, key.public_key)
    agent = NodeAgent(config, layers)
    await agent.start()
    return agent


@dataclass
class Fleet:
    """One test's server address, bus, prefix and state directory, and factories for what
    it runs there. Whatever a factory starts goes on ``stack``, which the fixture closes
    when the test ends, pass or fail: last started, first stopped, so agents stop before
    the aggregator and both before the bus closes."""

    url: str
    bus: NatsBus
    prefix: str
    state_dir: Path
    stack: AsyncExitStack
    channels: dict[str, tuple[NodeEvents, NatsBus]] = field(default_factory=dict)
    agents: dict[str, NodeAgent] = field(default_factory=dict)
    """The agents :meth:`start_agent` started, by node id."""
    """Each node's event channel and the connection its actors publish on, for the agents
    started here: what :meth:`publish_event` speaks through."""

    def config(self, node: str = "n1", **settings: Any) -> AgentConfig:
        return agent_config(self.url, self.prefix, self.state_dir, node, **settings)

    async def start_agent(self, config: AgentConfig | None = None) -> NodeAgent:
        """An approved agent (node n1 unless ``config`` says otherwise). Stopping an agent
        twice is harmless, so a test may stop it itself (to restart it, say)."""
        agent = await approved_agent(self.bus, config or self.config())
        self.stack.push_async_callback(agent.stop)
        assert agent.bus is not None
        self.channels[agent.config.node_id] = (agent.events, agent.bus)
        self.agents[agent.config.node_id] = agent
        return agent

    def node_key(self, node: str = "n1") -> signing.KeyPair:
        """The key node ``node``'s agent signs with (created if it does not exist yet)."""
        return signing.load_or_create_key_file(self.config(node).key_path)

    async def publish_event(self, kind: str, event: Event, node: str = "n1") -> None:
        """Publish ``event`` as node ``node``'s own actor would: signed with its key and
        tagged by its process (the agent this fleet started for ``node``, on its connection;
        else the channel :func:`node_events` made for actors run directly on this bus), so
        its actors act on it."""
        events, bus = self.channels.get(node) or (
            DIRECT_CHANNELS[self.config(node).key_path],
            self.bus,
        )
        await events.publish(bus, Subjects(self.prefix).event(node, kind), event)
        await bus.flush()

    async def start_aggregator(
        self, bus: NatsBus | None = None, ready_timeout: float = 10.0, **settings: Any
    ) -> Supervisor:
        """An aggregator on this test's bus (or ``bus``), ready."""
        supervisor = await start_aggregator(bus or self.bus, self.prefix, ready_timeout, **settings)
        self.stack.push_async_callback(supervisor.stop)
        return supervisor

    async def start_supervisor(self, *actors: Actor, ready_timeout: float = 10.0) -> Supervisor:
        """Actors a test runs directly, under a supervisor, once all are ready."""
        supervisor = await supervised(list(actors), ready_timeout)
        self.stack.push_async_callback(supervisor.stop)
        return supervisor

    async def connect(self, name: str) -> NatsBus:
        """Another connection to the test's server (a second aggregator's, say)."""
        bus = await NatsBus.connect(self.url, name)
        self.stack.push_async_callback(bus.close)
        return bus

    async def serve(self, routes: dict[str, Handler]) -> str:
        """A local HTTP server answering ``routes``; its base URL."""
        url: str = await self.stack.enter_async_context(serve(routes))
        return url

    async def follow(self, *feeds: NodeFeed) -> None:
        """Follow each of ``feeds`` until the test ends, once each is complete: for a test
        that calls a decision's ``round()`` itself (its actor not run, its own feed not
        followed)."""
        for feed in feeds:
            await self._follow(feed)

    async def _follow(self, feed: NodeFeed) -> None:
        following = await self.stack.enter_async_context(followed(feed, own=True))
        await wait_for(lambda: feed.complete or following.done(), timeout=HANG)
        if following.done():
            following.result()

    async def start_fake(self, fake: Fake) -> Fake:
        """A cloud metadata fake, started."""
        await fake.start()
        self.stack.push_async_callback(fake.stop)
        return fake


HANG = 60.0
"""How long a test waits for a condition before it calls it a hang: only a bound, never
how long anything should take (a test about a time measures it). Generous, so that a
machine other work keeps busy slows a test down without failing it."""


async def wait_for(check: Callable[[], Any], timeout: float = HANG, interval: float = 0.05) -> Any:
    """Poll ``check`` (sync or async) until it returns something truthy; AssertionError
    after ``timeout`` (a hang)."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        await asyncio.sleep(interval)


def poll(check: Callable[[], Any], timeout: float = HANG, interval: float = 0.05) -> Any:
    """:func:`wait_for` for code outside an event loop (a thread, a program's helper):
    call ``check`` until it returns something truthy; AssertionError after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(interval)


async def subscriptions_at_server(client: Client, bus: NatsBus, probe: str) -> None:
    """Return once every SUB a plain ``client`` sent so far is at the server. nats-py's
    ``flush()`` can return before they are (see :meth:`NatsBus.flush`); a ``probe``
    subject subscribed after them and reached by a publish from ``bus`` proves they are,
    since the server takes one connection's SUBs in order."""
    subscription = await client.subscribe(probe)

    async def reached() -> bool:
        await bus.publish(probe, b"")
        try:
            await subscription.next_msg(timeout=0.2)
        except nats.errors.TimeoutError:
            return False
        return True

    await wait_for(reached)
    await subscription.unsubscribe()


class Flickering(NodeFeed):
    """A live feed that loses its nodes when told (``lost``), as one does for a moment
    when the aggregator beside it lets partitions go and its watch catches up."""

    lost = False

    @property
    def complete(self) -> bool:
        return not self.lost and super().complete

    def record(self, node: str) -> NodeRecord | None:
        return None if self.lost else super().record(node)

    def whole(self, nodes: Iterable[str] | None = None) -> dict[str, NodeRecord]:
        return {} if self.lost else super().whole(nodes)


async def fed(feed: NodeFeed, records: list[NodeRecord], timeout: float = 10.0) -> None:
    """Return once ``feed`` holds each of ``records`` as written to fleet_nodes."""
    await wait_for(lambda: all(feed.record(r.node_id) == r for r in records), timeout)


async def wait_record(
    bus: NatsBus,
    prefix: str,
    node: str,
    predicate: Callable[[NodeRecord], bool],
    timeout: float = HANG,
    stored: bool = False,
) -> NodeRecord:
    """The record of ``node`` once ``predicate`` holds for it, read as the views read it
    (its latest accepted heartbeat over the record: the aggregators checkpoint at the
    default interval, 60 s, so a stored record's readings may be a minute old); with
    ``stored``, as fleet_nodes holds it (for tests about what is written)."""
    subjects = Subjects(prefix)
    seen: list[NodeRecord] = []

    async def check() -> NodeRecord | None:
        try:
            if stored:
                current = await read_record(bus, subjects, node)
            else:
                current = await live.read_node(bus, subjects, node)
        except NotFound:
            return None
        seen[:] = [current]
        return current if predicate(current) else None

    try:
        found: NodeRecord = await wait_for(check, timeout, interval=0.1)
    except AssertionError as exc:
        last = seen[0] if seen else None
        what = (
            f"state {last.state}, last_seq {last.last_seq}, stale_since {last.stale_since}"
            if last
            else "no record"
        )
        raise AssertionError(f"{exc}: {node}'s record last read: {what}") from None
    return found
