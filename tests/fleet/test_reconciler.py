"""Placed workloads against real servers: ``fleetctl deploy`` without a node on fake-GPU
agents running the llama.cpp stand-in (only on nodes that can run it), and workload
reconcilers moving replicas off a node that stops, off a node that drains before its
drain finishes, and off a node where the replica failed: the hand-offs measured against
one heartbeat interval + 2 s, with the aggregators at the default checkpoint interval."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from nats.aio.msg import Msg

from actors.fleet.config import AggregatorConfig
from actors.fleet.metrics import AggregatorMetrics
from actors.fleet.placement.actor import ReconcilerActor
from actors.fleet.placement.reconcile import FAILED_STATES, Timing
from actors.fleet.process import ProviderActors
from actors.fleet.storage.placed import read_all
from actors.node.agent import NodeAgent
from actors.node.workloads import processes
from actors.node.workloads.store import Entry, WorkloadStore
from actors.runtime.bus import NatsBus, publish_signed_event
from actors.runtime.embedded import NatsServer
from schemas import codec, signing
from schemas.events import Inject
from schemas.messages import Command, Cordon, Drain, Heartbeat, NodeRecord, Uncordon
from schemas.placement import Leftover, PlacedWorkload, spec_body
from schemas.subjects import BUCKET_WORKLOADS, EVENT_INJECT, EVENT_WORKLOAD_ORDER, Subjects
from schemas.workloads import Deploy, Stop, WorkloadOrder
from tests.cli.test_describe_events import fleetctl as plain_fleetctl
from tests.cli.test_fleetctl_commands import finish, fleetctl
from tests.cli.test_workloads_cli import workloads
from tests.node.test_inject import dropped
from tests.support.commanding import Results, send
from tests.support.fleet import Fleet, agent_config, wait_for, wait_record
from tests.support.relay import Relay
from tests.support.workloads import killing_leftovers, standin_script

pytestmark = pytest.mark.slow

DEPLOY = (
    "--engine",
    "llamacpp",
    "--model",
    "/models/m.gguf",
    "--gpus",
    "1",
    "--ready-timeout",
    "30s",
)
INTERVAL = 0.5
"""The test agents' heartbeat interval: a hand-off is due within it + HANDOFF_SLACK."""
HANDOFF_SLACK = 2.0
CHECKPOINT = AggregatorConfig().checkpoint_interval
"""The default: the hand-offs must not wait for a checkpoint."""


@pytest.fixture(autouse=True)
def no_orphans() -> Iterator[None]:
    with killing_leftovers():
        yield


class Keys:
    def __init__(self, tmp_path: Path) -> None:
        self.operator_file = tmp_path / "operator.nk"
        self.operator = signing.create_key_file(self.operator_file)
        self.reconciler_file = tmp_path / "reconciler.nk"
        self.reconciler = signing.create_key_file(self.reconciler_file)


async def start_nodes(
    fleet: Fleet,
    keys: Keys,
    tmp_path: Path,
    *names: str,
    binary: Path | None = None,
    relays: dict[str, Relay] | None = None,
) -> dict[str, NodeAgent]:
    """Agents trusting both keys, with the stand-in as llama-server (or ``binary``), each
    active and having said what it can run; with ``relays``, each reaches the server
    through a relay of its own (put there) that the test can cut."""
    script = binary or standin_script(tmp_path / "bin")
    agents = {}
    for name in names:
        server = fleet.url
        if relays is not None:
            relays[name] = Relay(fleet.url)
            server = await relays[name].start()
            fleet.stack.push_async_callback(relays[name].close)
        config = agent_config(
            server,
            fleet.prefix,
            fleet.state_dir,
            name,
            trust_operators=[keys.operator.public_key, keys.reconciler.public_key],
            workload_binaries=[f"llamacpp={script}"],
            workload_stop_grace=2.0,
            shutdown_drain=False,
        )
        agents[name] = await fleet.start_agent(config)
    for name in names:
        await wait_record(fleet.bus, fleet.prefix, name, said_capabilities)
    return agents


