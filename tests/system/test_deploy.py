"""Every nats-server config in deploy/nats/, started for real on loopback and used by an
aggregator and agents: one server, a 3-node JetStream cluster, hub + leaf, nkey auth.

The config under test is always the repo file: it is read, its addresses, ports, store
directory and key placeholders are replaced (each replaced string must be present, so a
config that drifts fails here), and the result is written to the test's tmp directory.
"""

from __future__ import annotations

import configparser
import importlib
import re
import shlex
import time
import tomllib
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import msgspec
import nats
import nats.errors
import nats.js.errors
import pytest
from nats.aio.msg import Msg

from actors.fleet.live import reader as live
from actors.fleet.storage.nats_config import JS_API_PREFIX
from actors.fleet.storage.streams import provision
from actors.node.agent import STOP_STEP_TIMEOUT, NodeAgent
from actors.node.config import ENV_PREFIX, AgentConfig
from actors.runtime.bus import NatsBus
from actors.runtime.config import build
from actors.runtime.connect_failures import BusError
from actors.runtime.embedded import NatsServer
from schemas import codec, signing
from schemas.messages import Cordon, Probe, ProbeReply
from schemas.subjects import (
    BUCKET_NODES,
    BUCKET_TRUST,
    STREAM_ALERTS,
    STREAM_COMMANDS,
    STREAM_EVENTS,
    STREAM_HEARTBEAT_INTAKE,
    STREAM_HEARTBEATS,
    Subjects,
    probe_reply,
)
from tests.support.commanding import Results, send
from tests.support.deploy import (
    AUTH_CLUSTER,
    AUTH_JS_API_PREFIX,
    AUTH_NODE,
    DEPLOY,
    STORE,
    fleet_auth,
    render,
    render_auth,
)
from tests.support.fleet import Fleet, agent_config, wait_for, wait_record
from tests.support.pki import TLS_DIR, Pki
from tests.support.ports import free_port

PREFIX = "fleet"
"""The configs' permissions name the default prefix, so these tests use it too (each test
has servers of its own, so nothing is shared)."""


@pytest.fixture
def servers() -> Iterator[list[NatsServer]]:
    """Servers a test starts; each is stopped when the test ends."""
    started: list[NatsServer] = []
    yield started
    for server in started:
        server.stop()


@pytest.fixture
async def stack(servers: list[NatsServer]) -> AsyncIterator[AsyncExitStack]:
    """What a test runs on its servers, stopped (newest first) before the servers stop."""
    async with AsyncExitStack() as stack:
        yield stack


def start(
    servers: list[NatsServer],
    config: Path,
    store: Path,
    name: str,
    env: dict[str, str] | None = None,
) -> NatsServer:
    server = NatsServer(store, name=name, config_file=config, env=env)
    servers.append(server)
    return server.start()


async def open_fleet(
    stack: AsyncExitStack, url: str, state_dir: Path, name: str = "test", **connect: Any
) -> Fleet:
    """A fleet on the test's own servers under the configs' prefix; its bus closes last."""
    bus = await NatsBus.connect(url, name, **connect)
    stack.push_async_callback(bus.close)
    return Fleet(url, bus, PREFIX, state_dir, stack)


async def admit(fleet: Fleet, server: str, node: str = "n1", **settings: Any) -> NodeAgent:
    """An approved agent on ``server``, once the aggregator has it ``active``."""
    config = agent_config(server, PREFIX, fleet.state_dir, node, **settings)
    agent = await fleet.start_agent(config)
    await wait_record(fleet.bus, PREFIX, node, lambda r: r.state == "active")
    return agent


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    """The test's certificate authority; servers and clients get certificates from it."""
    return Pki(tmp_path / "tls")


def tls_settings(pki: Pki) -> dict[str, str]:
    """An agent's TLS settings, as an operator writes them: the CA and a client
    certificate of its own."""
    cert, key = pki.issue("client")
    return {"tls_ca": str(pki.ca_file), "tls_cert": str(cert), "tls_key": str(key)}


