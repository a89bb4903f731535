"""A real nats-server under the shipped accounts (deploy/nats/auth.conf, and what
``fleetctl nats-config`` generates), three nodes and the provider, and an attacker holding
node-1's key on a plain nats-py connection: what tests/security's permission tests share;
``tls_auth`` is the same server over mutual TLS, as hub.conf and single.conf run it.
(``auth``, ``tls_auth`` and ``attacker`` are fixtures: tests/security/conftest.py lends
them.)"""

from __future__ import annotations

import json
import ssl
import sys
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import nats
import nats.js.errors
import pytest
from nats.aio.client import Client
from nats.js.kv import KeyValue

from actors.fleet.storage.registry import approve
from actors.fleet.storage.streams import provision
from actors.node.config import AgentConfig
from actors.runtime.bus import NatsBus
from actors.runtime.embedded import NatsServer
from schemas import signing
from schemas.subjects import (
    BUCKET_NODES,
    BUCKET_TRUST,
    STREAM_ALERTS,
    STREAM_COMMANDS,
    STREAM_HEARTBEAT_INTAKE,
    STREAM_HEARTBEATS,
    Subjects,
)
from tests.support.deploy import (
    AUTH_CLUSTER,
    AUTH_JS_API_PREFIX,
    fleet_auth,
    render_auth,
)
from tests.support.fleet import Fleet, agent_config
from tests.support.pki import Pki
from tests.support.ports import free_port

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
    pki: Pki | None = None
    """The fleet CA when the server requires mutual TLS; each node's certificate is
    ``<node>.pem`` / ``<node>-key.pem`` in its directory."""

    @property
    def admin(self) -> NatsBus:
        return self.fleet.bus

    def tls(self, node: str) -> ssl.SSLContext | None:
        """A client context presenting ``node``'s certificate (None without TLS)."""
        if self.pki is None:
            return None
        context = ssl.create_default_context(cafile=str(self.pki.ca_file))
        context.load_cert_chain(self.pki.dir / f"{node}.pem", self.pki.dir / f"{node}-key.pem")
        return context

    def config(self, node: str, **settings: object) -> AgentConfig:
        """An honest agent of ``node`` as auth.conf asks it to run, key (and certificate,
        under TLS) already in place."""
        tls: dict[str, object] = {}
        if self.pki is not None:
            directory = self.pki.dir
            tls = {
                "tls_ca": str(self.pki.ca_file),
                "tls_cert": str(directory / f"{node}.pem"),
                "tls_key": str(directory / f"{node}-key.pem"),
            }
        config = agent_config(
            self.server.url,
            PREFIX,
            self.fleet.state_dir,
            node,
            cluster=AUTH_CLUSTER,
            nkey_auth=True,
            js_api_prefix=AUTH_JS_API_PREFIX,
            **tls,
            **settings,
        )
        config.key_path.parent.mkdir(parents=True, exist_ok=True)
        config.key_path.write_text(self.keys[node].seed)
        config.key_path.chmod(0o600)
        return config


def generated(
    directory: Path,
    store: Path,
    aggregator: str,
    nodes: dict[str, tuple[str, str]],
    monitor: str,
) -> Path:
    """A server on loopback that includes what ``fleetctl nats-config`` generates, with a
    monitor user."""
    fleet_auth(directory, nodes, aggregator, "--monitor", monitor)
    config = directory / "server.conf"
    config.write_text(
        f"listen: 127.0.0.1:{free_port()}\n"
        f"jetstream {{ store_dir: {json.dumps(str(store))} }}\n"
        "include fleet-auth.conf\n"
    )
    return config


def mutual_tls(config: Path, pki: Pki) -> Path:
    """A server config beside ``config`` that includes it and requires every client to
    present a certificate of ``pki``'s CA, as hub.conf's ``tls`` block does."""
    files = {"cert_file": "server.pem", "key_file": "server-key.pem", "ca_file": "ca.pem"}
    lines = [f"  {name}: {json.dumps(str(pki.dir / file))}" for name, file in files.items()]
    wrapper = config.parent / f"tls-{config.name}"
    wrapper.write_text(
        f"include {json.dumps(config.name)}\ntls {{\n" + "\n".join(lines) + "\n  verify: true\n}\n"
    )
    return wrapper


@pytest.fixture(params=["auth.conf", "generated"])
async def auth(
    tmp_path: Path, state_dir: Path, request: pytest.FixtureRequest
) -> AsyncIterator[AuthServer]:
    """Three nodes and the provider, streams and buckets provisioned, under the hand-written
    auth.conf and under ``fleetctl nats-config``'s output: both must hold."""
    async with auth_server(tmp_path, state_dir, request.param) as server:
        yield server


@pytest.fixture(params=["auth.conf", "generated"])
async def tls_auth(
    tmp_path: Path, state_dir: Path, request: pytest.FixtureRequest
) -> AsyncIterator[AuthServer]:
    """``auth`` over mutual TLS: every client (the provider, each node, an attacker)
    presents a certificate of the fleet CA, one per node and one for the provider."""
    pki = Pki(tmp_path / "tls")
    for node in NODES:
        pki.issue(node)
    async with auth_server(tmp_path, state_dir, request.param, pki) as server:
        yield server


@asynccontextmanager
async def auth_server(
    tmp_path: Path, state_dir: Path, kind: str, pki: Pki | None = None
) -> AsyncIterator[AuthServer]:
    """The server of ``kind`` (``auth.conf`` or ``generated``), over mutual TLS with
    ``pki``'s CA when given, its streams provisioned, stopped on the way out."""
    keys = {node: signing.KeyPair.generate() for node in [*NODES, "aggregator", "monitor"]}
    nodes = {node: (AUTH_CLUSTER, keys[node].public_key) for node in NODES}
    aggregator = keys["aggregator"].public_key
    if kind == "generated":
        config = generated(
            tmp_path / "generated", tmp_path / "js", aggregator, nodes, keys["monitor"].public_key
        )
    else:
        config = render_auth(
            tmp_path / "auth.conf", free_port(), tmp_path / "js", aggregator, nodes
        )
    if pki is not None:
        config = mutual_tls(config, pki)
    server = NatsServer(tmp_path / "server", name="auth", config_file=config).start()
    try:
        async with AsyncExitStack() as stack:
            tls = pki.client("provider") if pki is not None else None
            admin = await NatsBus.connect(
                server.url, "admin", nkey_seed=keys["aggregator"].seed, tls=tls
            )
            stack.push_async_callback(admin.close)
            await provision(admin.js, SUBJECTS)
            fleet = Fleet(server.url, admin, PREFIX, state_dir, stack)
            yield AuthServer(server, keys, fleet, pki)
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
    heartbeats = (STREAM_HEARTBEAT_INTAKE, STREAM_HEARTBEATS)
    streams = [SUBJECTS.stream_name(s) for s in (*heartbeats, STREAM_COMMANDS, STREAM_ALERTS)]
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
