"""A stolen node key against deploy/nats/auth.conf and against what `fleetctl nats-config`
generates, tried as an attacker would.

A real nats-server runs the repo's auth.conf with three nodes (node-1 to node-3, cluster
gpu-a) and the provider's key. The attacker is node-1 on a plain nats-py connection, not
the project's helpers; the provider's connection checks afterwards that nothing changed.
Honest agents run beside it where a test needs them: every subject they use still works.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import nats
import nats.errors
import nats.js.errors
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.kv import KeyValue

from actors.fleet.registry import approve, revoke
from actors.fleet.streams import provision
from actors.node.config import AgentConfig
from actors.runtime.bus import NatsBus
from actors.runtime.embedded import NatsServer
from schemas import codec, signing
from schemas.events import Latency
from schemas.messages import Probe, ProbeReply
from schemas.subjects import (
    BUCKET_NODES,
    BUCKET_TRUST,
    STREAM_ALERTS,
    STREAM_COMMANDS,
    STREAM_HEARTBEATS,
    Subjects,
)
from tests.support.deploy import (
    AUTH_CLUSTER,
    AUTH_JS_API_PREFIX,
    fleet_auth,
    free_port,
    render_auth,
)
from tests.support.fleet import TEST_LIMITS, Fleet, agent_config, wait_for, wait_record

PREFIX = "fleet"
"""auth.conf's permissions name the default prefix."""
SUBJECTS = Subjects(PREFIX)
NODES = ["node-1", "node-2", "node-3"]
ATTACKER, VICTIM = NODES[0], NODES[1]
NODE_AGENT = str(Path(sys.executable).parent / "node-agent")
SETTLE = 0.5
"""How long a refused (or relayed) message gets to land before its effect is checked."""


@dataclass
class AuthServer:
    server: NatsServer
    keys: dict[str, signing.KeyPair]
    fleet: Fleet

    @property
    def admin(self) -> NatsBus:
        return self.fleet.bus

    def config(self, node: str, **settings: object) -> AgentConfig:
        """An honest agent of ``node`` as auth.conf asks it to run, key already in place."""
        config = agent_config(
            self.server.url,
            PREFIX,
            self.fleet.state_dir,
            node,
            cluster=AUTH_CLUSTER,
            nkey_auth=True,
            js_api_prefix=AUTH_JS_API_PREFIX,
            **settings,
        )
        config.key_path.parent.mkdir(parents=True, exist_ok=True)
        config.key_path.write_text(self.keys[node].seed)
        config.key_path.chmod(0o600)
        return config


def generated(
    directory: Path, store: Path, aggregator: str, nodes: dict[str, tuple[str, str]]
) -> Path:
    """A server on loopback that includes what ``fleetctl nats-config`` generates."""
    fleet_auth(directory, nodes, aggregator)
    config = directory / "server.conf"
    config.write_text(
        f"listen: 127.0.0.1:{free_port()}\n"
        f"jetstream {{ store_dir: {json.dumps(str(store))} }}\n"
        "include fleet-auth.conf\n"
    )
    return config


@pytest.fixture(params=["auth.conf", "generated"])
async def auth(
    tmp_path: Path, state_dir: Path, request: pytest.FixtureRequest
) -> AsyncIterator[AuthServer]:
    """Three nodes and the provider, streams and buckets provisioned, under the hand-written
    auth.conf and under ``fleetctl nats-config``'s output: both must hold."""
    keys = {node: signing.KeyPair.generate() for node in [*NODES, "aggregator"]}
    nodes = {node: (AUTH_CLUSTER, keys[node].public_key) for node in NODES}
    aggregator = keys["aggregator"].public_key
    if request.param == "generated":
        config = generated(tmp_path / "generated", tmp_path / "js", aggregator, nodes)
    else:
        config = render_auth(
            tmp_path / "auth.conf", free_port(), tmp_path / "js", aggregator, nodes
        )
    server = NatsServer(tmp_path / "server", name="auth", config_file=config).start()
    try:
        async with AsyncExitStack() as stack:
            admin = await NatsBus.connect(server.url, "admin", nkey_seed=keys["aggregator"].seed)
            stack.push_async_callback(admin.close)
            await provision(admin.js, SUBJECTS)
            fleet = Fleet(server.url, admin, PREFIX, state_dir, stack)
            yield AuthServer(server, keys, fleet)
    finally:
        server.stop()


@dataclass
class Attacker:
    """A plain nats-py client logged in with a node's key; the server's refusals land in
    ``errors``."""

    nc: Client
    errors: list[Exception] = field(default_factory=list)

    def refused(self, subject: str) -> bool:
        # nats-py reports the server's -ERR in lower case.
        wanted = f'permissions violation for publish to "{subject.lower()}"'
        return any(wanted in str(e) for e in self.errors)


