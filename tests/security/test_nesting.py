"""Issue 30, item 1: a body nested thousands of levels deep (JSON that made msgspec raise
RecursionError) is refused like any malformed body by every actor that reads the bus, and
restarts none: the aggregators (heartbeats, registrations), the forget service, the
node's command consumer and event readers, and the latency prober. Each attack is sent
with a plain nats-py client, signed where the reader checks a signature first."""

from __future__ import annotations

import asyncio
import operator
import os
import time
from collections.abc import Mapping
from functools import partial

import msgspec
from aiohttp import web
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, StreamConfig

from actors.fleet.aggregator.actor import AggregatorActor
from actors.fleet.alerts.alertmanager import AlertmanagerActor
from actors.fleet.metrics import AggregatorMetrics
from actors.fleet.operator.commands import new_command
from actors.fleet.operator.forget import ForgetActor
from actors.fleet.operator.maintenance import MaintenanceActor
from actors.fleet.storage.registry import approve
from actors.fleet.storage.windows import MaintenanceWindows
from actors.fleet.views.api import FleetApiActor
from actors.fleet.views.dashboard.actor import DashboardActor
from actors.fleet.views.dashboard.held_nodes import HeldNodes
from actors.node.agent import NodeAgent
from actors.node.latency import LatencyActor
from actors.runtime.batch_pull import BatchPuller, Chain, consume_in_batches
from actors.runtime.bus import NatsBus
from actors.runtime.consumer import DurableConsumer
from actors.runtime.supervisor import ActorStatus, Supervisor
from schemas import codec, signing
from schemas.events import EVENT_TYPES, Latency
from schemas.messages import (
    Alert,
    CommandResult,
    Cordon,
    ForgetReply,
    MaintenanceReply,
    Probe,
    ProbeReply,
    RegistrationReply,
)
from schemas.subjects import EVENT_LATENCY, Subjects, partition_of, probe_reply
from tests.security.attack import attacker, count_is, counted, http_status, restarts, seq_is
from tests.support.commanding import Results
from tests.support.fleet import (
    TEST_LIMITS,
    Fleet,
    heartbeat,
    new_aggregator,
    new_fleet_api,
    node_events,
    wait_for,
    wait_record,
)

REFUSED = "fleet_heartbeats_refused"
LEVELS = 5_000
"""Past Python's recursion limit at any stack depth: msgspec raised RecursionError."""


def deep(levels: int = LEVELS) -> bytes:
    """JSON arrays and objects nested ``levels`` deep."""
    half = levels // 2
    return b"[" * half + b'{"a":' * (levels - half) + b"1" + b"}" * (levels - half) + b"]" * half


def with_deep_field(body: bytes) -> bytes:
    """A valid JSON object with one more (unknown) field, nested :data:`LEVELS` deep."""
    return body[:-1] + b',"future_field":' + deep() + b"}"


def node_in(partition: int, stem: str) -> str:
    """A node name of ``stem`` whose heartbeats go to ``partition``."""
    for index in range(10_000):
        if partition_of(f"{stem}{index}", TEST_LIMITS.partitions) == partition:
            return f"{stem}{index}"
    raise AssertionError("no name found")


async def beat(
    js: JetStreamContext, prefix: str, key: signing.KeyPair, node: str, body: bytes
) -> None:
    headers = {**key.headers(body), "Nats-Msg-Id": os.urandom(8).hex(), "Nats-TTL": "30"}
    await js.publish(Subjects(prefix).heartbeat("c1", node), body, headers=headers)