def said_capabilities(record: NodeRecord) -> bool:
    beat = record.heartbeat
    return record.state == "active" and beat is not None and beat.capabilities is not None


async def placed(bus: NatsBus, prefix: str, name: str) -> PlacedWorkload:
    found = await read_all(bus, Subjects(prefix))
    return found[name][0]


async def deploy_chat(
    nats_server: NatsServer, bus: NatsBus, prefix: str, keys: Keys
) -> PlacedWorkload:
    """``fleetctl deploy chat --wait``, which must succeed; the workload as placed."""
    code, out, err = await finish(
        await fleetctl(nats_server, prefix, keys.operator_file, "deploy", "chat", *DEPLOY, "--wait")
    )
    assert code == 0, out + err
    return await placed(bus, prefix, "chat")


def running(record: NodeRecord, name: str, state: str = "ready") -> bool:
    beat = record.heartbeat
    return beat is not None and any(w.name == name and w.state == state for w in beat.workloads)


async def ready_on(bus: NatsBus, prefix: str, node: str, name: str) -> NodeRecord:
    return await wait_record(bus, prefix, node, lambda r: running(r, name))


class Traffic:
    """Every command and heartbeat published for the test's prefix, decoded: when each
    command was issued and each heartbeat sent are the measured hand-offs' clocks."""

    def __init__(self) -> None:
        self.commands: list[Command] = []
        self.beats: list[Heartbeat] = []

    async def start(self, bus: NatsBus, prefix: str) -> Traffic:
        await bus.subscribe(Subjects(prefix).commands(), self._on_command)
        await bus.subscribe(Subjects(prefix).heartbeats(), self._on_beat)
        await bus.flush()
        return self

    async def _on_command(self, msg: Msg) -> None:
        self.commands.append(codec.decode(msg.data, Command, msg.subject))

    async def _on_beat(self, msg: Msg) -> None:
        self.beats.append(codec.decode(msg.data, Heartbeat, msg.subject))

    def deploys(self, node: str | None = None) -> list[Command]:
        return [
            c for c in self.commands if isinstance(c.action, Deploy) and node in (None, c.node_id)
        ]

    def stops(self, node: str) -> list[Command]:
        return [c for c in self.commands if isinstance(c.action, Stop) and c.node_id == node]

    def first_beat(self, node: str, name: str, states: frozenset[str]) -> Heartbeat:
        """The first heartbeat of ``node`` listing workload ``name`` in one of ``states``."""
        return next(
            beat
            for beat in self.beats
            if beat.node_id == node
            and any(w.name == name and w.state in states for w in beat.workloads)
        )


def within_a_heartbeat(what: str, start: float, end: float) -> None:
    """Assert ``end`` came within one heartbeat interval + 2 s of ``start``, saying the
    time measured (printed too: ``pytest -rP`` shows it when the test passes)."""
    took = end - start
    bound = INTERVAL + HANDOFF_SLACK
    print(f"{what} {took:.2f}s after (bound {bound:.1f}s)")
    assert took <= bound, f"{what} {took:.2f}s after (bound {bound:.1f}s)"


def reconciler(
    bus: NatsBus, prefix: str, keys: Keys, interval: float = 0.3, **timing: Any
) -> ReconcilerActor:
    values: dict[str, Any] = {"grace": 2.0, "handoff": 20.0, "restop": 5.0, **timing}
    return ReconcilerActor(
        bus,
        prefix,
        str(keys.reconciler_file),
        interval,
        Timing(**values),
        [keys.operator.public_key],
    )