@pytest.fixture
async def attacker(auth: AuthServer) -> AsyncIterator[Attacker]:
    errors: list[Exception] = []

    async def on_error(exc: Exception) -> None:
        errors.append(exc)

    nc = await nats.connect(
        auth.server.url,
        nkeys_seed_str=auth.keys[ATTACKER].seed,
        inbox_prefix=f"_INBOX.{ATTACKER}",
        error_cb=on_error,
        allow_reconnect=False,
    )
    yield Attacker(nc, errors)
    await nc.close()


@dataclass
class Snapshot:
    """What the attacks aim at, as the provider sees it."""

    trust: dict[str, bytes]
    nodes: dict[str, bytes]
    messages: dict[str, int]
    consumers: dict[str, list[str]]


async def snapshot(admin: NatsBus) -> Snapshot:
    trust = await admin.kv(SUBJECTS.bucket_name(BUCKET_TRUST))
    nodes = await admin.kv(SUBJECTS.bucket_name(BUCKET_NODES))
    streams = [SUBJECTS.stream_name(s) for s in (STREAM_HEARTBEATS, STREAM_COMMANDS, STREAM_ALERTS)]
    streams += [f"KV_{SUBJECTS.bucket_name(b)}" for b in (BUCKET_TRUST, BUCKET_NODES)]
    messages = {s: (await admin.js.stream_info(s)).state.messages for s in streams}
    consumers = {s: sorted(c.name for c in await admin.js.consumers_info(s)) for s in streams}

    async def values(bucket: KeyValue) -> dict[str, bytes]:
        found = {}
        for key in NODES:
            try:
                found[key] = (await bucket.get(key)).value or b""
            except nats.js.errors.KeyNotFoundError:
                pass
        return found

    return Snapshot(await values(trust), await values(nodes), messages, consumers)


async def provider_state(auth: AuthServer) -> Snapshot:
    """Every node approved, an alert stored, a command queued for node-2 with its durable
    consumer in place: what a compromised node would like to rewrite, read or delete."""
    admin = auth.admin
    for node in NODES:
        await approve(admin, SUBJECTS, node, auth.keys[node].public_key)
    await admin.js.publish(SUBJECTS.alert("stale", AUTH_CLUSTER, "node-3"), b"{}")
    await admin.js.publish(SUBJECTS.command(AUTH_CLUSTER, VICTIM), b"{}")
    await admin.js.add_consumer(
        SUBJECTS.stream_name(STREAM_COMMANDS),
        durable_name=f"cmd_{AUTH_CLUSTER}_{VICTIM}",
        filter_subject=SUBJECTS.command(AUTH_CLUSTER, VICTIM),
    )
    return await snapshot(admin)


TARGETS = [
    # Another node's trust entry (then beat as that node), and its record.
    f"$KV.fleet_trust.{VICTIM}",
    f"$KV.fleet_nodes.{VICTIM}",
    # Forged alerts; a purged alert stream.
    f"fleet.alert.offline.{AUTH_CLUSTER}.{VICTIM}",
    "$JS.API.STREAM.PURGE.FLEET_ALERTS",
    f"{AUTH_JS_API_PREFIX}.STREAM.PURGE.FLEET_ALERTS",
    # The aggregator's durable and another node's command consumer, deleted.
    "$JS.API.CONSUMER.DELETE.FLEET_HB.aggregator-0",
    f"$JS.API.CONSUMER.DELETE.FLEET_CMD.cmd_{AUTH_CLUSTER}_{VICTIM}",
    f"{AUTH_JS_API_PREFIX}.CONSUMER.DELETE.FLEET_CMD.cmd_{AUTH_CLUSTER}_{VICTIM}",
    # Another node's signed commands, read through a consumer of the attacker's own.
    f"$JS.API.CONSUMER.CREATE.FLEET_CMD.steal.fleet.cmd.{AUTH_CLUSTER}.{VICTIM}",
    f"{AUTH_JS_API_PREFIX}.CONSUMER.CREATE.FLEET_CMD.steal.fleet.cmd.{AUTH_CLUSTER}.{VICTIM}",
]
"""Where a node must never get a message in: each is a takeover reproduced on the
allow_responses permissions."""


def create_request(durable: str, subject: str) -> bytes:
    config = {"durable_name": durable, "filter_subject": subject, "ack_policy": "explicit"}
    return msgspec.json.encode({"stream_name": "FLEET_CMD", "config": config})


