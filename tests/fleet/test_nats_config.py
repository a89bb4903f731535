"""``fleetctl nats-config``'s generator: what it renders is a config nats-server accepts,
its nodes come from a listing or from the approved keys in fleet_trust, and its monitor
user only reads. (What the node users may and may not do: tests/security/test_permissions.py
runs every attack against the generated config too.)"""

from __future__ import annotations

import subprocess
from pathlib import Path

import nats.errors
import pytest

from actors.fleet.storage import nats_config, records, registry
from actors.fleet.storage.nats_config import NodeUser, Users
from actors.fleet.storage.streams import provision
from actors.runtime.bus import NatsBus
from actors.runtime.embedded import NatsServer, find_binary
from schemas import signing
from schemas.errors import FleetError
from schemas.subjects import Subjects
from tests.support.ports import free_port


def key() -> str:
    return signing.KeyPair.generate().public_key


def server_config(directory: Path, users: Users, identity: nats_config.Identity) -> Path:
    (directory / "fleet-auth.conf").write_text(nats_config.render(Subjects(), users, identity))
    config = directory / "server.conf"
    config.write_text(
        f"listen: 127.0.0.1:{free_port()}\n"
        f'jetstream {{ store_dir: "{directory / "js"}" }}\n'
        "include fleet-auth.conf\n"
    )
    return config


@pytest.mark.parametrize("identity", ["nkey", "cert"])
def test_nats_server_accepts_it(tmp_path: Path, identity: nats_config.Identity) -> None:
    nodes = [NodeUser(f"node-{n}", "gpu-a", key()) for n in range(3)]
    users = Users(nodes, aggregators=[key()], operators=[key()], monitors=[key()])
    config = server_config(tmp_path, users, identity)
    checked = subprocess.run([find_binary(), "-t", "-c", str(config)], capture_output=True)
    assert checked.returncode == 0, checked.stderr.decode()


def test_listing_is_checked() -> None:
    """Malformed lines, a node listed twice and two nodes whose command consumers would
    share a name are refused, each in one line."""
    good = key()
    listing = f"# node cluster key\nnode-1 gpu-a {good}  # first\n\nnode-2 gpu-b {good}\n"
    assert [u.node for u in nats_config.parse_nodes(listing)] == ["node-1", "node-2"]
    for bad in ("node-1 gpu-a", "node.1 gpu-a " + good, "node-1 gpu-a NOTAKEY"):
        with pytest.raises(FleetError):
            nats_config.parse_nodes(bad)
    with pytest.raises(FleetError, match="twice"):
        Users(nats_config.parse_nodes(f"n1 c {good}\nn1 c {good}"))
    # Cluster a_b's node c and cluster a's node b_c: one consumer name, cmd_a_b_c.
    with pytest.raises(FleetError, match="would share the command consumer cmd_a_b_c"):
        Users(nats_config.parse_nodes(f"c a_b {good}\nb_c a {good}"))


async def test_nodes_from_fleet_trust(bus: NatsBus, prefix: str) -> None:
    """Approved nodes only (a revoked key gets no user); a node without a record takes
    --cluster, or the command says it needs one."""
    subjects = Subjects(prefix)
    first, second = key(), key()
    await registry.approve(bus, subjects, "n1", first)
    await registry.approve(bus, subjects, "n2", second)
    await registry.revoke(bus, subjects, "n2")
    assert await nats_config.approved_nodes(bus, subjects, {}, "c9") == [
        NodeUser("n1", "c9", first)
    ]
    assert await nats_config.approved_nodes(bus, subjects, {"n1": "c1"}, "c9") == [
        NodeUser("n1", "c1", first)
    ]
    with pytest.raises(FleetError, match="cluster"):
        await nats_config.approved_nodes(bus, subjects, {})


async def test_monitor_only_reads(tmp_path: Path) -> None:
    """The monitor lists the node records (through JS.FLEET.API, from its own account) and
    cannot write a trust entry (tests/security/test_monitor.py tries the rest)."""
    aggregator, monitor = signing.KeyPair.generate(), signing.KeyPair.generate()
    users = Users([], aggregators=[aggregator.public_key], monitors=[monitor.public_key])
    config = server_config(tmp_path, users, "nkey")
    subjects = Subjects()
    with NatsServer(tmp_path / "server", config_file=config) as server:
        admin = await NatsBus.connect(server.url, "admin", nkey_seed=aggregator.seed)
        reader = await NatsBus.connect(
            server.url, "monitor", nkey_seed=monitor.seed, js_api_prefix=nats_config.JS_API_PREFIX
        )
        try:
            await provision(admin.js, subjects)
            assert await records.read_records(reader, subjects) == []
            with pytest.raises((nats.errors.Error, TimeoutError)):
                await registry.approve(reader, subjects, "n1", key())
            assert await registry.trust_entry(admin, subjects, "n1") is None
        finally:
            await reader.close()
            await admin.close()
