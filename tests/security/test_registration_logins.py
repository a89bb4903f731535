"""Registration limits per NATS login, under the shipped configurations: one stolen node
key is one login, however many signing keys it makes.

A real nats-server runs deploy/nats/auth.conf and what ``fleetctl nats-config``
generates, with three nodes and the provider. ``fleet.register`` is imported into the
nodes' account with ``share: true``, so the server names each request's login in
``Nats-Request-Info``; the attacker, node-1 on a plain nats-py connection, signs each
registration with a fresh key and forges that header, and node-2 registers beside it.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client

from actors.fleet.aggregator import pending
from actors.fleet.storage.records import read_record
from actors.fleet.storage.streams import provision
from actors.runtime.bus import NatsBus
from actors.runtime.embedded import NatsServer
from schemas import codec, signing
from schemas.messages import Registration, RegistrationReply
from schemas.subjects import Subjects
from tests.support.deploy import AUTH_CLUSTER, fleet_auth, render_auth
from tests.support.fleet import Fleet
from tests.support.ports import free_port

PREFIX = "fleet"
"""The shipped configurations name the default prefix."""
SUBJECTS = Subjects(PREFIX)
NODES = ["node-1", "node-2", "node-3"]


async def shipped_fleet(
    tmp_path: Path, state_dir: Path, kind: str, stack: AsyncExitStack
) -> tuple[NatsServer, dict[str, signing.KeyPair], Fleet]:
    """A server on auth.conf or on ``fleetctl nats-config``'s output, streams provisioned."""
    keys = {node: signing.KeyPair.generate() for node in [*NODES, "aggregator"]}
    nodes = {node: (AUTH_CLUSTER, keys[node].public_key) for node in NODES}
    aggregator = keys["aggregator"].public_key
    if kind == "generated":
        directory = tmp_path / "generated"
        fleet_auth(directory, nodes, aggregator)
        config = directory / "server.conf"
        config.write_text(
            f"listen: 127.0.0.1:{free_port()}\n"
            f"jetstream {{ store_dir: {json.dumps(str(tmp_path / 'js'))} }}\n"
            "include fleet-auth.conf\n"
        )
    else:
        config = render_auth(
            tmp_path / "auth.conf", free_port(), tmp_path / "js", aggregator, nodes
        )
    server = NatsServer(tmp_path / "server", name="auth", config_file=config).start()
    stack.callback(server.stop)
    admin = await NatsBus.connect(server.url, "admin", nkey_seed=keys["aggregator"].seed)
    stack.push_async_callback(admin.close)
    await provision(admin.js, SUBJECTS)
    return server, keys, Fleet(server.url, admin, PREFIX, state_dir, stack)


@pytest.fixture(params=["auth.conf", "generated"])
async def shipped(
    tmp_path: Path, state_dir: Path, request: pytest.FixtureRequest
) -> AsyncIterator[tuple[NatsServer, dict[str, signing.KeyPair], Fleet]]:
    async with AsyncExitStack() as stack:
        yield await shipped_fleet(tmp_path, state_dir, request.param, stack)


async def login(server: NatsServer, key: signing.KeyPair, node: str) -> Client:
    return await nats.connect(
        server.url, nkeys_seed_str=key.seed, inbox_prefix=f"_INBOX.{node}", allow_reconnect=False
    )


async def register(
    nc: Client, node: str, key: signing.KeyPair, forged: str = ""
) -> RegistrationReply:
    """A registration of ``node`` signed by ``key``; ``forged`` is a Nats-Request-Info
    header the sender claims."""
    body = codec.encode(
        Registration(node_id=node, cluster=AUTH_CLUSTER, public_key=key.public_key, ts=time.time())
    )
    headers = key.headers(body)
    if forged:
        headers[pending.REQUEST_INFO] = forged
    reply = await nc.request(SUBJECTS.register(), body, timeout=5, headers=headers)
    return codec.decode(reply.data, RegistrationReply, "reply")


async def test_one_login_registers_a_bounded_number_of_names_whatever_its_keys(
    shipped: tuple[NatsServer, dict[str, signing.KeyPair], Fleet],
) -> None:
    """node-1 signing each registration with a new key (and claiming node-2's login in a
    forged header) gets max_pending_per_key names, then is refused for its login; node-2
    still registers, and the records name each registration's real login."""
    server, keys, fleet = shipped
    await fleet.start_aggregator(max_pending_per_key=3, registrations_per_key_per_minute=100)
    forged = json.dumps({"acc": "NODES", "user": keys["node-2"].public_key})
    attacker = await login(server, keys["node-1"], "node-1")
    honest = await login(server, keys["node-2"], "node-2")
    try:
        replies = [
            await register(attacker, f"squat-{i}", signing.KeyPair.generate(), forged)
            for i in range(6)
        ]
        genuine = await register(honest, "new-node", signing.KeyPair.generate())
    finally:
        await attacker.close()
        await honest.close()
    assert [r.reason or r.status for r in replies] == ["pending"] * 3 + [
        "too many pending registrations for this login"
    ] * 3
    assert genuine.status == "pending"
    squat = await read_record(fleet.bus, SUBJECTS, "squat-0")
    assert squat.registered_by == f"NODES/{keys['node-1'].public_key}"
    record = await read_record(fleet.bus, SUBJECTS, "new-node")
    assert record.registered_by == f"NODES/{keys['node-2'].public_key}"


async def test_one_logins_flood_does_not_spend_other_logins_rate(
    shipped: tuple[NatsServer, dict[str, signing.KeyPair], Fleet],
) -> None:
    """node-1 flooding registrations under fresh keys is refused for its login after
    registrations_per_key_per_minute, without spending the shared limit: node-2 and
    node-3 still register."""
    server, keys, fleet = shipped
    await fleet.start_aggregator(registrations_per_minute=6, registrations_per_key_per_minute=2)
    attacker = await login(server, keys["node-1"], "node-1")
    others = [await login(server, keys[node], node) for node in ("node-2", "node-3")]
    try:
        flood = [
            await register(attacker, f"squat-{i}", signing.KeyPair.generate()) for i in range(20)
        ]
        genuine = [
            await register(nc, f"new-{i}", signing.KeyPair.generate())
            for i, nc in enumerate(others)
        ]
    finally:
        for nc in [attacker, *others]:
            await nc.close()
    assert [r.status for r in flood] == ["pending"] * 2 + ["rejected"] * 18
    assert {r.reason for r in flood[2:]} == {"too many registrations from this login; retry later"}
    assert [r.status for r in genuine] == ["pending", "pending"]
