"""Node events from the attacker's side: anyone who can publish on ``fleet.evt.<node>.*``
(an open server, or the node's own stolen seed and certificate under the shipped
accounts) tries to drive a node's actions and its signed heartbeat with forged events,
and to replay the node's own. Plain nats-py clients, no helpers of the project's bus."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import nats
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from actors.fleet.storage.registry import approve
from actors.node import deregistration
from actors.node.agent import NodeAgent
from schemas import codec, signing
from schemas.events import (
    EVENT_TYPES,
    HEADER_SESSION_TAG,
    Capacity,
    CloudFacts,
    Engine,
    Event,
    Gateway,
    Health,
    HealthCheck,
    Inject,
    Interruption,
    Latency,
    NodeState,
    Sample,
    Scheduler,
    Workload,
    Workloads,
    decode_event,
)
from schemas.messages import Heartbeat
from schemas.settings import Settings, SettingsStatus
from schemas.subjects import (
    EVENT_CLOUD,
    EVENT_ENGINE,
    EVENT_GATEWAY,
    EVENT_HEALTH,
    EVENT_INJECT,
    EVENT_INTERRUPTION,
    EVENT_LATENCY,
    EVENT_SAMPLE,
    EVENT_SCHEDULER,
    EVENT_SETTINGS,
    EVENT_STATE,
    EVENT_WORKLOAD_ORDER,
    EVENT_WORKLOADS,
)
from schemas.workloads import Deploy, Stop, WorkloadOrder
from tests.node.test_workloads import STANDIN_FLAGS
from tests.security.auth_fleet import NODES, PREFIX, SUBJECTS, VICTIM, AuthServer
from tests.support.commanding import Results, send
from tests.support.deploy import AUTH_CLUSTER
from tests.support.fleet import Fleet, wait_for, wait_record
from tests.support.workloads import killing_leftovers, standin_script

QUIET_S = 2.0
"""How long a node is watched for the effect of a forged event: four heartbeat intervals."""


@pytest.fixture
async def attacker(fleet: Fleet) -> Client:
    """A plain nats-py connection to the test's server."""
    nc = await nats.connect(fleet.url)
    fleet.stack.push_async_callback(nc.close)
    return nc


class Beats:
    """Every heartbeat node n1 publishes from now on."""

    def __init__(self) -> None:
        self.beats: list[Heartbeat] = []

    async def start(self, nc: Client, prefix: str) -> Beats:
        await nc.subscribe(f"{prefix}.hb.c1.n1", cb=self._on_beat)
        await nc.flush()
        return self

    async def _on_beat(self, msg: Msg) -> None:
        self.beats.append(codec.decode(msg.data, Heartbeat, msg.subject))


def dropped(agent: NodeAgent, reason: str = "") -> float:
    """Events dropped for ``reason`` (any reason if "") by all of the agent's actors."""
    return sum(
        sample.value
        for metric in agent.metrics.events_dropped.collect()
        for sample in metric.samples
        if sample.name.endswith("_total") and reason in ("", sample.labels["reason"])
    )


def terminate_notice() -> Interruption:
    return Interruption(
        ts=time.time(), provider="aws", kind="terminate", deadline=time.time() + 120, event_id="x"
    )


async def running_agent(fleet: Fleet, **settings: Any) -> NodeAgent:
    await fleet.start_aggregator()
    agent = await fleet.start_agent(fleet.config(**settings))
    await wait_record(fleet.bus, fleet.prefix, "n1", lambda r: r.state == "active")
    return agent


async def assert_untouched(fleet: Fleet, agent: NodeAgent) -> None:
    """For QUIET_S the node keeps beating as a schedulable, active node and keeps running."""
    seq = (await wait_record(fleet.bus, fleet.prefix, "n1", lambda r: True)).last_seq
    await asyncio.sleep(QUIET_S)
    record = await wait_record(fleet.bus, fleet.prefix, "n1", lambda r: r.last_seq > seq)
    assert record.state == "active" and record.schedulability == "schedulable"
    assert agent.supervisor is not None and not agent.supervisor.finished.is_set()