async def test_two_replicas_land_on_free_nodes_not_cordoned_or_unhealthy(
    nats_server: NatsServer, fleet: Fleet, bus: NatsBus, prefix: str, tmp_path: Path
) -> None:
    """A 2-replica deploy with no node named lands on the two schedulable healthy nodes
    (each its own GPU, ready there), never on the cordoned one or the one with XID 79;
    ``workloads --why`` says why, and a second deploy of the name is refused."""
    keys = Keys(tmp_path)
    await fleet.start_aggregator()
    await start_nodes(fleet, keys, tmp_path, "n1", "n2", "n3", "n4")
    await send(bus, prefix, keys.operator, Cordon(), node="n1")
    inject = Inject(ts=time.time(), node_id="n2", fault="xid", value=79)
    await fleet.publish_event(EVENT_INJECT, inject, "n2")
    await wait_record(bus, prefix, "n1", lambda r: r.state == "cordoned")
    await wait_record(bus, prefix, "n2", lambda r: r.state == "unhealthy")
    code, out, err = await finish(
        await fleetctl(
            nats_server, prefix, keys.operator_file, "deploy", "chat", *DEPLOY,
            "--replicas", "2", "--why", "--wait",
        )
    )  # fmt: skip
    assert code == 0, out + err
    workload = await placed(bus, prefix, "chat")
    assert sorted(r.node for r in workload.replicas) == ["n3", "n4"]
    assert all(len(r.gpus) == 1 for r in workload.replicas)
    for replica in workload.replicas:
        record = await ready_on(bus, prefix, replica.node, "chat")
        assert record.heartbeat is not None
        [listed] = [w for w in record.heartbeat.workloads if w.name == "chat"]
        assert listed.gpus == replica.gpus and listed.placed
        assert "n1: cordoned" in replica.why and "n2: unhealthy" in replica.why
    code, out, err = await workloads(nats_server, prefix, "--why")
    assert code == 0, err
    assert "why: n3: GPUs" in out or "why: n4: GPUs" in out
    code, _, err = await finish(
        await fleetctl(nats_server, prefix, keys.operator_file, "deploy", "chat", *DEPLOY)
    )
    assert code == 1 and "placed already" in err
    code, out, err = await finish(
        await fleetctl(nats_server, prefix, keys.operator_file, "undeploy", "chat")
    )
    assert code == 0 and out.count("stop sent") == 2, out + err
    assert "chat" not in await read_all(bus, Subjects(prefix))
    for name in ("n3", "n4"):
        await wait_record(bus, prefix, name, lambda r: not running(r, "chat"))


async def test_an_aggregator_with_a_workloads_key_runs_the_reconciler(
    bus: NatsBus, tmp_path: Path
) -> None:
    """workloads_key_file puts a reconciler, signing with that key and trusting the
    workloads operators, among the aggregator process's actors; without it, none."""
    key = signing.create_key_file(tmp_path / "reconciler.nk")
    operator = signing.KeyPair.generate().public_key
    config = AggregatorConfig(
        workloads_key_file=str(tmp_path / "reconciler.nk"), workloads_operators=[operator]
    )
    actors = ProviderActors(config, bus, AggregatorMetrics()).supervisor.actors
    [found] = [actor for actor in actors if isinstance(actor, ReconcilerActor)]
    assert found.key.public_key == key.public_key and found.operators == {key.public_key, operator}
    plain = ProviderActors(AggregatorConfig(), bus, AggregatorMetrics()).supervisor.actors
    assert not any(isinstance(actor, ReconcilerActor) for actor in plain)