async def test_no_subject_outside_its_own_directly_or_relayed(
    auth: AuthServer, attacker: Attacker
) -> None:
    """Each target, published to directly, as the reply to a message the node sent itself
    (allow_responses granted that), as the reply of its own JetStream heartbeat (the server
    acknowledges there), and as the reply of a registration (the aggregator answers there):
    refused or without effect, every one."""
    await auth.fleet.start_aggregator()
    # The aggregator's partition consumers (aggregator-<P>) are in place before the attack.
    wanted = {f"aggregator-{p}" for p in range(TEST_LIMITS.partitions)}

    async def consumers_in_place() -> bool:
        consumers = (await snapshot(auth.admin)).consumers
        return wanted <= set(consumers[SUBJECTS.stream_name(STREAM_HEARTBEATS)])

    await wait_for(consumers_in_place)
    before = await provider_state(auth)
    assert wanted <= set(before.consumers[SUBJECTS.stream_name(STREAM_HEARTBEATS)])
    nc = attacker.nc
    own_event = SUBJECTS.event(ATTACKER, "relay")
    answered: list[str] = []

    async def answer(msg: Msg) -> None:
        answered.append(msg.reply)
        await msg.respond(create_request("steal", SUBJECTS.command(AUTH_CLUSTER, VICTIM)))

    await nc.subscribe(own_event, cb=answer)
    heartbeat = SUBJECTS.heartbeat(AUTH_CLUSTER, ATTACKER)
    for target in TARGETS:
        await nc.publish(target, create_request("steal", SUBJECTS.command(AUTH_CLUSTER, VICTIM)))
        await nc.publish(own_event, b"{}", reply=target)
        await nc.publish(heartbeat, b"{}", reply=target)
        await nc.publish(SUBJECTS.register(), b"{}", reply=target)
    await nc.flush()
    await wait_for(lambda: len(answered) == len(TARGETS))
    await asyncio.sleep(SETTLE)

    for target in TARGETS:
        assert attacker.refused(target), target
    after = await snapshot(auth.admin)
    assert after.trust == before.trust
    assert VICTIM not in after.nodes
    assert after.consumers == before.consumers
    # node-2's command is still queued; the alert stream was not purged (the aggregator
    # may add alerts about the attacker's junk) and holds nothing about node-2.
    commands, alerts = (SUBJECTS.stream_name(s) for s in (STREAM_COMMANDS, STREAM_ALERTS))
    assert after.messages[commands] == before.messages[commands]
    assert (await auth.admin.js.stream_info(alerts)).state.first_seq == 1
    assert after.messages[alerts] >= before.messages[alerts]
    with pytest.raises(nats.js.errors.NotFoundError):
        await auth.admin.js.get_last_msg(alerts, f"fleet.alert.*.{AUTH_CLUSTER}.{VICTIM}")


async def test_no_consumers_but_its_own(auth: AuthServer, attacker: Attacker) -> None:
    """Consumer creation on fleet_nodes, again and again (the listing grant let a node
    exhaust the server's consumers), and on another node's commands under any name or
    prefix: refused, no consumer appears; the node's own durable is the one it may create."""
    before = await provider_state(auth)
    nc = attacker.nc
    inbox = nc.new_inbox()
    await nc.subscribe(inbox)
    ephemeral = msgspec.json.encode({"stream_name": "KV_fleet_nodes", "config": {}})
    for api in ("$JS.API", AUTH_JS_API_PREFIX):
        for _ in range(500):
            await nc.publish(f"{api}.CONSUMER.CREATE.KV_fleet_nodes", ephemeral, reply=inbox)
        context = nc.jetstream(prefix=api)
        with pytest.raises((nats.errors.Error, TimeoutError)):
            await context.add_consumer(
                "FLEET_CMD",
                name=f"cmd_{AUTH_CLUSTER}_{VICTIM}",
                durable_name=f"cmd_{AUTH_CLUSTER}_{VICTIM}",
                filter_subject=SUBJECTS.command(AUTH_CLUSTER, VICTIM),
                timeout=0.5,
            )
        # A pull from another node's durable: refused, its command stays queued.
        stolen = await context.pull_subscribe_bind(
            durable=f"cmd_{AUTH_CLUSTER}_{VICTIM}", stream="FLEET_CMD"
        )
        with pytest.raises((nats.errors.Error, TimeoutError)):
            await stolen.fetch(1, timeout=0.5)
        assert attacker.refused(f"{api}.CONSUMER.CREATE.KV_fleet_nodes")
        assert attacker.refused(f"{api}.CONSUMER.MSG.NEXT.FLEET_CMD.cmd_{AUTH_CLUSTER}_{VICTIM}")
    await asyncio.sleep(SETTLE)
    assert await snapshot(auth.admin) == before

    # Its own durable is the one consumer it may create, and pointing that one's
    # deliveries at another node's trust entry writes nothing there (streams do not take
    # in consumer deliveries).
    own = f"cmd_{AUTH_CLUSTER}_{ATTACKER}"
    info = await nc.jetstream(prefix=AUTH_JS_API_PREFIX).add_consumer(
        "FLEET_CMD",
        name=own,
        durable_name=own,
        filter_subject=SUBJECTS.command(AUTH_CLUSTER, ATTACKER),
        deliver_subject=f"$KV.fleet_trust.{VICTIM}",
    )
    assert info.name == own
    await auth.admin.js.publish(SUBJECTS.command(AUTH_CLUSTER, ATTACKER), b"{}")
    await asyncio.sleep(SETTLE)
    assert (await snapshot(auth.admin)).trust == before.trust