async def test_unsigned_interruption_neither_drains_nor_stops_the_node(
    fleet: Fleet, attacker: Client
) -> None:
    """An unsigned terminate notice on the node's interruption subject is dropped and
    counted: the node does not drain, deregister or exit."""
    agent = await running_agent(fleet)
    body = codec.encode(terminate_notice())
    await attacker.publish(f"{fleet.prefix}.evt.n1.interruption", body)
    await attacker.flush()
    await assert_untouched(fleet, agent)
    await wait_for(lambda: dropped(agent, "unsigned") >= 1)


async def test_event_signed_by_another_nodes_key_is_dropped(fleet: Fleet, attacker: Client) -> None:
    """A notice signed by node n2's (stolen) key, published on n1's subject, is dropped."""
    agent = await running_agent(fleet)
    n2 = fleet.node_key("n2")
    body = codec.encode(terminate_notice())
    await attacker.publish(f"{fleet.prefix}.evt.n1.interruption", body, headers=n2.headers(body))
    await attacker.flush()
    await assert_untouched(fleet, agent)
    await wait_for(lambda: dropped(agent, "untrusted_key") >= 1)


async def test_forged_state_and_sample_are_not_folded_into_the_heartbeat(
    fleet: Fleet, attacker: Client
) -> None:
    """Unsigned ``state`` and ``sample`` events never reach the node's signed heartbeat."""
    agent = await running_agent(fleet)
    beats = await Beats().start(attacker, fleet.prefix)
    state = NodeState(ts=time.time(), schedulability="drained", reason="forged")
    capacity = Capacity(
        cpu_cores=1,
        cpu_percent=0.0,
        load_avg_1m=0.0,
        memory_total=1,
        memory_available=1,
        gpus_total=0,
        gpus_available=0,
        storage_total=1,
        storage_available=1,
    )
    sample = Sample(ts=time.time() + 60, capacity=capacity, hostname="forged")
    for _ in range(3):
        await attacker.publish(f"{fleet.prefix}.evt.n1.state", codec.encode(state))
        await attacker.publish(f"{fleet.prefix}.evt.n1.sample", codec.encode(sample))
        await attacker.flush()
        await asyncio.sleep(QUIET_S / 3)
    await wait_for(lambda: dropped(agent, "unsigned") >= 6)
    await wait_for(lambda: len(beats.beats) >= 2)
    assert all(beat.schedulability == "schedulable" for beat in beats.beats)
    assert all(beat.sample is None or beat.sample.hostname != "forged" for beat in beats.beats)


async def test_inject_signed_by_a_trusted_operator_is_accepted(
    fleet: Fleet, attacker: Client
) -> None:
    """A fault injection signed by an operator key the agent trusts takes effect; the same
    injection signed by an untrusted key does not."""
    operator, stranger = signing.KeyPair.generate(), signing.KeyPair.generate()
    agent = await running_agent(fleet, trust_operators=[operator.public_key])
    beats = await Beats().start(attacker, fleet.prefix)
    subject = f"{fleet.prefix}.evt.n1.inject"

    def hot(beat: Heartbeat) -> bool:
        return beat.sample is not None and beat.sample.gpus[1].temperature_c == 95.0

    forged = codec.encode(Inject(ts=time.time(), node_id="n1", fault="temp", gpu=1, value=95))
    await attacker.publish(subject, forged, headers=stranger.headers(forged))
    await attacker.flush()
    await asyncio.sleep(QUIET_S / 2)
    assert not any(hot(beat) for beat in beats.beats)
    await wait_for(lambda: dropped(agent, "untrusted_key") >= 1)

    body = codec.encode(Inject(ts=time.time(), node_id="n1", fault="temp", gpu=1, value=95))
    await attacker.publish(subject, body, headers=operator.headers(body))
    await attacker.flush()
    await wait_for(lambda: any(hot(beat) for beat in beats.beats))