def secure(
    directory: Path, state_dir: Path, pki: Pki, nodes: list[str], *flags: str
) -> signing.KeyPair:
    """fleet-auth.conf in ``directory`` from ``fleetctl nats-config`` for ``nodes`` (cluster
    c1, the keys their agents will find in their state directories) and a new aggregator
    key, which it returns; /etc/nats/tls is the test's CA."""
    aggregator = signing.KeyPair.generate()
    keys = {
        node: (
            "c1",
            signing.load_or_create_key_file(
                agent_config("", PREFIX, state_dir, node).key_path
            ).public_key,
        )
        for node in nodes
    }
    fleet_auth(directory, keys, aggregator.public_key, *flags)
    return aggregator


def secured(text: dict[str, str], pki: Pki, store: Path) -> dict[str, str]:
    return {**text, TLS_DIR: str(pki.dir), STORE: str(store)}


NODE_SETTINGS: dict[str, Any] = {"nkey_auth": True, "js_api_prefix": JS_API_PREFIX}
"""How an agent runs under the generated accounts: logged in with its node key, reaching
JetStream through NODES' imports."""


async def test_single(
    tmp_path: Path, state_dir: Path, servers: list[NatsServer], stack: AsyncExitStack, pki: Pki
) -> None:
    """single.conf runs JetStream over mutual TLS with the generated users: an anonymous
    client and one without a certificate are refused, an aggregator and an agent (nkey +
    client certificate) reach ``active``."""
    aggregator = secure(tmp_path, state_dir, pki, ["n1"])
    config = render(
        "single.conf",
        tmp_path / "single.conf",
        secured(
            {"10.0.0.10:4222": f"127.0.0.1:{free_port()}"},
            pki,
            tmp_path / "js",
        ),
    )
    server = start(servers, config, tmp_path / "server", "single")
    with pytest.raises(BusError):
        await NatsBus.connect(server.url, "anonymous", connect_timeout=2)
    with pytest.raises(BusError):
        await NatsBus.connect(
            server.url, "no-cert", nkey_seed=aggregator.seed, tls=pki.client(), connect_timeout=2
        )
    fleet = await open_fleet(
        stack, server.url, state_dir, nkey_seed=aggregator.seed, tls=pki.client("client")
    )
    info = await fleet.bus.js.account_info()
    assert info.limits.max_storage != 0
    await fleet.start_aggregator()
    await admit(fleet, server.url, **NODE_SETTINGS, **tls_settings(pki))
    assert "Violation" not in server.log_file.read_text()