async def test_honest_prober_answers_only_inboxes(auth: AuthServer, attacker: Attacker) -> None:
    """A probe to node-2 whose reply names a subject node-2 may publish on (one of its own
    event subjects) gets no answer there; the same probe with an inbox reply is answered."""
    await auth.fleet.start_aggregator()
    await auth.fleet.start_agent(auth.config(VICTIM, probe_interval=60.0))
    await wait_record(auth.admin, PREFIX, VICTIM, lambda r: r.state == "active", timeout=20)
    relayed: list[bytes] = []
    target = SUBJECTS.event(VICTIM, "interruption")

    async def heard(msg: Msg) -> None:
        relayed.append(msg.data)

    await auth.admin.subscribe(target, heard)
    await auth.admin.flush()
    probe = codec.encode(Probe(from_node=ATTACKER, nonce="relay", sent_at=time.time()))
    await attacker.nc.publish(SUBJECTS.probe(VICTIM), probe, reply=target)
    reply = await attacker.nc.request(SUBJECTS.probe(VICTIM), probe, timeout=5)
    assert codec.decode(reply.data, ProbeReply, reply.subject).nonce == "relay"
    await asyncio.sleep(SETTLE)
    assert relayed == []


async def test_peers_discover_each_other_without_consumers(auth: AuthServer) -> None:
    """Three honest agents under auth.conf find each other as peers and measure round
    trips to both others; discovery leaves no consumer on fleet_nodes, and no agent ever
    hits a permission violation (heartbeats, events, command consumer, probes, reads)."""
    await auth.fleet.start_aggregator()
    peers: dict[str, set[str]] = {node: set() for node in NODES}

    async def on_latency(msg: Msg) -> None:
        node = msg.subject.split(".")[2]
        latency = codec.decode(msg.data, Latency, msg.subject)
        peers[node] = {p.target_node_id for p in latency.peers if p.rtt_us is not None}

    await auth.admin.subscribe("fleet.evt.*.latency", on_latency)
    for node in NODES:
        await auth.fleet.start_agent(auth.config(node, probe_interval=0.3))
    for node in NODES:
        await wait_record(auth.admin, PREFIX, node, lambda r: r.state == "active", timeout=20)
    await wait_for(lambda: all(peers[node] == set(NODES) - {node} for node in NODES), timeout=20)
    nodes_stream = await auth.admin.js.stream_info(f"KV_{SUBJECTS.bucket_name(BUCKET_NODES)}")
    assert nodes_stream.state.consumer_count == 0
    assert "Violation" not in auth.server.log_file.read_text()


async def test_register_under_auth(auth: AuthServer) -> None:
    """``node-agent register`` logs in with the node key under its own inbox prefix and
    gets the aggregator's answer."""
    await auth.fleet.start_aggregator()
    config = auth.config("node-3")
    process = await asyncio.create_subprocess_exec(
        NODE_AGENT,
        "register",
        "--server",
        auth.server.url,
        "--node-id",
        "node-3",
        "--cluster",
        AUTH_CLUSTER,
        "--state-dir",
        config.state_dir,
        "--nkey-auth",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode == 0, err.decode()
    assert out.decode().startswith("node-3: pending")
    assert "Violation" not in auth.server.log_file.read_text()


async def test_a_refused_node_reads_its_own_record_under_auth(auth: AuthServer) -> None:
    """Issue 9: an agent whose key is revoked learns the refusal from its own record,
    read with the one direct get a node may make; no permission violation."""
    await auth.fleet.start_aggregator(sweep_interval=0.2, refused_note_every=0.5)
    agent = await auth.fleet.start_agent(auth.config("node-1"))
    await wait_record(auth.admin, PREFIX, "node-1", lambda r: r.state == "active", timeout=20)
    await revoke(auth.admin, SUBJECTS, "node-1")
    await wait_for(lambda: agent.standing is not None and agent.standing.refused, timeout=20)
    assert agent.standing is not None and agent.standing.refused == "unknown_node"
    assert "Violation" not in auth.server.log_file.read_text()
