"""Issue 30's "done when", together: with node-1's key on a plain nats-py connection under
the shipped accounts, every attack at once (deeply nested signed heartbeats, a rollup
purge, writes into other nodes' inboxes, its command consumer re-created as a push
consumer into fleet.register, a claim to stay alive forever) while the fleet goes on: a
node that dies is still found stale within its stale_after and the sweep, the honest
node stays active, and no actor of the aggregator or the honest agent restarts."""

from __future__ import annotations

import asyncio
import contextlib
import time

import msgspec

from schemas.messages import Heartbeat
from schemas.subjects import STREAM_ALERTS, command_consumer
from tests.security.attack import restarts
from tests.security.auth_fleet import ATTACKER, NODES, PREFIX, SUBJECTS, Attacker, AuthServer
from tests.support.deploy import AUTH_CLUSTER, AUTH_JS_API_PREFIX
from tests.support.fleet import TEST_BUDGETS, wait_for, wait_record

HONEST, DYING = NODES[1], NODES[2]
NESTED = b"[" * 5000 + b"]" * 5000


def signed_beat(auth: AuthServer, seq: int, **extra: object) -> tuple[bytes, dict[str, str]]:
    """A heartbeat of node-1, signed with its key, with ``extra`` (unknown) fields."""
    beat = Heartbeat(
        node_id=ATTACKER,
        cluster=AUTH_CLUSTER,
        seq=seq,
        boot_id="attack",
        ts=time.time(),
        agent_version="x",
        interval=0.5,
        stale_after=2.0,
    )
    body = msgspec.json.encode({**msgspec.to_builtins(beat), **extra})
    return body, auth.keys[ATTACKER].headers(body)


async def attack(auth: AuthServer, attacker: Attacker, stop: asyncio.Event, done: list[int]) -> int:
    """Every attack of issue 30 a node key can still try, over and over (each round
    appended to ``done`` as it ends); how many rounds."""
    nc = attacker.nc
    own = command_consumer(AUTH_CLUSTER, ATTACKER)
    own_commands = SUBJECTS.command(AUTH_CLUSTER, ATTACKER)
    push = msgspec.json.encode(
        {
            "stream_name": "FLEET_CMD",
            "config": {
                "durable_name": own,
                "filter_subject": own_commands,
                "deliver_subject": SUBJECTS.register(),
            },
        }
    )
    subject = SUBJECTS.heartbeat(AUTH_CLUSTER, ATTACKER)
    rounds = 0
    while not stop.is_set():
        rounds += 1
        body, headers = signed_beat(auth, 10 + rounds, z=None)
        nested = body[:-1] + b',"z":' + NESTED + b"}"
        await nc.publish(subject, nested, headers=auth.keys[ATTACKER].headers(nested))
        body, headers = signed_beat(auth, 10_000 + rounds)
        await nc.publish(subject, body, headers={**headers, "Nats-Rollup": "all"})
        body, headers = signed_beat(auth, 20_000 + rounds, stale_after=1e308)
        await nc.publish(subject, body, headers={**headers, "Nats-TTL": "never"})
        for node in (HONEST, DYING):
            await nc.publish(f"_INBOX.{node}.x{rounds}", b'{"status":"done"}')
        for api in ("$JS.API", AUTH_JS_API_PREFIX):
            await nc.publish(f"{api}.CONSUMER.CREATE.FLEET_CMD.{own}.{own_commands}", push)
        with contextlib.suppress(Exception):
            await nc.flush(timeout=2)
        done.append(rounds)
        await asyncio.sleep(0.2)  # the attacker's pace: five rounds a second
    return rounds


async def test_a_dying_node_is_found_stale_while_node_1_attacks(
    auth: AuthServer, attacker: Attacker
) -> None:
    """Under every attack at once a SIGKILL-like stop of node-3 makes it stale within
    stale_after + the sweep (the attacks change nothing it needs), node-2 stays active
    and beating, and nothing restarts."""
    aggregator = await auth.fleet.start_aggregator()
    honest = await auth.fleet.start_agent(auth.config(HONEST))
    dying = await auth.fleet.start_agent(auth.config(DYING))
    for node in (HONEST, DYING):
        await wait_record(auth.admin, PREFIX, node, lambda r: r.state == "active")
    stop = asyncio.Event()
    done: list[int] = []
    attacking = asyncio.create_task(attack(auth, attacker, stop, done))
    try:
        await wait_for(lambda: len(done) >= 5)  # the attacks under way
        before = await wait_record(auth.admin, PREFIX, HONEST, lambda r: True)
        stopped_at = time.monotonic()
        await dying.stop(goodbye=False)
        # The node's TTL, then the marker's way to the aggregator (a sweep at most) and a
        # margin for a loaded machine.
        bound = auth.config(DYING).stale_after + TEST_BUDGETS.sweep_interval + 5.0
        stale = await wait_record(
            auth.admin, PREFIX, DYING, lambda r: r.state == "stale", timeout=bound
        )
        found_after = time.monotonic() - stopped_at
        assert stale.stale_since is not None
        after = await wait_record(
            auth.admin, PREFIX, HONEST, lambda r: r.last_seq > before.last_seq + 2
        )
        assert after.state == "active"
    finally:
        stop.set()
        rounds = await attacking
    assert rounds >= 5
    assert found_after < bound
    assert set(restarts(aggregator).values()) == {0}
    assert honest.supervisor is not None and set(restarts(honest.supervisor).values()) == {0}
    own = command_consumer(AUTH_CLUSTER, ATTACKER)
    create = f"$JS.API.CONSUMER.CREATE.FLEET_CMD.{own}.{SUBJECTS.command(AUTH_CLUSTER, ATTACKER)}"
    assert attacker.refused(create) and attacker.refused(f"_INBOX.{HONEST}.x1")
    # The heartbeats that reached the aggregator were judged and refused (alerted once a
    # window: the first refusal, whichever attack it was).
    refused = await auth.admin.js.get_last_msg(
        SUBJECTS.stream_name(STREAM_ALERTS), SUBJECTS.alert("bad_signature", AUTH_CLUSTER, ATTACKER)
    )
    assert refused.data is not None
    assert msgspec.json.decode(refused.data)["node_id"] == ATTACKER
