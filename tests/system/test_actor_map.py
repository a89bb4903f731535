"""actors/__init__.py's map of the actors is the one the two processes start."""

from __future__ import annotations

import re
from pathlib import Path

import actors
from actors.fleet.config import AggregatorConfig
from actors.fleet.metrics import AggregatorMetrics
from actors.fleet.process import ProviderActors
from actors.fleet.remediation.config import PolicyConfig
from actors.node.agent import NodeAgent
from actors.runtime.bus import NatsBus
from actors.runtime.supervisor import Actor
from schemas import signing
from tests.support.fleet import agent_config

ENTRY = re.compile(r"^- ``([a-z_/]+)``", re.M)


def mapped(room: str) -> list[str]:
    """The entries of ``room``'s list in the map, as written (``inventory/``, ``engine``)."""
    text = actors.__doc__ or ""
    start = text.index(f"(``actors/{room}``")
    after = text.find("\n\n\n", start)
    part = text[start:] if after < 0 else text[start:after]
    block = part.split("\n\n", 1)[1].split("\n\n", 1)[0]
    return ENTRY.findall(block)


def entry_of(actor: Actor, room: str) -> str:
    """How the map names ``actor``: its module below the room, a package's ``actor``
    module as the package (``inventory/``)."""
    parts = type(actor).__module__.split(".")[2:]
    assert type(actor).__module__.startswith(f"actors.{room}."), type(actor).__module__
    if parts[-1] == "actor":
        return "/".join(parts[:-1]) + "/"
    return "/".join(parts)


def test_the_node_list_is_the_node_agents_actors(bus: NatsBus, tmp_path: Path) -> None:
    """Every actor node/agent.py starts is in the map's node list, once, and the list
    names no other."""
    config = agent_config("nats://127.0.0.1:1", "fleet", tmp_path)
    signing.load_or_create_key_file(config.key_path)
    started = [entry_of(actor, "node") for actor in NodeAgent(config).build_actors(bus)]
    assert sorted(started) == sorted(mapped("node"))
    assert len(started) == len(set(started))


def test_the_fleet_list_is_the_fleet_process_actors(bus: NatsBus, tmp_path: Path) -> None:
    """Every actor fleet/process.py can start (every optional one configured) is in the
    map's fleet list, the aggregator first, and the list names no other."""
    signing.create_key_file(tmp_path / "operator.nk")
    key_file = str(tmp_path / "operator.nk")
    config = AggregatorConfig(
        http_port=0,
        dashboard=True,
        alertmanager_urls=["http://127.0.0.1:9093"],
        workloads_key_file=key_file,
    )
    policy = PolicyConfig(key_file=key_file)
    supervisor = ProviderActors(config, bus, AggregatorMetrics(), policy).supervisor
    started = [entry_of(actor, "fleet") for actor in supervisor.actors]
    assert started[0] == mapped("fleet")[0] == "aggregator/"
    assert sorted(started) == sorted(mapped("fleet"))
    assert len(started) == len(set(started))