async def test_a_stopped_node_s_replica_moves_once_with_two_reconcilers(
    nats_server: NatsServer, fleet: Fleet, bus: NatsBus, prefix: str, tmp_path: Path
) -> None:
    """The node of one replica stops beating: its copy is shown unknown (never ready, no
    endpoint); after the grace the replica is deployed on the spare node exactly once
    though two reconcilers run, and is ready there."""
    keys = Keys(tmp_path)
    await fleet.start_aggregator()
    agents = await start_nodes(fleet, keys, tmp_path, "n1", "n2", "n3")
    deploys = await Traffic().start(bus, prefix)
    code, out, err = await finish(
        await fleetctl(
            nats_server, prefix, keys.operator_file, "deploy", "chat", *DEPLOY,
            "--replicas", "2", "--wait",
        )
    )  # fmt: skip
    assert code == 0, out + err
    first = await placed(bus, prefix, "chat")
    nodes = {r.node for r in first.replicas}
    [spare] = {"n1", "n2", "n3"} - nodes
    victim = first.replicas[0].node
    other = await fleet.connect("second-reconciler")
    actors = [reconciler(bus, prefix, keys), reconciler(other, prefix, keys)]
    await fleet.start_supervisor(*actors)
    await agents[victim].stop(goodbye=False)  # as if killed: no goodbye heartbeat
    stale = await wait_record(bus, prefix, victim, lambda r: r.state == "stale")
    code, out, err = await workloads(nats_server, prefix)
    [row] = [line for line in out.splitlines() if line.startswith(victim)]
    assert code == 0 and "unknown (node stale" in row and "127.0.0.1" not in row, out + err
    await ready_on(bus, prefix, spare, "chat")
    moved_at = time.time()
    after = await placed(bus, prefix, "chat")
    assert {r.node for r in after.replicas} == {spare, first.replicas[1].node}
    assert after.replicas[0].moves == 1 and f"moved off {victim}" in after.replicas[0].why
    assert stale.stale_since is not None and moved_at - stale.stale_since < 2.0 + 15.0
    # Three more rounds of each reconciler: nothing more is sent.
    marks = [actor.rounds for actor in actors]
    await wait_for(lambda: all(a.rounds >= n + 3 for a, n in zip(actors, marks, strict=True)))
    assert len(deploys.deploys(spare)) == 1
    assert len(deploys.deploys()) == 3
    assert sum(actor.sent for actor in actors) == 1
    sent = [
        actor.metrics.registry.get_sample_value("fleet_workload_commands_total", {"kind": "deploy"})
        for actor in actors
    ]
    assert sorted(value or 0.0 for value in sent) == [0.0, 1.0]
    for actor in actors:
        placed_now = {"workload": "chat", "state": "placed"}
        assert actor.metrics.registry.get_sample_value("fleet_workload_replicas", placed_now) == 2


async def test_a_drain_moves_placed_work_before_it_finishes(
    nats_server: NatsServer, fleet: Fleet, bus: NatsBus, prefix: str, tmp_path: Path
) -> None:
    """Draining the node of a placed replica: the reconciler deploys it on the other node,
    stops the old copy once the new one is ready, and only then does the drain finish
    (done, drained, well before its deadline): the stop is sent within one heartbeat
    interval + 2 s of the new copy's ready heartbeat, at the default checkpoint interval
    and the default reconciler interval (5 s)."""
    keys = Keys(tmp_path)
    await fleet.start_aggregator(checkpoint_interval=CHECKPOINT)
    await start_nodes(fleet, keys, tmp_path, "n1", "n2")
    results = await Results().start(bus, prefix)
    traffic = await Traffic().start(bus, prefix)
    [replica] = (await deploy_chat(nats_server, bus, prefix, keys)).replicas
    source = replica.node
    [target] = {"n1", "n2"} - {source}
    await fleet.start_supervisor(reconciler(bus, prefix, keys, interval=5.0))
    drain = await send(bus, prefix, keys.operator, Drain(deadline=60.0), node=source)
    final = await results.final(drain.id)
    assert final.status == "done" and final.detail.startswith("drained"), final.detail
    # The old copy is stopped at once when the new one is ready, or after the 20 s
    # handoff: a drain done sooner waited for the move, not for the handoff.
    assert final.ts - drain.issued_at < 20.0
    moving = [r.detail for r in results.of(drain.id) if r.status == "in_progress"]
    assert any("1 placed workloads to move" in detail for detail in moving)
    await ready_on(bus, prefix, target, "chat")
    source_record = await wait_record(bus, prefix, source, lambda r: r.state == "drained")
    assert source_record.heartbeat is not None
    assert not any(w.name == "chat" for w in source_record.heartbeat.workloads)
    [moved] = (await placed(bus, prefix, "chat")).replicas
    assert moved.node == target and "draining" in moved.why
    ready = traffic.first_beat(target, "chat", frozenset({"ready"}))
    [stop, *_] = traffic.stops(source)
    within_a_heartbeat("the old copy's stop was sent", ready.ts, stop.issued_at)