@pytest.mark.slow
async def test_cluster(
    tmp_path: Path, state_dir: Path, servers: list[NatsServer], stack: AsyncExitStack, pki: Pki
) -> None:
    """cluster/n1-3.conf form one JetStream cluster over TLS routes that log in: R3
    streams and buckets, an agent on a server list reaches ``active``, and its heartbeats
    are still accepted once the server it was connected to is stopped. A route without
    the password is refused, and so is one whose certificate is not of the routes' CA."""
    aggregator = secure(tmp_path, state_dir, pki, ["n1"])
    routes = [free_port() for _ in range(3)]
    for n in range(1, 4):
        replacements = {
            f"10.0.0.1{n}:4222": f"127.0.0.1:{free_port()}",
            f"10.0.0.1{n}:6222": f"127.0.0.1:{routes[n - 1]}",
        }
        for peer in range(1, 4):
            replacements[f"@fleet-n{peer}:6222"] = f"@127.0.0.1:{routes[peer - 1]}"
        replacements["ROUTE_PASSWORD"] = "s3cret"
        config = render(
            f"cluster/n{n}.conf",
            tmp_path / f"n{n}.conf",
            secured(replacements, pki, tmp_path / f"js{n}"),
        )
        start(servers, config, tmp_path / f"n{n}", f"n{n}")
    urls = ",".join(server.url for server in servers)
    fleet = await open_fleet(
        stack, urls, state_dir, nkey_seed=aggregator.seed, tls=pki.client("client")
    )
    bus = fleet.bus
    await fleet.start_aggregator(ready_timeout=30, replicas=3)
    subjects = Subjects(PREFIX)
    streams = [
        subjects.stream_name(base)
        for base in (
            STREAM_HEARTBEATS,
            STREAM_COMMANDS,
            STREAM_EVENTS,
            STREAM_ALERTS,
        )
    ] + [f"KV_{subjects.bucket_name(base)}" for base in (BUCKET_NODES, BUCKET_TRUST)]
    for stream in streams:
        info = await bus.js.stream_info(stream)
        assert info.config.num_replicas == 3, stream
        assert info.cluster is not None and info.cluster.name == "fleet"

    agent = await admit(fleet, urls, stale_after=10.0, **NODE_SETTINGS, **tls_settings(pki))
    assert agent.bus is not None
    connected = agent.bus.nc.connected_url
    assert connected is not None
    victim = next(s for s in servers if s.port == connected.port)
    before = (await live.read_node(bus, Subjects(PREFIX), "n1")).last_seq
    victim.stop()

    # Read as the views read it (the latest accepted heartbeat: the record itself is
    # checkpointed every 60 s). Reads may time out while the clients fail over and
    # leaders are re-elected.
    async def risen() -> bool:
        try:
            current = await live.read_node(bus, Subjects(PREFIX), "n1")
        except (nats.errors.Error, TimeoutError):
            return False
        return current.last_seq > before + 3

    await wait_for(risen)
    # A fourth server with the right certificate but the wrong password does not join.
    member = next(n for n, s in enumerate(servers) if s is not victim)
    rogue = render(
        "cluster/n1.conf",
        tmp_path / "rogue.conf",
        secured(
            {
                "server_name: fleet-n1": "server_name: fleet-rogue",
                "ROUTE_PASSWORD": "guess",
                "10.0.0.11:4222": "127.0.0.1:-1",
                "10.0.0.11:6222": "127.0.0.1:-1",
                "@fleet-n2:6222": f"@127.0.0.1:{routes[member]}",
            },
            pki,
            tmp_path / "js-rogue",
        ),
    )
    start(servers, rogue, tmp_path / "rogue", "rogue")
    log = servers[member].log_file
    await wait_for(lambda: "Router connection closed: Authentication Failure" in log.read_text())
    # One with the password but a certificate of the fleet CA (any node or client has one)
    # as its route certificate: its handshake is refused, it joins nothing.
    impostor = Pki(tmp_path / "impostor-tls")
    for name in ("ca.pem", "server.pem", "server-key.pem", "route-ca.pem"):
        (impostor.dir / name).write_bytes((pki.dir / name).read_bytes())
    cert, key = pki.issue("node-route", "127.0.0.1")
    (impostor.dir / "route.pem").write_bytes(cert.read_bytes())
    (impostor.dir / "route-key.pem").write_bytes(key.read_bytes())
    handshakes = log.read_text().count("TLS route handshake error")
    impostor_config = render(
        "cluster/n1.conf",
        tmp_path / "impostor.conf",
        secured(
            {
                "server_name: fleet-n1": "server_name: fleet-impostor",
                "ROUTE_PASSWORD": "s3cret",
                "10.0.0.11:4222": "127.0.0.1:-1",
                "10.0.0.11:6222": "127.0.0.1:-1",
                "@fleet-n2:6222": f"@127.0.0.1:{routes[member]}",
            },
            impostor,
            tmp_path / "js-impostor",
        ),
    )
    start(servers, impostor_config, tmp_path / "impostor", "impostor")
    await wait_for(lambda: log.read_text().count("TLS route handshake error") > handshakes)
    assert "fleet-impostor" not in log.read_text()


def leaf_config(tmp_path: Path, pki: Pki, name: str) -> Path:
    return render(
        "leaf.conf",
        tmp_path / f"{name}.conf",
        {"127.0.0.1:4222": f"127.0.0.1:{free_port()}", TLS_DIR: str(pki.dir)},
    )


