"""Issue 30 item 2: a stolen node key writes into no other node's inbox.

Under the shipped accounts (auth.conf and ``fleetctl nats-config``'s output) node-1's key,
on a plain nats-py connection, tries every inbox of an honest node-2 it could name: the
ones node-2's connection really subscribes (JetStream acknowledgements, command
deliveries, registration and discovery answers), the probe inboxes of node-2's probes to
others, and the probe inbox node-2 hands it with each probe, where it sends everything
but the right answer. Each is refused or ignored: node-2 stays active with no alert,
measures its honest peer and counts the attacker as lost, and a command to node-2 and its
result still flow. An honest prober answers at most its rate per asker.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import msgspec
import nats.errors
import nats.js.errors
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from actors.node.events import NodeEvents
from actors.node.latency import ANSWERS_PER_ASKER, ANSWERS_PER_SECOND, LatencyActor
from actors.node.metrics import AgentMetrics
from actors.runtime.bus import NatsBus
from schemas import codec, signing
from schemas.events import Latency
from schemas.messages import Cordon, Probe, ProbeReply
from schemas.subjects import STREAM_ALERTS, probe_reply
from tests.security.attack import restarts
from tests.security.auth_fleet import ATTACKER, PREFIX, SUBJECTS, VICTIM, Attacker, AuthServer
from tests.support.commanding import Results, send
from tests.support.deploy import AUTH_CLUSTER, AUTH_JS_API_PREFIX
from tests.support.fleet import agent_config, wait_for, wait_record

HONEST = "node-3"
FALSE_ALERTS = ("stale", "offline", "recovered", "bad_signature", "sequence_gap", "replay")
"""What inbox injection once raised about a live node."""


def reply_body(node: str, nonce: str) -> bytes:
    return codec.encode(ProbeReply(node_id=node, nonce=nonce, sent_at=0.0, replied_at=0.0))


def inboxes_of(nc: Client) -> list[str]:
    """Every inbox subject a connection listens on, wildcards filled in (what an attacker
    who guessed or was shown them would publish to)."""
    return sorted(
        {
            sub.subject.replace("*", "x").replace(">", "x")
            for sub in nc._subs.values()
            if sub.subject.startswith("_INBOX.")
        }
    )


@pytest.mark.slow
async def test_no_write_into_another_nodes_inbox(auth: AuthServer, attacker: Attacker) -> None:
    """node-1 publishes into each of node-2's live inboxes and into node-2's probe inboxes
    for node-3: every one refused by the server. Into the probe inbox of each probe node-2
    sends it, it sends a wrong nonce, another node's name, junk, and aims FLEET's answers
    to its own requests there (registration, direct get, heartbeat acknowledgement): node-2
    counts node-1 as lost all along while measuring node-3, restarts no actor, is refused
    no heartbeat, and runs an operator's cordon with a ``done`` result."""
    operator = signing.KeyPair.generate()
    results = await Results().start(auth.admin, PREFIX)
    await auth.fleet.start_aggregator()
    latencies: list[Latency] = []

    async def on_latency(msg: Msg) -> None:
        latencies.append(codec.decode(msg.data, Latency, msg.subject))

    await auth.admin.subscribe(SUBJECTS.event(VICTIM, "latency"), on_latency)
    victim = await auth.fleet.start_agent(
        auth.config(
            VICTIM,
            probe_interval=0.3,
            peers=[ATTACKER, HONEST],
            trust_operators=[operator.public_key],
        )
    )
    await auth.fleet.start_agent(auth.config(HONEST, probe_interval=60.0))
    for node in (VICTIM, HONEST):
        await wait_record(auth.admin, PREFIX, node, lambda r: r.state == "active")
    assert victim.bus is not None
    nc = attacker.nc

    # The inboxes node-2 really listens on (its command consumer bound: a command ran),
    # but those of its probes to node-1, and a probe inbox of its probes to node-3.
    first = await send(auth.admin, PREFIX, operator, Cordon(), node=VICTIM, cluster=AUTH_CLUSTER)
    assert (await results.final(first.id)).status == "done"
    answerable = f"_INBOX.{VICTIM}.probe.{ATTACKER}."
    targets = [inbox for inbox in inboxes_of(victim.bus.nc) if not inbox.startswith(answerable)] + [
        probe_reply(VICTIM, HONEST, "0" * 32)
    ]
    assert len(targets) >= 3, targets
    for target in targets:
        await nc.publish(target, reply_body(HONEST, "x"))
    await nc.flush()
    await wait_for(lambda: all(attacker.refused(target) for target in targets))

    # node-2's probes to node-1: every answer but the right one, for a few rounds.
    handed: list[str] = []
    nested = b"[" * 5000 + b"]" * 5000
    junk = [
        reply_body(ATTACKER, "wrong-nonce"),
        b"not json",
        b'{"node_id": "node-1", "nonce": "n", "sent_at": 0, "replied_at": 0, "z": ' + nested + b"}",
    ]
    direct_get = f"{AUTH_JS_API_PREFIX}.DIRECT.GET.KV_fleet_nodes"

    async def on_probe(msg: Msg) -> None:
        handed.append(msg.reply)
        probe = codec.decode(msg.data, Probe, msg.subject)
        for body in junk:
            await nc.publish(msg.reply, body)
        await nc.publish(msg.reply, reply_body(HONEST, probe.nonce))
        await nc.publish(SUBJECTS.register(), b"{}", reply=msg.reply)
        await nc.publish(direct_get, msgspec.json.encode({"seq": 1}), reply=msg.reply)
        await nc.publish(SUBJECTS.heartbeat(AUTH_CLUSTER, ATTACKER), b"{}", reply=msg.reply)

    await nc.subscribe(SUBJECTS.probe(ATTACKER), cb=on_probe)
    await nc.flush()

    def measures_honest() -> bool:
        return any(
            peer.target_node_id == HONEST and peer.rtt_us is not None
            for latency in latencies
            for peer in latency.peers
        )

    # node-3 started after node-2 began probing: its first probes may have found none.
    await wait_for(measures_honest)
    latencies.clear()
    cordon = await send(
        auth.admin, PREFIX, operator, Cordon(ttl=600), node=VICTIM, cluster=AUTH_CLUSTER
    )
    assert (await results.final(cordon.id)).status == "done"
    await wait_for(lambda: len(handed) >= 5 and len(latencies) >= 5)

    assert all(reply.startswith(f"_INBOX.{VICTIM}.probe.{ATTACKER}.") for reply in handed)
    # node-1 never answered rightly, before the attack (nobody listened) nor during it.
    for latency in latencies:
        by_peer = {peer.target_node_id: peer for peer in latency.peers}
        assert by_peer[ATTACKER].rtt_us is None
        assert by_peer[ATTACKER].loss_pct == 100.0
        assert by_peer[HONEST].rtt_us is not None
    assert victim.supervisor is not None
    assert set(restarts(victim.supervisor).values()) == {0}
    record = await wait_record(auth.admin, PREFIX, VICTIM, lambda r: r.state == "cordoned")
    assert record.stale_since is None
    # (A health alert may come: node-1, a configured peer, never answers.)
    alerts = SUBJECTS.stream_name(STREAM_ALERTS)
    for kind in FALSE_ALERTS:
        with pytest.raises(nats.js.errors.NotFoundError):
            await auth.admin.js.get_last_msg(alerts, SUBJECTS.alert(kind, AUTH_CLUSTER, VICTIM))