async def test_honest_traffic_still_flows(fleet: Fleet) -> None:
    """The node's own events all reach its heartbeat with nothing dropped, and a notice its
    own process publishes (as its spot watcher would) still drains it."""
    agent = await running_agent(fleet)
    record = await wait_record(
        fleet.bus,
        fleet.prefix,
        "n1",
        lambda r: bool(
            r.health_status == "healthy"
            and r.heartbeat
            and r.heartbeat.sample
            and r.heartbeat.health
            and r.heartbeat.engine
            and r.heartbeat.latency
        ),
    )
    assert record.state == "active"
    assert dropped(agent) == 0
    await fleet.publish_event("interruption", terminate_notice())
    await wait_record(fleet.bus, fleet.prefix, "n1", lambda r: r.schedulability != "schedulable")


async def test_a_captured_notice_replayed_after_the_command_lifetime_does_nothing(
    fleet: Fleet, attacker: Client
) -> None:
    """A terminate notice signed with the node's key and older than max_command_lifetime
    (captured, sent again) neither drains nor stops it: refused as not the process's own,
    and too old besides (the node remembers a notice's key only that long)."""
    agent = await running_agent(fleet, max_command_lifetime=60.0)
    old = msgspec.structs.replace(terminate_notice(), ts=time.time() - 120)
    body = codec.encode(old)
    await attacker.publish(
        f"{fleet.prefix}.evt.n1.interruption", body, headers=agent.key.headers(body)
    )
    await attacker.flush()
    await assert_untouched(fleet, agent)


# A stolen node key, from another machine, under the shipped accounts over mutual TLS ------


STOLEN = VICTIM
"""The node whose seed and client certificate the attacker holds, and whose real agent
runs: everything below is sent on that node's own subjects, which it may publish on."""
FORGED_MARK = "forged"
FORGED_REVISION = 999_999


@dataclass
class Victim:
    """The real agent of the stolen node, a ready workload it runs for an operator, and
    the attacker's connection with the node's seed and certificate."""

    auth: AuthServer
    agent: NodeAgent
    operator: signing.KeyPair
    results: Results
    nc: Client
    beats: list[Heartbeat] = field(default_factory=list)
    captured: list[Msg] = field(default_factory=list)
    """Every event of the node's the attacker heard (it may read its own subjects)."""

    @property
    def state_dir(self) -> Path:
        return Path(self.agent.config.state_dir)

    async def deploy(self, action: Deploy | Stop) -> None:
        """An operator's signed deploy or stop through FLEET_CMD, done."""
        command = await send(
            self.auth.admin, PREFIX, self.operator, action, node=STOLEN, cluster=AUTH_CLUSTER
        )
        final = await self.results.final(command.id)
        assert final.status == "done", final.detail

    async def beats_after(self, seq: int, count: int) -> list[Heartbeat]:
        """The agent's next ``count`` heartbeats after ``seq`` (waited for, not slept)."""
        await wait_for(lambda: len([b for b in self.beats if b.seq > seq]) >= count)
        return [beat for beat in self.beats if beat.seq > seq]

    async def beat_where(self, shows: Callable[[Heartbeat], bool]) -> Heartbeat:
        """The newest heartbeat that ``shows`` what a test needs, once one does: a command's
        result comes before the heartbeat that reflects it."""
        found: list[Heartbeat] = await wait_for(lambda: [b for b in self.beats if shows(b)])
        return found[-1]

    async def _on_beat(self, msg: Msg) -> None:
        self.beats.append(codec.decode(msg.data, Heartbeat, msg.subject))

    async def _on_event(self, msg: Msg) -> None:
        self.captured.append(msg)


def refused(agent: NodeAgent) -> dict[str, float]:
    """The agent's refusals so far, by reason (every actor's together)."""
    counts: dict[str, float] = {}
    for metric in agent.metrics.events_dropped.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total") and sample.value:
                reason = sample.labels["reason"]
                counts[reason] = counts.get(reason, 0) + sample.value
    return counts


