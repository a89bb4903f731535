"""A stolen node key against deploy/nats/auth.conf and against what `fleetctl nats-config`
generates, tried as an attacker would.

A real nats-server runs the repo's auth.conf with three nodes (node-1 to node-3, cluster
gpu-a) and the provider's key. The attacker is node-1 on a plain nats-py connection, not
the project's helpers; the provider's connection checks afterwards that nothing changed.
Honest agents run beside it where a test needs them: every subject they use still works.
"""

from __future__ import annotations

import asyncio
import time

import msgspec
import nats
import nats.errors
import nats.js.errors
import pytest
from nats.aio.msg import Msg

from actors.fleet.aggregator import command_queues
from actors.fleet.storage.registry import revoke
from schemas import codec
from schemas.events import Latency
from schemas.messages import Probe, ProbeReply
from schemas.subjects import (
    BUCKET_NODES,
    COMMAND_ACK_WAIT,
    COMMAND_MAX_DELIVER,
    STREAM_ALERTS,
    STREAM_COMMANDS,
    STREAM_HEARTBEATS,
    command_consumer,
    probe_reply,
)
from tests.security.auth_fleet import (
    ATTACKER,
    NODE_AGENT,
    NODES,
    PREFIX,
    SETTLE,
    SUBJECTS,
    VICTIM,
    Attacker,
    AuthServer,
    provider_state,
    snapshot,
)
from tests.support.deploy import AUTH_CLUSTER, AUTH_JS_API_PREFIX
from tests.support.fleet import TEST_LIMITS, wait_for, wait_record

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
    prefix: refused, no consumer appears."""
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


async def test_own_command_consumer_cannot_be_recreated(
    auth: AuthServer, attacker: Attacker
) -> None:
    """Issue 30 item 3: node-1 re-creating its own command consumer as a push consumer
    delivering into fleet.register (one command became ~390 registrations a second) is
    refused under every consumer-create subject of both API prefixes; the provider's
    consumer keeps its pinned pull configuration and a command reaches no registration
    listener."""
    own = command_consumer(AUTH_CLUSTER, ATTACKER)
    own_commands = SUBJECTS.command(AUTH_CLUSTER, ATTACKER)
    assert (
        await command_queues.ensure(
            auth.admin, SUBJECTS, {ATTACKER: AUTH_CLUSTER}, check_configs=False
        )
        == 1
    )
    registrations: list[bytes] = []

    async def registered(msg: Msg) -> None:
        registrations.append(msg.data)

    await auth.admin.subscribe(SUBJECTS.register(), registered)
    await auth.admin.flush()
    push = msgspec.json.encode(
        {
            "stream_name": "FLEET_CMD",
            "config": {
                "name": own,
                "durable_name": own,
                "filter_subject": own_commands,
                "deliver_subject": SUBJECTS.register(),
                "ack_policy": "none",
                "max_deliver": -1,
            },
        }
    )
    nc = attacker.nc
    inbox = nc.new_inbox()
    await nc.subscribe(inbox)
    subjects = [
        subject
        for api in ("$JS.API", AUTH_JS_API_PREFIX)
        for subject in (
            f"{api}.CONSUMER.CREATE.FLEET_CMD.{own}.{own_commands}",
            f"{api}.CONSUMER.CREATE.FLEET_CMD.{own}",
            f"{api}.CONSUMER.DURABLE.CREATE.FLEET_CMD.{own}",
            f"{api}.CONSUMER.CREATE.FLEET_CMD",
        )
    ]
    for subject in subjects:
        await nc.publish(subject, push, reply=inbox)
    await nc.flush()
    await wait_for(lambda: all(attacker.refused(subject) for subject in subjects))
    await auth.admin.js.publish(own_commands, b"{}")
    await asyncio.sleep(SETTLE)
    assert registrations == []
    info = await auth.admin.js.consumer_info("FLEET_CMD", own)
    assert info.config.deliver_subject is None
    assert info.config.max_deliver == COMMAND_MAX_DELIVER
    assert info.config.ack_wait == COMMAND_ACK_WAIT
    assert info.num_pending == 1  # the command waits for node-1 to pull it


async def test_provider_replaces_a_consumer_configured_otherwise(auth: AuthServer) -> None:
    """A command consumer left configured otherwise (a push consumer into fleet.register
    made before the provider created them, or by hand) is deleted and created again with
    the pinned configuration when configurations are checked (an aggregator's first
    round); one already right is left alone; a deleted one is put back from the names."""
    own = command_consumer(AUTH_CLUSTER, VICTIM)
    await auth.admin.js.add_consumer(
        "FLEET_CMD",
        name=own,
        durable_name=own,
        filter_subject=SUBJECTS.command(AUTH_CLUSTER, VICTIM),
        deliver_subject=SUBJECTS.register(),
    )
    nodes = {VICTIM: AUTH_CLUSTER}
    assert await command_queues.ensure(auth.admin, SUBJECTS, nodes, check_configs=False) == 0
    assert await command_queues.ensure(auth.admin, SUBJECTS, nodes, check_configs=True) == 1
    info = await auth.admin.js.consumer_info("FLEET_CMD", own)
    assert info.config.deliver_subject is None
    assert (
        info.config.max_waiting == command_queues.wanted(SUBJECTS, AUTH_CLUSTER, VICTIM).max_waiting
    )
    assert await command_queues.ensure(auth.admin, SUBJECTS, nodes, check_configs=True) == 0
    await auth.admin.js.delete_consumer("FLEET_CMD", own)
    assert await command_queues.ensure(auth.admin, SUBJECTS, nodes, check_configs=False) == 1


async def test_honest_prober_answers_only_inboxes(auth: AuthServer, attacker: Attacker) -> None:
    """A probe to node-2 whose reply names a subject node-2 may publish on (one of its own
    event subjects), or another responder's probe inbox, gets no answer there; the same
    probe with a probe inbox in node-2's name is answered."""
    await auth.fleet.start_aggregator()
    await auth.fleet.start_agent(auth.config(VICTIM, probe_interval=60.0))
    await wait_record(auth.admin, PREFIX, VICTIM, lambda r: r.state == "active")
    relayed: list[bytes] = []
    target = SUBJECTS.event(VICTIM, "interruption")

    async def heard(msg: Msg) -> None:
        relayed.append(msg.data)

    await auth.admin.subscribe(target, heard)
    await auth.admin.flush()
    probe = codec.encode(Probe(from_node=ATTACKER, nonce="relay", sent_at=time.time()))
    elsewhere = await attacker.nc.subscribe(probe_reply(ATTACKER, "node-3", "relay"))
    answered = await attacker.nc.subscribe(probe_reply(ATTACKER, VICTIM, "relay"))
    await attacker.nc.publish(SUBJECTS.probe(VICTIM), probe, reply=target)
    await attacker.nc.publish(SUBJECTS.probe(VICTIM), probe, reply=elsewhere.subject)
    await attacker.nc.publish(SUBJECTS.probe(VICTIM), probe, reply=answered.subject)
    reply = await answered.next_msg(timeout=5)
    assert codec.decode(reply.data, ProbeReply, reply.subject).nonce == "relay"
    await asyncio.sleep(SETTLE)
    assert relayed == []
    with pytest.raises(nats.errors.TimeoutError):
        await elsewhere.next_msg(timeout=0.1)


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
        await wait_record(auth.admin, PREFIX, node, lambda r: r.state == "active")
    await wait_for(lambda: all(peers[node] == set(NODES) - {node} for node in NODES))
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
    """Issue 9: an agent whose key is revoked learns the refusal (`revoked`, issue 33) from
    its own record, read with the one direct get a node may make; no permission violation
    (the aggregator's delete of each refused heartbeat included)."""
    await auth.fleet.start_aggregator(sweep_interval=0.2, refused_note_every=0.5)
    agent = await auth.fleet.start_agent(auth.config("node-1"))
    await wait_record(auth.admin, PREFIX, "node-1", lambda r: r.state == "active")
    await revoke(auth.admin, SUBJECTS, "node-1")
    await wait_for(lambda: agent.standing is not None and agent.standing.refused)
    assert agent.standing is not None and agent.standing.refused == "revoked"
    assert "Violation" not in auth.server.log_file.read_text()