async def test_a_deeply_nested_heartbeat_is_refused_and_the_aggregator_keeps_going(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """n2's key signs a heartbeat with an unknown field 5,000 levels deep, the last of its
    fetch: refused as a body that is not a Heartbeat, n2's record untouched, and the
    aggregator (every partition of it) keeps accepting n1's beats without a restart."""
    keys = {node: signing.KeyPair.generate() for node in ("n1", "n2")}
    for node, key in keys.items():
        await approve(bus, Subjects(prefix), node, key.public_key)
    metrics = AggregatorMetrics()
    supervisor = await fleet.start_supervisor(new_aggregator(bus, prefix, metrics))
    async with attacker(fleet.url) as nc:
        js = nc.jetstream()
        await beat(js, prefix, keys["n2"], "n2", codec.encode(heartbeat("n2", seq=1)))
        await wait_record(bus, prefix, "n2", lambda r: r.last_seq == 1)
        for seq in (2, 3):
            hostile = with_deep_field(codec.encode(heartbeat("n2", seq=seq)))
            await beat(js, prefix, keys["n2"], "n2", hostile)
            await wait_for(
                partial(count_is, metrics.registry, REFUSED, seq - 1, kind="bad_signature")
            )
            await beat(js, prefix, keys["n1"], "n1", codec.encode(heartbeat("n1", seq=seq)))
            await wait_record(bus, prefix, "n1", partial(seq_is, seq))
    assert (await wait_record(bus, prefix, "n2", lambda r: True)).last_seq == 1
    assert restarts(supervisor) == {"aggregator": 0}


async def test_two_aggregators_stay_up_under_a_nested_heartbeat_a_second(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """Issue 30's attack at its measured rate: a node-signed heartbeat 5,000 levels deep
    every second into every partition (so into both aggregators) for six seconds. Both
    answer /healthz 200 throughout, an honest node in every partition has each of its
    beats accepted (within 10 s: a bound for a loaded machine, not the measured time),
    and neither aggregator restarts."""
    honest = [node_in(p, "h") for p in range(TEST_LIMITS.partitions)]
    hostile = [node_in(p, "x") for p in range(TEST_LIMITS.partitions)]
    keys = {node: signing.KeyPair.generate() for node in honest + hostile}
    for node, key in keys.items():
        await approve(bus, Subjects(prefix), node, key.public_key)
    supervisors: list[Supervisor] = []
    healthz: list[str] = []
    for name in ("first", "second"):
        own = bus if name == "first" else await fleet.connect(name)
        found: list[Supervisor] = []

        def statuses(found: list[Supervisor] = found) -> Mapping[str, ActorStatus]:
            return found[0].check() if found else {}

        api = new_fleet_api(own, prefix, AggregatorMetrics(), statuses)
        found.append(await fleet.start_supervisor(new_aggregator(own, prefix), api))
        supervisors.append(found[0])
        healthz.append(f"http://127.0.0.1:{api.port}/healthz")
    held = [supervisor.actors[0] for supervisor in supervisors]
    await wait_for(
        lambda: all(
            isinstance(a, AggregatorActor)
            and a.ownership.partitions
            and a.ownership.partitions.held
            for a in held
        )
    )
    async with attacker(fleet.url) as nc:
        js = nc.jetstream()
        for seq in range(1, 7):
            started = time.monotonic()
            for node in hostile:
                body = with_deep_field(codec.encode(heartbeat(node, seq=seq)))
                await beat(js, prefix, keys[node], node, body)
            for node in honest:
                await beat(js, prefix, keys[node], node, codec.encode(heartbeat(node, seq=seq)))
            for node in honest:
                await wait_record(bus, prefix, node, partial(seq_is, seq))
            assert [await http_status(url) for url in healthz] == [200, 200]
            await asyncio.sleep(max(0.0, 1.0 - (time.monotonic() - started)))
    for supervisor in supervisors:
        assert restarts(supervisor) == {"aggregator": 0, "fleet_api": 0}


async def test_nested_registration_forget_and_maintenance_requests_are_answered_rejected(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """The aggregator's registration service, the forget service and the maintenance
    service answer a 5,000-level body ``rejected`` (signed or not) and restart none."""
    aggregator = new_aggregator(bus, prefix)
    supervisor = await fleet.start_supervisor(
        aggregator,
        ForgetActor(aggregator.config, bus),
        MaintenanceActor(aggregator.config, bus),
    )
    subjects = Subjects(prefix)
    key = signing.KeyPair.generate()
    body = with_deep_field(b'{"node_id":"n1"}')
    async with attacker(fleet.url) as nc:
        for _ in range(2):
            for headers in ({}, key.headers(body)):
                answer = await nc.request(subjects.register(), body, timeout=5, headers=headers)
                registered = codec.decode(answer.data, RegistrationReply)
                assert registered.status == "rejected" and "deeper" in registered.reason
                answer = await nc.request(subjects.forget(), body, timeout=5, headers=headers)
                assert codec.decode(answer.data, ForgetReply).status == "rejected"
                answer = await nc.request(subjects.maintenance(), body, timeout=5, headers=headers)
                assert codec.decode(answer.data, MaintenanceReply).status == "rejected"
    assert restarts(supervisor) == {"aggregator": 0, "forget": 0, "maintenance": 0}


async def test_a_nested_alert_is_dropped_by_the_alertmanager_forwarder(fleet: Fleet) -> None:
    """A 5,000-level body stored in FLEET_ALERTS (by a plain client of an open server) is
    dropped by the Alertmanager forwarder's consumer, counted, and the event alert after
    it is still forwarded; the forwarder never restarts."""
    received: list[object] = []

    async def alerts(request: web.Request) -> web.Response:
        received.extend(await request.json())
        return web.Response(status=200)

    url = await fleet.serve({"/api/v2/alerts": alerts})
    config = msgspec.structs.replace(
        new_aggregator(fleet.bus, fleet.prefix).config,
        alertmanager_urls=[url],
        alertmanager_durable=f"am_{fleet.prefix}",
    )
    metrics = AggregatorMetrics()
    windows = MaintenanceWindows(fleet.bus, Subjects(fleet.prefix))
    supervisor = await fleet.start_supervisor(
        AlertmanagerActor(config, fleet.bus, metrics, list, windows)
    )
    subjects = Subjects(fleet.prefix)
    alert = Alert(
        id="a1",
        kind="sequence_gap",
        node_id="n7",
        cluster="c1",
        severity="warning",
        message="seq 5 after 2",
        ts=time.time(),
    )
    async with attacker(fleet.url) as nc:
        js = nc.jetstream()
        subject = subjects.alert("sequence_gap", "c1", "n7")
        await js.publish(subject, with_deep_field(codec.encode(alert)))
        await js.publish(subject, codec.encode(alert))
    await wait_for(lambda: received)
    assert counted(metrics.registry, "fleet_alertmanager_dropped", reason="handler_error") == 1
    assert restarts(supervisor) == {"alertmanager": 0}


async def test_a_nested_command_is_refused_and_the_next_one_runs(fleet: Fleet) -> None:
    """An operator-signed command with a 5,000-level unknown field, and an unsigned bare
    one, are refused by the node's command consumer; a valid command after them runs and
    the commands actor never restarts."""
    operator = signing.KeyPair.generate()
    results = await Results().start(fleet.bus, fleet.prefix)
    agent = await fleet.start_agent(fleet.config(trust_operators=[operator.public_key]))
    assert agent.supervisor is not None and await agent.supervisor.wait_ready(10)
    subject = Subjects(fleet.prefix).command("c1", "n1")
    async with attacker(fleet.url) as nc:
        js = nc.jetstream()
        hostile = with_deep_field(codec.encode(new_command("n1", "c1", Cordon(ttl=60))))
        await js.publish(subject, hostile, headers=operator.headers(hostile))
        await js.publish(subject, deep(2_000))
        command = new_command("n1", "c1", Cordon(ttl=60))
        body = codec.encode(command)
        await js.publish(subject, body, headers=operator.headers(body))
        await wait_for(lambda: "accepted" in results.statuses(command.id))
    assert restarts(agent.supervisor)["commands"] == 0


EVENT_READERS = [
    "commands",
    "inventory",
    "heartbeat",
    "health",
    "engine",
    "http_api",
    "workloads",
    "spot",
    "gateway",
    "latency",
    "scheduler",
]
"""The node actors that read node events from the bus (latency and scheduler: the fleet's
settings event)."""


def dropped_is(agent: NodeAgent, reason: str, count: int) -> bool:
    """Whether ``agent`` dropped ``count`` node events for ``reason`` (each message counts
    once, under whichever reader refused it first)."""
    registry = agent.metrics.registry
    name = "node_agent_events_dropped"
    return count == sum(counted(registry, name, actor=a, reason=reason) for a in EVENT_READERS)


def dropped_counts(agent: NodeAgent) -> dict[tuple[str, str], float]:
    """Every reader's dropped events by reason, for a failure's message."""
    registry = agent.metrics.registry
    return {
        (actor, reason): value
        for actor in EVENT_READERS
        for reason in ("no_session", "malformed")
        if (value := counted(registry, "node_agent_events_dropped", actor=actor, reason=reason))
    }


async def test_a_nested_node_event_is_dropped_by_every_reader(fleet: Fleet) -> None:
    """An event of every kind with a 5,000-level unknown field, signed with the node key
    from outside the agent, is refused undecoded (``no_session``); tagged as the agent's
    process tags its own (what its readers decode, besides an operator's inject) it is
    dropped as malformed, counted once a message, twice (the subscriptions live on), and
    no actor of the agent restarts."""
    agent = await fleet.start_agent()
    assert agent.supervisor is not None and await agent.supervisor.wait_ready(10)
    assert set(EVENT_READERS) <= set(agent.supervisor.status)
    assert agent.bus is not None
    key = fleet.node_key()
    subjects = Subjects(fleet.prefix)
    body = with_deep_field(b'{"ts":1.0}')
    async with attacker(fleet.url) as nc:
        for kind in EVENT_TYPES:
            await nc.publish(subjects.event("n1", kind), body, headers=key.headers(body))
        await wait_for(partial(dropped_is, agent, "no_session", len(EVENT_TYPES)))
    for round_ in (1, 2):
        for kind in EVENT_TYPES:
            subject = subjects.event("n1", kind)
            # On the agent's own connection, so its tags arrive in the order they were made.
            await agent.bus.publish(subject, body, headers=agent.events.headers(subject, body))
        try:
            await wait_for(partial(dropped_is, agent, "malformed", round_ * len(EVENT_TYPES)))
        except AssertionError:
            raise AssertionError(
                f"round {round_}: dropped {dropped_counts(agent)}, "
                f"restarts {restarts(agent.supervisor)}"
            ) from None
    assert set(restarts(agent.supervisor).values()) == {0}, restarts(agent.supervisor)


async def test_a_nested_probe_and_probe_answer_leave_the_prober_running(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """A peer answering every probe with a 5,000-level body (issue 30: the prober then
    crash-looped on every node) counts as a lost probe; a nested probe to the node goes
    unanswered; the prober keeps publishing its rounds and never restarts."""
    subjects = Subjects(prefix)
    rounds: list[Latency] = []

    async def collect(msg: Msg) -> None:
        rounds.append(codec.decode(msg.data, Latency, msg.subject))

    async def hostile_peer(msg: Msg) -> None:
        await msg.respond(with_deep_field(b'{"node_id":"evil"}'))

    await bus.subscribe(subjects.event("n1", EVENT_LATENCY), collect)
    await bus.subscribe(subjects.probe("evil"), hostile_peer)
    await bus.flush()
    config = fleet.config("n1", peers=["evil"], probe_interval=0.2, probe_timeout=0.5)
    supervisor = await fleet.start_supervisor(LatencyActor(config, bus, node_events(config)))
    async with attacker(fleet.url) as nc:
        answers = await nc.subscribe(probe_reply("x", "n1", "t1"))
        hostile = with_deep_field(b'{"from_node":"x"}')
        await nc.publish(subjects.probe("n1"), hostile, reply=probe_reply("x", "n1", "t1"))
        probe = codec.encode(Probe(from_node="x", nonce="1", sent_at=time.time()))
        await nc.publish(subjects.probe("n1"), probe, reply=probe_reply("x", "n1", "t1"))
        answer = await answers.next_msg(timeout=2)  # the valid probe's: the other got none
        assert codec.decode(answer.data, ProbeReply).nonce == "1"
    await wait_for(lambda: len(rounds) >= 3)
    peer = rounds[-1].peers[0]
    assert peer.target_node_id == "evil" and peer.rtt_us is None and peer.loss_pct == 100.0
    assert restarts(supervisor) == {"latency": 0}


async def test_the_batch_loop_survives_a_message_settled_twice_and_a_broken_handler(
    bus: NatsBus, prefix: str
) -> None:
    """The aggregator's consume loop (AckPolicy.ALL), whatever its handler does on one
    message: a step that breaks on the last message of a fetch terminates it, and the
    fetch's one ack on that same message (nats-py: MsgAlreadyAckdError, which ended every
    partition of an aggregator) changes nothing; a handler that raises on a whole fetch
    is given its messages one by one and only the one it breaks on is terminated. The
    loop runs on, and the consumer ends with nothing pending or unacknowledged."""
    stream = f"NEST_{prefix}"
    await bus.js.add_stream(StreamConfig(name=stream, subjects=[f"{prefix}.nest.>"]))
    consumer = DurableConsumer(
        bus.js,
        stream,
        f"{prefix}.nest.>",
        "nest",
        ConsumerConfig(ack_policy=AckPolicy.ALL, ack_wait=30),
    )
    await consumer.open()
    handled: list[bytes] = []
    dropped: list[str] = []

    async def broken_step(msg: Msg) -> None:
        raise ValueError(f"step broke on {msg.data!r}")

    async def handle(messages: list[Msg]) -> list[Chain]:
        if len(messages) > 1 and any(msg.data == b"whole" for msg in messages):
            raise RuntimeError("handler broke on the fetch")
        chains: list[Chain] = []
        for msg in messages:
            if msg.data == b"whole":
                raise RuntimeError("handler broke on this message")
            handled.append(msg.data)
            if msg.data == b"step":
                chains.append([(msg, partial(broken_step, msg))])
        return chains

    puller = BatchPuller(bus, consumer)
    loop = asyncio.create_task(
        consume_in_batches(
            puller, handle, batch=16, wait=0.5, what="test", dropped=dropped.append, linger=0.05
        )
    )
    try:
        for round_, bodies in enumerate(([b"a", b"step"], [b"b", b"whole", b"c"], [b"d"])):
            for body in bodies:
                await bus.js.publish(f"{prefix}.nest.{round_}", body)
            await wait_for(partial(operator.contains, handled, bodies[-1]))
        info = await bus.js.consumer_info(stream, "nest")
        await wait_for(lambda: not loop.done())
        assert handled == [b"a", b"step", b"b", b"c", b"d"]
        assert dropped == ["handler_error", "handler_error"]
        assert not loop.done()

        async def settled() -> bool:
            info = await bus.js.consumer_info(stream, "nest")
            return not info.num_pending and not info.num_ack_pending

        await wait_for(settled)
        assert info.delivered.stream_seq == 6
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
        await puller.close()


async def test_a_nested_result_is_ignored_by_the_dashboard(fleet: Fleet) -> None:
    """A node-signed result with a 5,000-level field, on the node's own result subject
    (what its stolen key may publish), is ignored by the dashboard's result feed; the
    node's next result is kept, and no actor of the aggregator's process restarts."""
    aggregator = new_aggregator(fleet.bus, fleet.prefix)
    config = msgspec.structs.replace(aggregator.config, http_port=0)
    metrics = aggregator.metrics
    assert isinstance(metrics, AggregatorMetrics)
    api = FleetApiActor(config, fleet.bus, metrics, dict, aggregator.view)
    dashboard = DashboardActor(config, fleet.bus, api, HeldNodes(aggregator.view))
    api.routes = dashboard.routes
    supervisor = await fleet.start_supervisor(aggregator, api, dashboard)
    subjects = Subjects(fleet.prefix)
    key = signing.KeyPair.generate()
    await approve(fleet.bus, subjects, "n1", key.public_key)
    async with attacker(fleet.url) as nc:
        js = nc.jetstream()
        await beat(js, fleet.prefix, key, "n1", codec.encode(heartbeat("n1", seq=1)))
        await wait_for(lambda: "n1" in api.current())
        result = CommandResult(
            command_id="c-1", node_id="n1", cluster="c1", status="accepted", ts=time.time()
        )
        hostile = with_deep_field(codec.encode(result))
        subject = subjects.result("c1", "n1")
        await js.publish(subject, hostile, headers=key.headers(hostile))
        honest = codec.encode(msgspec.structs.replace(result, command_id="c-2"))
        await js.publish(subject, honest, headers=key.headers(honest))
    await wait_for(lambda: dashboard.results.get("n1"))
    assert [kept.command_id for kept in dashboard.results["n1"]] == ["c-2"]
    assert set(restarts(supervisor).values()) == {0}, restarts(supervisor)