async def test_hub_and_leaf(
    tmp_path: Path, state_dir: Path, servers: list[NatsServer], stack: AsyncExitStack, pki: Pki
) -> None:
    """leaf.conf attaches to hub.conf over mutual TLS as its node's user: an agent
    connected only to the leaf reaches ``active`` and runs a command, a client of the leaf
    cannot beat for another node, and a leaf without the node's key is refused."""
    operator = signing.KeyPair.generate()
    aggregator = secure(tmp_path, state_dir, pki, ["n1", "n2"])
    leaf_port = free_port()
    hub_config = render(
        "hub.conf",
        tmp_path / "hub.conf",
        secured(
            {
                "10.0.0.10:4222": f"127.0.0.1:{free_port()}",
                "10.0.0.10:7422": f"127.0.0.1:{leaf_port}",
            },
            pki,
            tmp_path / "hub-js",
        ),
    )
    hub = start(servers, hub_config, tmp_path / "hub", "hub")
    pki.issue("node", "n1@nodes")
    node_key = signing.load_key_file(agent_config("", PREFIX, state_dir, "n1").key_path)
    env = {
        "HUB_URL": f"nats-leaf://127.0.0.1:{leaf_port}",
        "NODE_NAME": "gpu-node-1",
        "NODE_SEED": node_key.seed,
    }
    leaf = start(servers, leaf_config(tmp_path, pki, "leaf"), tmp_path / "leaf", "leaf", env=env)
    fleet = await open_fleet(
        stack, hub.url, state_dir, nkey_seed=aggregator.seed, tls=pki.client("client")
    )
    results = await Results().start(fleet.bus, PREFIX)
    await fleet.start_aggregator()
    await wait_for(lambda: "Leafnode connection created" in hub.log_file.read_text())
    await admit(fleet, leaf.url, js_api_prefix=JS_API_PREFIX, trust_operators=[operator.public_key])
    cordon = await send(fleet.bus, PREFIX, operator, Cordon(), node="n1", cluster="c1")
    assert (await results.final(cordon.id)).status == "done"
    await wait_record(fleet.bus, PREFIX, "n1", lambda r: r.state == "cordoned")

    local = await nats.connect(leaf.url, inbox_prefix="_INBOX.n1")
    try:
        forged = Subjects(PREFIX).heartbeat("c1", "n2")
        with pytest.raises((nats.errors.Error, TimeoutError)):
            await local.jetstream(prefix=JS_API_PREFIX).publish(forged, b"{}", timeout=2)
    finally:
        await local.close()
    with pytest.raises(nats.js.errors.NotFoundError):
        await fleet.bus.js.get_last_msg(
            Subjects(PREFIX).stream_name(STREAM_HEARTBEAT_INTAKE), forged
        )

    anonymous = leaf_config(tmp_path, pki, "anonymous")
    anonymous.write_text(anonymous.read_text().replace("nkey: $NODE_SEED", ""))
    start(servers, anonymous, tmp_path / "anonymous", "anonymous", env=env)
    refused = "Leafnode connection closed: Authentication Failure"
    await wait_for(lambda: refused in hub.log_file.read_text())


async def test_identity_from_certificates(
    tmp_path: Path, state_dir: Path, servers: list[NatsServer], pki: Pki
) -> None:
    """``fleetctl nats-config --identity cert`` with ``verify_and_map``: the certificate
    of n1 (email SAN n1@nodes) logs in as n1, which may beat for itself and not for n2; a
    certificate that names no user is refused; the aggregator still logs in by nkey."""
    aggregator = secure(tmp_path, state_dir, pki, ["n1", "n2"], "--identity", "cert")
    config = render(
        "single.conf",
        tmp_path / "single.conf",
        secured(
            {
                "10.0.0.10:4222": f"127.0.0.1:{free_port()}",
                "verify: true": "verify_and_map: true",
            },
            pki,
            tmp_path / "js",
        ),
    )
    server = start(servers, config, tmp_path / "server", "mapped")
    admin = await NatsBus.connect(
        server.url, "admin", nkey_seed=aggregator.seed, tls=pki.client("client")
    )
    try:
        await provision(admin.js, Subjects(PREFIX))
        with pytest.raises(BusError):
            await NatsBus.connect(
                server.url, "stranger", tls=pki.client("stranger", "n3@nodes"), connect_timeout=2
            )
        node = await nats.connect(
            server.url, tls=pki.client("n1", "n1@nodes"), inbox_prefix="_INBOX.n1"
        )
        try:
            js = node.jetstream(prefix=JS_API_PREFIX)
            subjects = Subjects(PREFIX)
            ack = await js.publish(subjects.heartbeat("c1", "n1"), b"{}", timeout=2)
            assert ack.stream == subjects.stream_name(STREAM_HEARTBEAT_INTAKE)
            with pytest.raises((nats.errors.Error, TimeoutError)):
                await js.publish(subjects.heartbeat("c1", "n2"), b"{}", timeout=2)
        finally:
            await node.close()
    finally:
        await admin.close()
    refused = '"NODES/user:n1@nodes" - Publish Violation - Subject "fleet.hb.c1.n2"'
    assert refused in server.log_file.read_text()


