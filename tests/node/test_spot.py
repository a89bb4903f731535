"""The spot watcher against local fakes of each cloud's metadata service (see
tests/support/metadata_fakes.py for the documentation each one follows), end to end with a real
nats-server, aggregator and agent."""

from __future__ import annotations

import time
from typing import Any

import aiohttp
from nats.aio.msg import Msg

from actors.node.cloud import Metadata
from actors.node.spot import SpotActor
from actors.runtime.bus import NatsBus
from schemas import codec
from schemas.events import Interruption, NodeState
from schemas.subjects import EVENT_INTERRUPTION, EVENT_STATE, Subjects
from tests.support.commanding import Results
from tests.support.fleet import Fleet, node_events, wait_for, wait_record
from tests.support.metadata_fakes import FakeAws, FakeAzure, FakeGcp


class Published:
    """The interruption notices and states one node published."""

    def __init__(self) -> None:
        self.notices: list[Interruption] = []
        self.states: list[NodeState] = []

    async def start(self, bus: NatsBus, prefix: str, node: str = "n1") -> Published:
        subjects = Subjects(prefix)
        await bus.subscribe(subjects.event(node, EVENT_INTERRUPTION), self._on_notice)
        await bus.subscribe(subjects.event(node, EVENT_STATE), self._on_state)
        await bus.flush()
        return self

    async def _on_notice(self, msg: Msg) -> None:
        self.notices.append(codec.decode(msg.data, Interruption, msg.subject))

    async def _on_state(self, msg: Msg) -> None:
        self.states.append(codec.decode(msg.data, NodeState, msg.subject))

    def schedulabilities(self) -> list[str]:
        seen: list[str] = []
        for state in self.states:
            if not seen or seen[-1] != state.schedulability:
                seen.append(state.schedulability)
        return seen


async def deregistered_before_deadline(
    fleet: Fleet,
    provider: str,
    metadata_url: str,
    trigger: Any,
    deadline: float,
    margin: float,
) -> Results:
    """Start an agent watching ``provider``, ``trigger()`` a notice, and check the node goes
    draining -> drained -> deregistered (record and alerts) before ``deadline``."""
    bus, prefix = fleet.bus, fleet.prefix
    await fleet.start_aggregator()
    results = await Results().start(bus, prefix)
    published = await Published().start(bus, prefix)
    config = fleet.config(
        spot_provider=provider,
        metadata_url=metadata_url,
        spot_poll_interval=0.2,
        spot_safety_margin=margin,
    )
    agent = await fleet.start_agent(config)
    active = await wait_record(bus, prefix, "n1", lambda r: r.state == "active")
    assert active.heartbeat and active.heartbeat.spot
    assert active.heartbeat.spot.provider == provider, "the watched cloud shows at once"
    await trigger()
    await wait_record(bus, prefix, "n1", lambda r: r.state == "deregistered")
    assert time.time() < deadline
    assert agent.supervisor is not None and agent.supervisor.finished.is_set()
    assert published.schedulabilities()[-2:] == ["draining", "drained"]
    assert published.states[-1].deregistering
    await wait_for(
        lambda: {"interruption", "deregistered"} <= {alert.kind for alert in results.alerts}
    )
    spot_results = [r for r in results.results if r.command_id.startswith("spot:")]
    assert spot_results[0].status == "accepted"
    assert spot_results[-1].status == "done"
    await agent.stop()  # so the caller sees all the agent did
    return results


def iso(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


async def test_aws_termination_notice_deregisters_before_deadline(fleet: Fleet) -> None:
    """An AWS spot instance-action drains, then deregisters the node before its time."""
    fake = await fleet.start_fake(FakeAws())
    deadline = time.time() + 20

    async def trigger() -> None:
        fake.action = {"action": "terminate", "time": iso(deadline)}

    await deregistered_before_deadline(fleet, "aws", fake.url, trigger, deadline, 15)


async def test_gcp_preemption_deregisters_before_deadline(fleet: Fleet) -> None:
    """GCP 'preempted' turning TRUE (seen through a hanging get) deregisters the node
    within GCP's 30 s notice."""
    fake = await fleet.start_fake(FakeGcp())
    deadline = time.time() + 30

    async def trigger() -> None:
        await fake.set("preempted", "TRUE")

    await deregistered_before_deadline(fleet, "gcp", fake.url, trigger, deadline, 25)


async def test_azure_preempt_deregisters_and_acknowledges(fleet: Fleet) -> None:
    """An Azure Preempt scheduled event deregisters the node before NotBefore, and the
    event is acknowledged (StartRequests) once the node is drained."""
    fake = await fleet.start_fake(FakeAzure())
    deadline = time.time() + 20

    async def trigger() -> None:
        # Another VM's event in the same availability set must be left alone.
        fake.schedule("Terminate", "c3d9f1a0-0000-4000-8000-000000000001", deadline, vm="vm2")
        fake.schedule("Preempt", "602d9444-d2cd-49c7-8624-8643e7171297", deadline)

    await deregistered_before_deadline(fleet, "azure", fake.url, trigger, deadline, 15)
    assert fake.started == ["602d9444-d2cd-49c7-8624-8643e7171297"]


async def test_aws_errors_never_crash_the_watcher(fleet: Fleet, bus: NatsBus, prefix: str) -> None:
    """503 storms, timeouts and expired tokens (401 -> new IMDSv2 token) are retried; the
    watcher keeps running and still reports each notice exactly once."""
    fake = await fleet.start_fake(FakeAws())
    published = await Published().start(bus, prefix)
    config = fleet.config(spot_provider="aws", metadata_url=fake.url)
    config = config.__class__(**{**_fields(config), "spot_poll_interval": 0.05})
    supervisor = await fleet.start_supervisor(SpotActor(config, bus, node_events(config)))
    fake.failures = [503, 503, 503, 0.7, 500]
    await wait_for(lambda: not fake.failures)
    fake.expire_tokens()
    issued = fake.issued
    fake.rebalance = {"noticeTime": iso(time.time())}
    fake.action = {"action": "stop", "time": iso(time.time() + 120)}
    await wait_for(lambda: len(published.notices) >= 2)
    assert fake.issued > issued
    assert sorted(n.kind for n in published.notices) == ["rebalance", "stop"]
    assert supervisor.status["spot"].restarts == 0


def _fields(struct: Any) -> dict[str, Any]:
    return {name: getattr(struct, name) for name in struct.__struct_fields__}


async def test_auto_detects_the_provider_that_answers(fleet: Fleet) -> None:
    """'auto' picks the provider whose metadata endpoint answers (here GCP's), and none
    when nothing answers."""
    fake = await fleet.start_fake(FakeGcp())
    config = fleet.config(spot_provider="auto", metadata_url=fake.url)
    timeout = aiohttp.ClientTimeout(total=2)
    async with aiohttp.ClientSession() as session:
        assert await Metadata(config, timeout).detect(session) == "gcp"
    await fake.stop()
    nothing = fleet.config(spot_provider="auto", metadata_url=fake.url)
    async with aiohttp.ClientSession() as session:
        assert await Metadata(nothing, timeout).detect(session) is None