@pytest.fixture
def no_orphans() -> Iterator[None]:
    """Kill the workloads a test's agent left running, once the agent has stopped."""
    with killing_leftovers():
        yield


@pytest.fixture
def standin(tmp_path: Path) -> Path:
    """An executable ``llama-server`` that runs the stand-in, for the llama.cpp template."""
    return standin_script(tmp_path / "bin")


@pytest.fixture
async def victim(no_orphans: None, tls_auth: AuthServer, standin: Path) -> AsyncIterator[Victim]:
    """The stolen node's agent, approved, trusting an operator, running the workload
    ``chat`` that operator deployed; the attacker connected from elsewhere with nothing but
    the node's seed and client certificate, listening to the node's heartbeats and events."""
    auth = tls_auth
    operator = signing.KeyPair.generate()
    results = await Results().start(auth.admin, PREFIX)
    for node in NODES:
        await approve(auth.admin, SUBJECTS, node, auth.keys[node].public_key)
    await auth.fleet.start_aggregator()
    config = auth.config(
        STOLEN,
        probe_interval=60.0,
        trust_operators=[operator.public_key],
        workload_binaries=[f"llamacpp={standin}"],
        workload_args=[f"llamacpp={flag}" for flag in STANDIN_FLAGS],
        workload_stop_grace=2.0,
    )
    agent = await auth.fleet.start_agent(config)
    await wait_record(auth.admin, PREFIX, STOLEN, lambda r: r.state == "active")
    nc = await nats.connect(
        auth.server.url,
        nkeys_seed_str=auth.keys[STOLEN].seed,
        tls=auth.tls(STOLEN),
        inbox_prefix=f"_INBOX.{STOLEN}",
        allow_reconnect=False,
    )
    auth.fleet.stack.push_async_callback(nc.close)
    scene = Victim(auth, agent, operator, results, nc)
    await nc.subscribe(SUBJECTS.heartbeat(AUTH_CLUSTER, STOLEN), cb=scene._on_beat)
    await nc.subscribe(SUBJECTS.events(STOLEN), cb=scene._on_event)
    await nc.flush()
    await scene.deploy(chat())
    yield scene


def chat(name: str = "chat", gpus: tuple[int, ...] = (1,)) -> Deploy:
    return Deploy(
        name=name, engine="llamacpp", model="/models/x.gguf", gpus=[*gpus], ready_timeout=15.0
    )