async def test_auth(
    tmp_path: Path, state_dir: Path, servers: list[NatsServer], stack: AsyncExitStack
) -> None:
    """auth.conf: the aggregator logs in with its nkey, node-1 with its node key runs all its
    real traffic (heartbeats, events, probes, KV reads, commands) without one permission
    violation, and cannot beat for node-2 nor listen to node-2's probes."""
    aggregator_key = signing.KeyPair.generate()
    operator = signing.KeyPair.generate()
    config = agent_config(
        "",
        PREFIX,
        state_dir,
        AUTH_NODE,
        cluster=AUTH_CLUSTER,
        nkey_auth=True,
        js_api_prefix=AUTH_JS_API_PREFIX,
        trust_operators=[operator.public_key],
        probe_interval=0.3,
    )
    node_key = signing.load_or_create_key_file(config.key_path)
    text = (DEPLOY / "auth.conf").read_text()
    assert f"fleet.hb.{AUTH_CLUSTER}.{AUTH_NODE}" in text
    rendered = render_auth(
        tmp_path / "auth.conf",
        free_port(),
        tmp_path / "js",
        aggregator_key.public_key,
        {AUTH_NODE: (AUTH_CLUSTER, node_key.public_key)},
    )
    server = start(servers, rendered, tmp_path / "server", "auth")
    config = msgspec.structs.replace(config, server=server.url)

    with pytest.raises(BusError):
        await NatsBus.connect(server.url, "anonymous", connect_timeout=2)
    fleet = await open_fleet(
        stack, server.url, state_dir, "aggregator", nkey_seed=aggregator_key.seed
    )
    bus = fleet.bus
    results = await Results().start(bus, PREFIX)
    aggregator = await fleet.start_aggregator()
    agent = await fleet.start_agent(config)
    await wait_record(bus, PREFIX, AUTH_NODE, lambda r: r.state == "active")
    cordon = await send(bus, PREFIX, operator, Cordon(), node=AUTH_NODE, cluster=AUTH_CLUSTER)
    assert (await results.final(cordon.id)).status == "done"
    await wait_record(bus, PREFIX, AUTH_NODE, lambda r: r.state == "cordoned")
    # Only nodes reach nodes' probes: the node's own key asks here, on a probe inbox.
    own = await nats.connect(server.url, nkeys_seed_str=node_key.seed)
    probe = Probe(from_node="prober", nonce="n-1", sent_at=time.time())
    try:
        inbox = await own.subscribe(probe_reply(AUTH_NODE, AUTH_NODE, "n-1"))
        await own.publish(
            Subjects(PREFIX).probe(AUTH_NODE), codec.encode(probe), reply=inbox.subject
        )
        reply = await inbox.next_msg(timeout=5)
    finally:
        await own.close()
    assert codec.decode(reply.data, ProbeReply, reply.subject).nonce == "n-1"
    # Peer discovery has listed and read the bucket a few times by now.
    assert agent.bus is not None
    assert "Violation" not in server.log_file.read_text()
    await agent.stop()
    await aggregator.stop()
    await refuses_another_nodes_subjects(bus, server, node_key)


