"""``fleetctl maintenance start|list|end`` as an operator types them, against an aggregator
that trusts the operator key."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import aiohttp
import msgspec

from actors.fleet.metrics import AggregatorMetrics
from actors.fleet.operator.maintenance import MaintenanceActor
from schemas import signing
from tests.support.fleet import Fleet, new_aggregator, new_fleet_api, wait_record


def fleetctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "actors.cli.fleetctl", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "NO_COLOR": "1"},
    )


async def test_start_list_end_a_window(fleet: Fleet, tmp_path: Path) -> None:
    """start prints the window's id and end (and, with --drain, that placed replicas move
    off its nodes: the window carries drain); list shows it in force, then (with --all)
    ended; a start naming no nodes and a window over 30 days are one-line errors."""
    key_file = tmp_path / "operator.nk"
    operator = signing.create_key_file(key_file)
    config = msgspec.structs.replace(
        new_aggregator(fleet.bus, fleet.prefix).config, trust_operators=[operator.public_key]
    )
    await fleet.start_supervisor(MaintenanceActor(config, fleet.bus))
    where = ("--server", fleet.url, "--prefix", fleet.prefix)
    signed = (*where, "--key-file", str(key_file))

    started = await asyncio.to_thread(
        fleetctl, "maintenance", "start", "-l", "rack=r12", "--for", "2h",
        "--reason", "PSU swap", "--id", "r12-psu", "--drain", *signed,
    )  # fmt: skip
    assert started.returncode == 0, started.stderr
    assert started.stdout.startswith("maintenance r12-psu started: until ")
    assert "rack=r12" in started.stdout and "placed replicas move off its nodes" in started.stdout

    listed = await asyncio.to_thread(fleetctl, "maintenance", "list", *where)
    assert listed.returncode == 0 and "r12-psu" in listed.stdout and "in force" in listed.stdout
    assert "PSU swap" in listed.stdout

    ended = await asyncio.to_thread(fleetctl, "maintenance", "end", "r12-psu", *signed)
    assert ended.returncode == 0 and ended.stdout == "maintenance r12-psu ended\n"
    again = await asyncio.to_thread(fleetctl, "maintenance", "end", "r12-psu", *signed)
    assert again.returncode == 1 and "ended already" in again.stderr

    none = await asyncio.to_thread(fleetctl, "maintenance", "list", *where)
    assert none.stdout == "no maintenance windows in force\n"
    everything = await asyncio.to_thread(fleetctl, "maintenance", "list", "--all", "--json", *where)
    (window,) = json.loads(everything.stdout)
    assert window["id"] == "r12-psu" and window["by"] == operator.public_key
    assert window["drain"] is True

    unnamed = await asyncio.to_thread(fleetctl, "maintenance", "start", "--for", "1h", *signed)
    assert unnamed.returncode == 1
    assert unnamed.stderr == "error: name the nodes: -l KEY=VALUE (repeatable) and/or --node NODE\n"
    too_long = await asyncio.to_thread(
        fleetctl, "maintenance", "start", "--node", "n1", "--for", "31d", *signed
    )
    assert too_long.returncode == 2 and "at most 30 days" in too_long.stderr
    assert "Traceback" not in unnamed.stderr + too_long.stderr


async def test_every_view_says_maintenance(fleet: Fleet, tmp_path: Path) -> None:
    """A node a window covers shows `maintenance` in `fleetctl nodes` (STATE), its JSON and
    `describe`, and in the fleet API's answer; a node outside it does not."""
    key_file = tmp_path / "operator.nk"
    operator = signing.create_key_file(key_file)
    aggregator = new_aggregator(fleet.bus, fleet.prefix, trust_operators=[operator.public_key])
    metrics = aggregator.metrics
    assert isinstance(metrics, AggregatorMetrics)
    api = new_fleet_api(fleet.bus, fleet.prefix, metrics, live=aggregator.view)
    await fleet.start_supervisor(aggregator, api, MaintenanceActor(aggregator.config, fleet.bus))
    await fleet.start_agent(fleet.config("n1", labels={"rack": "r12"}))
    await fleet.start_agent(fleet.config("n2", labels={"rack": "r13"}))
    for node in ("n1", "n2"):
        await wait_record(fleet.bus, fleet.prefix, node, lambda r: r.state == "active", 30)
    where = ("--server", fleet.url, "--prefix", fleet.prefix)
    started = await asyncio.to_thread(
        fleetctl, "maintenance", "start", "-l", "rack=r12", "--for", "1h", "--id", "r12",
        "--key-file", str(key_file), *where,
    )  # fmt: skip
    assert started.returncode == 0, started.stderr

    table = await asyncio.to_thread(fleetctl, "nodes", *where)
    states = {line.split()[0]: line.split()[2] for line in table.stdout.splitlines()[1:] if line}
    assert states["n1"] == "active,maintenance" and states["n2"] == "active"
    listed = await asyncio.to_thread(fleetctl, "nodes", "-o", "json", *where)
    by_node = {item["node_id"]: item for item in json.loads(listed.stdout)}
    assert by_node["n1"]["maintenance"] == "r12" and by_node["n2"]["maintenance"] == ""
    described = await asyncio.to_thread(fleetctl, "describe", "n1", *where)
    assert "Maintenance:     window r12:" in described.stdout
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://127.0.0.1:{api.port}/nodes/n1") as answer:
            assert (await answer.json())["maintenance"] == "r12"