def forgeries(state_dir: Path, operator: str) -> list[tuple[str, Event]]:
    """One message of every event kind, each with the worst content the kind can carry:
    orders to run a shell on both GPUs and to stop the operator's workload, a deregistering
    drained state set ``by`` the operator, a terminate notice, a lost GPU, settings that
    would silence the heartbeat for an hour and fail the boot check, and claims (sample,
    health, latency, engine, cloud, Slurm, workloads, gateway) that would show in the
    node's heartbeat."""
    now = time.time()
    shell = Deploy(
        name="evil",
        engine="process",
        args=["/bin/sh", "-c", f"touch {state_dir / 'pwned'}"],
        gpus=[0, 1],
        share=True,
        ready_timeout=5.0,
    )
    capacity = Capacity(
        cpu_cores=1,
        cpu_percent=100.0,
        load_avg_1m=99.0,
        memory_total=1,
        memory_available=0,
        gpus_total=0,
        gpus_available=0,
        storage_total=1,
        storage_available=0,
    )
    unhealthy = HealthCheck(name="boot", status="unhealthy", reason="$(touch /tmp/x)`id`\x1b[2J")
    workload = Workload(name="evil", engine="process", state="ready", since=now, port=1)
    return [
        (EVENT_WORKLOAD_ORDER, WorkloadOrder(ts=now, command_id=f"{FORGED_MARK}-1", action=shell)),
        (
            EVENT_WORKLOAD_ORDER,
            WorkloadOrder(ts=now, command_id=f"{FORGED_MARK}-2", action=Stop(name="chat")),
        ),
        (
            EVENT_STATE,
            NodeState(
                ts=now,
                schedulability="drained",
                reason=FORGED_MARK,
                command_id=FORGED_MARK,
                deregistering=True,
                by=operator,
            ),
        ),
        (
            EVENT_INTERRUPTION,
            Interruption(
                ts=now, provider="aws", kind="terminate", deadline=now, event_id=FORGED_MARK
            ),
        ),
        (EVENT_INJECT, Inject(ts=now, node_id=STOLEN, fault="gpu-lost")),
        (EVENT_SAMPLE, Sample(ts=now + 60, capacity=capacity, hostname="node-1-bmc.example")),
        (EVENT_HEALTH, Health(ts=now + 60, status="unhealthy", score=0, checks=[unhealthy])),
        (EVENT_LATENCY, Latency(ts=now + 60, gateway_rtt_us=123_456_789, loss_pct=100.0)),
        (EVENT_ENGINE, Engine(ts=now + 60, in_flight=999)),
        (EVENT_CLOUD, CloudFacts(ts=now, provider="aws", region=FORGED_MARK, lifecycle="spot")),
        (
            EVENT_SCHEDULER,
            Scheduler(ts=now, kind="slurm", reachable=True, drain=True, state_reason=FORGED_MARK),
        ),
        (EVENT_WORKLOADS, Workloads(ts=now + 60, workloads=[workload])),
        (EVENT_GATEWAY, Gateway(ts=now + 60, serving=True, endpoint="https://evil.example")),
        (
            EVENT_SETTINGS,
            Settings(
                ts=now,
                status=SettingsStatus(revision=FORGED_REVISION, applied={"peers": FORGED_MARK}),
                live={"heartbeat_interval": 3600.0, "stale_after": 86400.0, "expected_gpus": 64},
            ),
        ),
    ]


def forged_traces(beat: Heartbeat) -> list[str]:
    """What of the forgeries a heartbeat of the node shows (nothing, if none was taken)."""
    sample, health = beat.sample, beat.health
    traces = {
        "state": beat.schedulability != "schedulable" or beat.deregistering,
        "workload_order": [(w.name, w.state) for w in beat.workloads] != [("chat", "ready")],
        "interruption": beat.spot is not None and beat.spot.notice is not None,
        "inject": sample is not None and any(gpu.lost for gpu in sample.gpus),
        "sample": sample is not None and sample.hostname == "node-1-bmc.example",
        "health": health is not None and health.status == "unhealthy",
        "latency": beat.latency is not None and beat.latency.gateway_rtt_us == 123_456_789,
        "engine": beat.engine is not None and beat.engine.in_flight == 999,
        "cloud": beat.labels.get("region") == FORGED_MARK,
        "scheduler": beat.scheduler is not None,
        "gateway": beat.endpoint == "https://evil.example",
        "settings": beat.interval == 3600.0
        or (beat.settings is not None and beat.settings.revision == FORGED_REVISION),
    }
    return [kind for kind, shown in traces.items() if shown]