async def refuses_another_nodes_subjects(
    bus: NatsBus, server: NatsServer, node_key: signing.KeyPair
) -> None:
    """Logged in as node-1: a heartbeat on node-2's subject is not stored, and neither
    node-2's probe subject nor node-2's replies can be subscribed to."""
    errors: list[Exception] = []

    async def on_error(exc: Exception) -> None:
        errors.append(exc)

    nc = await nats.connect(
        server.url, nkeys_seed_str=node_key.seed, error_cb=on_error, allow_reconnect=False
    )
    try:
        subjects = Subjects(PREFIX)
        forged = subjects.heartbeat(AUTH_CLUSTER, "node-2")
        with pytest.raises((nats.errors.Error, TimeoutError)):
            await nc.jetstream().publish(forged, b"{}", timeout=2)
        with pytest.raises(nats.js.errors.NotFoundError):
            await bus.js.get_last_msg(subjects.stream_name(STREAM_HEARTBEAT_INTAKE), forged)

        heard: list[bytes] = []

        async def listen(msg: Msg) -> None:
            heard.append(msg.data)

        await nc.subscribe(subjects.probe("node-2"), cb=listen)
        await nc.subscribe("_INBOX.node-2.>", cb=listen)
        await nc.flush(timeout=2)
        await wait_for(
            lambda: (
                sum("permissions violation for subscription" in str(e).lower() for e in errors) >= 2
            )
        )
        with pytest.raises(nats.errors.NoRespondersError):
            await bus.request(subjects.probe("node-2"), b"{}", timeout=2)
        assert heard == []
    finally:
        await nc.close()


def test_no_monitoring_port() -> None:
    """No shipped server config opens nats-server's monitoring port: it has no
    authentication and lists every connection's subscriptions, inbox names included."""
    configs = sorted(DEPLOY.glob("**/*.conf"))
    assert len(configs) >= 6
    for config in configs:
        settings = [line.split("#", 1)[0].strip() for line in config.read_text().splitlines()]
        opened = [s for s in settings if re.match(r"(http|https|monitor_port|http_port)\s*[:=]", s)]
        assert opened == [], config


def unit(name: str) -> configparser.ConfigParser:
    """A systemd unit from deploy/nats/systemd, read as INI (keys keep their case; a
    repeated key such as LoadCredential keeps its last value: tests/system/test_tls.py
    reads those lines itself)."""
    parsed = configparser.ConfigParser(interpolation=None, strict=False)
    parsed.optionxform = str  # type: ignore[assignment,method-assign]  # systemd keys are case-sensitive
    parsed.read(DEPLOY / "systemd" / name)
    return parsed


def test_agent_example_is_a_valid_config() -> None:
    """agent.example.toml loads with the real config loader and mentions every AgentConfig
    field, so it cannot drift from the code."""
    path = DEPLOY / "agent.example.toml"
    config = build(AgentConfig, ENV_PREFIX, file=path, env={})
    assert config.nkey_auth and config.state_dir == "/var/lib/node-agent"
    text = path.read_text()
    missing = [
        field.name
        for field in msgspec.structs.fields(AgentConfig)
        if not re.search(rf"^#? ?{field.name} = ", text, re.MULTILINE)
    ]
    assert missing == []


def test_units_run_real_commands() -> None:
    """Each unit's ExecStart runs nats-server or a console script of pyproject with
    arguments that script's own parser accepts; the agent's unit restarts always, is
    hardened, and gives a graceful stop more time than the agent's shutdown can take."""
    scripts = tomllib.loads((DEPLOY.parent.parent / "pyproject.toml").read_text())["project"][
        "scripts"
    ]
    units = sorted((DEPLOY / "systemd").glob("*.service"))
    assert {path.name for path in units} == {
        "nats-server.service",
        "node-agent.service",
        "fleetctl-aggregator.service",
    }
    for path in units:
        command, *args = shlex.split(unit(path.name)["Service"]["ExecStart"])
        program = Path(command).name
        if program == "nats-server":
            continue
        assert program in scripts, f"{path.name}: {program} is not a console script"
        module = importlib.import_module(scripts[program].split(":")[0])
        module.parser().parse_args(args)

    agent = unit("node-agent.service")["Service"]
    assert "node-agent start --config /etc/node-agent/agent.toml" in agent["ExecStart"]
    assert agent["Restart"] == "always" and agent["KillSignal"] == "SIGTERM"
    assert agent["NoNewPrivileges"] == "true" and agent["ProtectSystem"] == "strict"
    assert agent["StateDirectory"] == "node-agent"
    example = build(AgentConfig, ENV_PREFIX, file=DEPLOY / "agent.example.toml", env={})
    assert example.state_dir in agent["ReadWritePaths"].split()
    assert float(agent["TimeoutStopSec"]) > example.shutdown_timeout + 2 * STOP_STEP_TIMEOUT