def failing_script(directory: Path, gate: Path | None = None) -> Path:
    """``directory/llama-server`` exiting 3 at once, or once ``gate`` exists."""
    directory.mkdir(parents=True, exist_ok=True)
    script = directory / "llama-server"
    wait = f"until [ -e {gate} ]; do sleep 0.1; done\n" if gate is not None else ""
    script.write_text(f"#!/bin/sh\n{wait}exit 3\n")
    script.chmod(0o755)
    return script


async def crashing_node(fleet: Fleet, keys: Keys, script: Path) -> None:
    """Node n1, whose llama-server is ``script``, crash-looping after two exits."""
    trusted = [keys.operator.public_key, keys.reconciler.public_key]
    config = fleet.config(
        "n1", trust_operators=trusted, workload_binaries=[f"llamacpp={script}"],
        workload_crash_limit=2,
    )  # fmt: skip
    await fleet.start_agent(config)
    await wait_record(fleet.bus, fleet.prefix, "n1", said_capabilities)


async def test_a_replica_crash_looping_on_one_node_is_tried_on_another(
    nats_server: NatsServer, fleet: Fleet, bus: NatsBus, prefix: str, tmp_path: Path
) -> None:
    """A replica that crash-loops on n1 (its llama-server exits at once there): deploy
    --wait exits 1 naming the replica, its node and the node's reason; the reconciler
    then places it on n2, where it is ready, and stops its copy on n1; n1 is remembered
    as a node the replica failed on."""
    keys = Keys(tmp_path)
    await fleet.start_aggregator(checkpoint_interval=CHECKPOINT)
    await crashing_node(fleet, keys, failing_script(tmp_path / "broken"))
    await start_nodes(fleet, keys, tmp_path, "n2")
    await send(bus, prefix, keys.operator, Cordon(), node="n2")
    await wait_record(bus, prefix, "n2", lambda r: r.state == "cordoned")
    code, out, err = await finish(
        await fleetctl(nats_server, prefix, keys.operator_file, "deploy", "chat", *DEPLOY, "--wait")
    )
    assert code == 1 and "replica 0: n1" in out, out + err
    assert "error: replica 0 crashloop on n1: " in err and "fleetctl workloads --why" in err, err
    await send(bus, prefix, keys.operator, Uncordon(), node="n2")
    await wait_record(bus, prefix, "n2", lambda r: r.state == "active")
    await fleet.start_supervisor(reconciler(bus, prefix, keys))
    await ready_on(bus, prefix, "n2", "chat")
    await wait_record(
        bus,
        prefix,
        "n1",
        lambda r: (
            r.heartbeat is not None and not any(w.name == "chat" for w in r.heartbeat.workloads)
        ),
    )
    [replica] = (await placed(bus, prefix, "chat")).replicas
    assert replica.node == "n2" and replica.avoid == ["n1"] and "crashloop there" in replica.why


