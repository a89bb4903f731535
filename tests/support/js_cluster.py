"""A plain three-server JetStream cluster on loopback (no TLS, no accounts), for tests of
what the fleet does when the cluster itself fails: a server stopped, an asset left
without a leader. The shipped configs (TLS routes, accounts) are tested as they are in
tests/system/test_deploy.py; the fault harness (tests/faults) runs them in namespaces.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import nats.errors
import nats.js.errors

from actors.runtime.bus import NatsBus
from actors.runtime.embedded import NatsServer
from tests.support.fleet import wait_for
from tests.support.ports import free_port

SERVERS = 3


def config(name: str, store: Path, route: int, routes: list[int]) -> str:
    peers = ", ".join(f"nats-route://127.0.0.1:{port}" for port in routes)
    return (
        f"server_name: {name}\n"
        "listen: 127.0.0.1:-1\n"
        f'jetstream {{ store_dir: "{store}" }}\n'
        f"cluster {{ name: test, listen: 127.0.0.1:{route}, routes: [{peers}] }}\n"
    )


def start_cluster(directory: Path) -> Iterator[list[NatsServer]]:
    """Three clustered servers named c1..c3 (each one's ``name`` is its server name),
    stopped when the generator is closed (a fixture's teardown)."""
    routes = [free_port() for _ in range(SERVERS)]
    servers: list[NatsServer] = []
    try:
        for n in range(SERVERS):
            name = f"c{n + 1}"
            home = directory / name
            home.mkdir(parents=True)
            path = home / "server.conf"
            path.write_text(config(name, home / "js", routes[n], routes))
            servers.append(NatsServer(home, name=name, config_file=path).start())
        yield servers
    finally:
        for server in servers:
            server.stop()


def urls(servers: list[NatsServer]) -> str:
    return ",".join(server.url for server in servers)


async def wait_jetstream(bus: NatsBus) -> None:
    """Until the cluster has elected its meta leader (JetStream answers account info)."""

    async def answered() -> bool:
        try:
            await bus.js.account_info()
        except (nats.errors.Error, nats.js.errors.Error, TimeoutError):
            return False
        return True

    await wait_for(answered, interval=0.2)