async def test_answers_per_asker_are_rate_limited(auth: AuthServer, attacker: Attacker) -> None:
    """node-1 asks node-2 2,000 probes at once on its own probe inbox: node-2 answers at
    most ANSWERS_PER_ASKER of them a second, not a reflector."""
    await auth.fleet.start_aggregator()
    await auth.fleet.start_agent(auth.config(VICTIM, probe_interval=60.0))
    await wait_record(auth.admin, PREFIX, VICTIM, lambda r: r.state == "active")
    nc = attacker.nc
    answers: list[float] = []

    async def answered(msg: Msg) -> None:
        answers.append(time.monotonic())

    inbox = await nc.subscribe(probe_reply(ATTACKER, VICTIM, "flood"), cb=answered)
    probe = codec.encode(Probe(from_node=ATTACKER, nonce="flood", sent_at=time.time()))
    start = time.monotonic()
    for _ in range(2000):
        await nc.publish(SUBJECTS.probe(VICTIM), probe, reply=inbox.subject)
    await nc.flush()
    await wait_for(lambda: len(answers) >= ANSWERS_PER_ASKER)
    await asyncio.sleep(1.0)
    elapsed = time.monotonic() - start
    # Fixed one-second windows: at most one window's worth per second begun, plus one.
    assert ANSWERS_PER_ASKER <= len(answers) <= ANSWERS_PER_ASKER * (int(elapsed) + 2)


class _Probe:
    """A received probe as the prober's answer handler sees it: subject, reply, body."""

    def __init__(self, reply: str, data: bytes) -> None:
        self.subject = SUBJECTS.probe(VICTIM)
        self.reply = reply
        self.data = data
        self.answers = 0

    async def respond(self, data: bytes) -> None:
        self.answers += 1


async def test_answers_in_all_are_rate_limited(bus: NatsBus, tmp_path: Path) -> None:
    """Probes claiming 5,000 different askers within a second get at most
    ANSWERS_PER_SECOND answers in all (asker names cost an attacker nothing)."""
    config = agent_config("", PREFIX, tmp_path, VICTIM)
    events = NodeEvents(config, signing.KeyPair.generate(), AgentMetrics())
    prober = LatencyActor(config, bus, events)
    body = codec.encode(Probe(from_node=ATTACKER, nonce="n", sent_at=time.time()))
    probes = [_Probe(probe_reply(f"asker-{n}", VICTIM, "t"), body) for n in range(5000)]
    for probe in probes:
        await prober._answer(probe)  # type: ignore[arg-type]
    assert sum(probe.answers for probe in probes) <= ANSWERS_PER_SECOND * 2
    assert sum(probe.answers for probe in probes) >= ANSWERS_PER_SECOND