async def test_a_failed_replica_moves_within_a_heartbeat_of_its_failure(
    nats_server: NatsServer, fleet: Fleet, bus: NatsBus, prefix: str, tmp_path: Path
) -> None:
    """With the reconciler at its default interval (5 s) and the aggregator at the default
    checkpoint interval, a replica whose node reports it crash-looping is deployed on
    another node within one heartbeat interval + 2 s of that report."""
    keys = Keys(tmp_path)
    await fleet.start_aggregator(checkpoint_interval=CHECKPOINT)
    gate = tmp_path / "fail-now"
    await crashing_node(fleet, keys, failing_script(tmp_path / "broken", gate))
    await start_nodes(fleet, keys, tmp_path, "n2")
    await send(bus, prefix, keys.operator, Cordon(), node="n2")
    await wait_record(bus, prefix, "n2", lambda r: r.state == "cordoned")
    code, out, err = await finish(
        await fleetctl(nats_server, prefix, keys.operator_file, "deploy", "chat", *DEPLOY)
    )
    assert code == 0 and "replica 0: n1" in out, out + err
    await send(bus, prefix, keys.operator, Uncordon(), node="n2")
    await wait_record(bus, prefix, "n2", lambda r: r.state == "active")
    await wait_record(bus, prefix, "n1", lambda r: running(r, "chat", "starting"))
    traffic = await Traffic().start(bus, prefix)
    await fleet.start_supervisor(reconciler(bus, prefix, keys, interval=5.0))
    gate.touch()
    await ready_on(bus, prefix, "n2", "chat")
    failed = traffic.first_beat("n1", "chat", FAILED_STATES)
    [moved] = traffic.deploys("n2")
    within_a_heartbeat("the replica's deploy on n2 was sent", failed.ts, moved.issued_at)


async def test_placement_chooses_only_nodes_that_can_run_the_engine(
    nats_server: NatsServer, fleet: Fleet, bus: NatsBus, prefix: str, tmp_path: Path
) -> None:
    """Two nodes find no llama-server, two run the stand-in: a 2-replica llama.cpp deploy
    lands on the two that can run it, ready there, and --why says why the others were
    passed over."""
    keys = Keys(tmp_path)
    await fleet.start_aggregator(checkpoint_interval=CHECKPOINT)
    missing = tmp_path / "nowhere" / "llama-server"
    await start_nodes(fleet, keys, tmp_path, "n1", "n2", binary=missing)
    await start_nodes(fleet, keys, tmp_path, "n3", "n4")
    code, out, err = await finish(
        await fleetctl(
            nats_server, prefix, keys.operator_file, "deploy", "chat", *DEPLOY,
            "--replicas", "2", "--why", "--wait",
        )
    )  # fmt: skip
    assert code == 0, out + err
    workload = await placed(bus, prefix, "chat")
    assert sorted(r.node for r in workload.replicas) == ["n3", "n4"]
    for replica in workload.replicas:
        assert "n1: cannot run llamacpp" in replica.why and "n2: cannot run" in replica.why
        await ready_on(bus, prefix, replica.node, "chat")


def engine_of(agent: NodeAgent, name: str) -> Entry:
    """The agent's saved entry of workload ``name``: its engine's pid and start time."""
    [entry] = [
        e for e in WorkloadStore(Path(agent.config.state_dir)).load() if e.deploy.name == name
    ]
    return entry


@pytest.mark.parametrize("away", ["agent killed", "bus cut"])
async def test_a_node_that_returns_stops_the_copy_of_a_replica_moved_off_it(
    nats_server: NatsServer, fleet: Fleet, bus: NatsBus, prefix: str, tmp_path: Path, away: str
) -> None:
    """A node is lost with its engine running (its agent dies without a goodbye, or its
    connection is cut); past the grace the replica is placed on the other node; the
    engine still runs while the node is away. When the node comes back (a new agent
    adopting the engine, or the connection healed), the reconciler's signed Stop ends the
    engine and the node's final result reports it (the copy still ran when the node came
    back), shown by ``fleetctl describe``; the node then lists the workload no more."""
    keys = Keys(tmp_path)
    await fleet.start_aggregator(checkpoint_interval=CHECKPOINT)
    relays: dict[str, Relay] = {}
    agents = await start_nodes(fleet, keys, tmp_path, "n1", "n2", relays=relays)
    results = await Results().start(bus, prefix)
    traffic = await Traffic().start(bus, prefix)
    [replica] = (await deploy_chat(nats_server, bus, prefix, keys)).replicas
    lost = agents[replica.node]
    [spare] = {"n1", "n2"} - {replica.node}
    engine = engine_of(lost, "chat")
    await fleet.start_supervisor(reconciler(bus, prefix, keys))
    if away == "agent killed":
        await lost.stop(goodbye=False)  # no goodbye: its engine keeps running
    else:
        await relays[replica.node].sever()
    await ready_on(bus, prefix, spare, "chat")
    assert processes.alive(engine.pid, engine.started)
    if away == "agent killed":
        await fleet.start_agent(lost.config)
    else:
        await relays[replica.node].heal()
    await wait_for(lambda: not processes.alive(engine.pid, engine.started))
    [stop] = await wait_for(lambda: traffic.stops(replica.node))
    final = await results.final(stop.id)
    assert final.status == "done", final.detail
    assert "its copy still ran when the node came back" in final.detail, final.detail
    await wait_record(bus, prefix, replica.node, lambda r: not running(r, "chat", "ready"))
    code, lines, err = await plain_fleetctl(fleet, "describe", replica.node)
    said = [line for line in lines if "its copy still ran when the node came back" in line]
    assert code == 0 and said, "\n".join(lines) + err