@pytest.mark.slow
async def test_a_stolen_node_key_cannot_make_its_node_act(
    victim: Victim, caplog: pytest.LogCaptureFixture
) -> None:
    """With only the node's seed and client certificate, under both shipped account
    configurations over mutual TLS, every event kind (worst-case content) signed with the
    node's key on its own subjects, and a deregistering heartbeat on its heartbeat subject:
    the real agent starts and stops nothing, does not drain, deregister or exit, its
    heartbeats carry none of the forged values, and each message is refused, counted and
    logged once (``no_session``); an operator's deploy through FLEET_CMD still runs."""
    caplog.set_level(logging.DEBUG, logger="actors.node.events")
    agent, key = victim.agent, victim.auth.keys[STOLEN]
    forged = forgeries(victim.state_dir, victim.operator.public_key)
    assert {kind for kind, _ in forged} == set(EVENT_TYPES)
    workloads = (victim.state_dir / "workloads.json").read_bytes()
    last = (await victim.beats_after(0, 1))[-1]
    for kind, event in forged:
        body = codec.encode(event)
        await victim.nc.publish(SUBJECTS.event(STOLEN, kind), body, headers=key.headers(body))
    # A heartbeat saying the deregistration is over: the command executor's cue to exit.
    beat = msgspec.structs.replace(last, seq=1, deregistering=True, workloads=[], ts=time.time())
    body = codec.encode(beat)
    headers = {**key.headers(body), "Nats-Msg-Id": f"{STOLEN}:{beat.boot_id}:1"}
    await victim.nc.publish(SUBJECTS.heartbeat(AUTH_CLUSTER, STOLEN), body, headers=headers)
    await victim.nc.flush()
    sent = len(forged) + 1
    await wait_for(lambda: refused(agent) == {"no_session": sent})

    after = await victim.beats_after(last.seq, 4)
    assert [forged_traces(beat) for beat in after] == [[]] * len(after)
    record = await wait_record(victim.auth.admin, PREFIX, STOLEN, lambda r: r.last_seq > last.seq)
    assert (record.state, record.schedulability) == ("active", "schedulable")
    assert (victim.state_dir / "workloads.json").read_bytes() == workloads
    assert not (victim.state_dir / "pwned").exists()
    assert victim.results.of(f"{FORGED_MARK}-1") == victim.results.of(f"{FORGED_MARK}-2") == []
    assert agent.supervisor is not None and not agent.supervisor.finished.is_set()
    assert not deregistration.marker_path(victim.state_dir).exists()
    assert refused(agent) == {"no_session": sent}
    logged = [r for r in caplog.records if r.getMessage() == "node event dropped"]
    assert len(logged) == sent

    await victim.deploy(chat("chat2", gpus=(0,)))
    await wait_for(
        lambda: any(
            {(w.name, w.state) for w in beat.workloads} == {("chat", "ready"), ("chat2", "ready")}
            for beat in victim.beats
        ),
    )


def is_stop_order(msg: Msg) -> bool:
    if not msg.subject.endswith(f".{EVENT_WORKLOAD_ORDER}"):
        return False
    order = decode_event(msg.subject, msg.data)
    return isinstance(order, WorkloadOrder) and isinstance(order.action, Stop)


@pytest.mark.slow
async def test_a_captured_event_of_the_node_sent_again_is_refused(victim: Victim) -> None:
    """The node's own event, captured as the stolen key may (its ``workload_order`` stopping
    ``chat``, its ``state``), sent again exactly as captured, tag included, once the operator
    has deployed ``chat`` anew: refused as ``replayed``, counted once each, and ``chat``
    keeps running."""

    def runs_chat(beat: Heartbeat) -> bool:
        return [(w.name, w.state) for w in beat.workloads] == [("chat", "ready")]

    # The first chat's beats showed it ready too: the mark is a beat after its stop.
    before = max((beat.seq for beat in victim.beats), default=0)
    await victim.deploy(Stop(name="chat"))
    gone = await victim.beat_where(
        lambda beat: beat.seq > before and all(w.name != "chat" for w in beat.workloads)
    )
    await victim.deploy(chat())
    stop = next(m for m in victim.captured if is_stop_order(m))
    state = next(m for m in reversed(victim.captured) if m.subject.endswith(f".{EVENT_STATE}"))
    last = await victim.beat_where(lambda beat: beat.seq > gone.seq and runs_chat(beat))
    for msg in (stop, state):
        assert msg.headers is not None and HEADER_SESSION_TAG in msg.headers
        await victim.nc.publish(msg.subject, msg.data, headers=msg.headers)
    await victim.nc.flush()
    await wait_for(lambda: refused(victim.agent) == {"replayed": 2})
    after = await victim.beats_after(last.seq, 4)
    assert all(runs_chat(beat) for beat in after), [(b.seq, b.workloads) for b in after]
    assert refused(victim.agent) == {"replayed": 2}