async def test_no_hostile_record_or_node_key_stops_a_replica_its_node_runs(
    nats_server: NatsServer, fleet: Fleet, bus: NatsBus, prefix: str, tmp_path: Path
) -> None:
    """A record rewritten by a stranger to move the replica off its node (a copy left
    there to stop) gets no Stop from the reconciler; a Stop signed with the node's own key
    (a stolen node key) is rejected; a stop order published as a node event with that key
    from outside the agent is dropped: the engine still runs, ready, through three more
    reconciler rounds."""
    keys = Keys(tmp_path)
    await fleet.start_aggregator(checkpoint_interval=CHECKPOINT)
    agents = await start_nodes(fleet, keys, tmp_path, "n1", "n2")
    results = await Results().start(bus, prefix)
    traffic = await Traffic().start(bus, prefix)
    legit = await deploy_chat(nats_server, bus, prefix, keys)
    [replica] = legit.replicas
    home = replica.node
    [other] = {"n1", "n2"} - {home}
    engine = engine_of(agents[home], "chat")
    stranger = signing.KeyPair.generate()
    moved = msgspec.structs.replace(
        legit,
        created_by=stranger.public_key,
        replicas=[msgspec.structs.replace(replica, node=other)],
        leftovers=[
            Leftover(node=home, cluster="c1", index=0, since=1.0, stop_by=1.0, node_lost=True)
        ],
    )
    body = spec_body(moved)
    hostile = msgspec.structs.replace(
        moved, spec=body.decode(), spec_sig=stranger.headers(body)[signing.HEADER_SIG]
    )
    bucket = await bus.kv(Subjects(prefix).bucket_name(BUCKET_WORKLOADS))
    await bucket.put("chat", codec.encode(hostile))
    actor = reconciler(bus, prefix, keys)
    await fleet.start_supervisor(actor)
    stolen = fleet.node_key(home)
    forged = await send(bus, prefix, stolen, Stop(name="chat"), node=home)
    rejected = await wait_for(
        lambda: [r for r in results.results if r.claimed_id == forged.id and r.status == "rejected"]
    )
    assert rejected[0].signer == stolen.public_key, rejected
    order = WorkloadOrder(ts=time.time(), command_id="forged", action=Stop(name="chat"))
    subject = Subjects(prefix).event(home, EVENT_WORKLOAD_ORDER)
    await publish_signed_event(bus, subject, order, stolen)
    await bus.flush()
    await wait_for(lambda: dropped(fleet.agents[home], "no_session") >= 1)
    mark = actor.rounds
    await wait_for(lambda: actor.rounds >= mark + 3)
    assert traffic.stops(home) == [forged]
    assert processes.alive(engine.pid, engine.started)
    record = await wait_record(bus, prefix, home, lambda r: r.heartbeat is not None)
    assert running(record, "chat", "ready")
    assert (await placed(bus, prefix, "chat")) == hostile
