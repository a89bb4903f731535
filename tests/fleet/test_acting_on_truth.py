"""Issue 41's done-when as one scenario, every timing setting at its default (checkpoint
every 60 s, workloads grace 60 s and interval 5 s, policy interval 15 s and breaker 10 %):
two aggregator processes, each with its reconciler and remediation policy, eleven
fake-GPU agents (seven can run llama.cpp), one 2-replica placed workload. An operator
kills one replica's node, drains the other's and an XID hits a third (and a fourth that
does not trust the policy's key): every view agrees with ``fleetctl describe``, the
replicas are back on healthy nodes that can run them in time, nothing dead is shown
ready, and the policy cordons exactly the XID node that trusts it."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest

from actors.fleet.config import AggregatorConfig
from actors.fleet.metrics import AggregatorMetrics
from actors.fleet.process import ProviderActors
from actors.fleet.remediation.config import PolicyConfig
from actors.runtime.bus import NatsBus
from actors.runtime.embedded import NatsServer
from schemas import signing
from schemas.messages import Drain
from tests.cli.test_describe_events import fleetctl as plain_fleetctl
from tests.cli.test_fleetctl_commands import finish, fleetctl
from tests.fleet.test_reconciler import (
    DEPLOY,
    HANDOFF_SLACK,
    INTERVAL,
    Traffic,
    placed,
    running,
    said_capabilities,
)
from tests.fleet.test_remediation import inject
from tests.fleet.test_remediation_fleet import record
from tests.support.commanding import Results, send
from tests.support.fleet import HANG, TEST_BUDGETS, Fleet, wait_for, wait_record
from tests.support.workloads import killing_leftovers, standin_script

pytestmark = pytest.mark.slow

DEFAULTS = AggregatorConfig()
CAPABLE = ("a1", "a2", "a3", "a4", "x1", "r1")
"""Nodes with the llama-server stand-in; x1 and r1 get the XID (r1 distrusts the policy)."""
INCAPABLE = ("b1", "b2", "b3", "b4", "b5")
"""Nodes without llama-server: never a replica's home. With the six above, eleven nodes:
the default breaker (10 % of the reporting nodes) allows one hold after one dies."""


@pytest.fixture(autouse=True)
def no_orphans() -> Iterator[None]:
    with killing_leftovers():
        yield


async def provider(fleet: Fleet, bus: NatsBus, tmp_path: Path, http: bool) -> ProviderActors:
    """One aggregator process as ``fleetctl aggregator`` runs it, with its reconciler and
    policy, at the defaults (the test's stream budgets aside: the lease too, where the
    suite's 1.5 s let a starved machine's aggregators take partitions from each other all
    the time); ``http``: its API too."""
    config = msgspec.structs.replace(
        TEST_BUDGETS,
        lease_ttl=DEFAULTS.lease_ttl,
        prefix=fleet.prefix,
        workloads_key_file=str(tmp_path / "reconciler.nk"),
        workloads_operators=[signing.load_key_file(tmp_path / "operator.nk").public_key],
        http_port=0 if http else -1,
        dashboard=False,
    )
    policy = PolicyConfig(key_file=str(tmp_path / "policy.nk"), dry_run=False)
    process = ProviderActors(config, bus, AggregatorMetrics(), policy)
    process.supervisor.start()
    fleet.stack.push_async_callback(process.supervisor.stop)
    assert await process.supervisor.wait_ready(20), "the provider process did not start"
    return process


async def agents(fleet: Fleet, tmp_path: Path, names: tuple[str, ...], **settings: Any) -> None:
    """Agents trusting the operator and reconciler keys (and the policy's, but r1), each
    active and having said what it can run."""
    keys = {
        name: signing.load_key_file(tmp_path / f"{name}.nk").public_key
        for name in ("operator", "reconciler", "policy")
    }
    for name in names:
        trusted = [keys["operator"], keys["reconciler"]]
        trusted += [] if name == "r1" else [keys["policy"]]
        config = fleet.config(
            name, trust_operators=trusted, workload_stop_grace=2.0, shutdown_drain=False,
            **settings,
        )  # fmt: skip
        await fleet.start_agent(config)
    for name in names:
        await wait_record(fleet.bus, fleet.prefix, name, said_capabilities)


async def api_states(port: int) -> dict[str, str]:
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=HANG)) as session,
        session.get(f"http://127.0.0.1:{port}/nodes") as response,
    ):
        assert response.status == 200
        return {item["node_id"]: item["state"] for item in await response.json()}


async def views(fleet: Fleet, port: int) -> dict[str, dict[str, str]]:
    """Each node's state as ``nodes``, ``gpus``, the API and ``describe`` show it."""
    code, lines, err = await plain_fleetctl(fleet, "nodes", "-o", "json")
    assert code == 0, err
    seen: dict[str, dict[str, str]] = {
        "nodes": {item["node_id"]: item["state"] for item in json.loads("\n".join(lines))}
    }
    code, lines, err = await plain_fleetctl(fleet, "gpus", "-o", "json")
    assert code == 0, err
    seen["gpus"] = {row["node"]: row["state"] for row in map(json.loads, lines)}
    seen["api"] = await api_states(port)
    described = {}
    for node in seen["nodes"]:
        code, lines, err = await plain_fleetctl(fleet, "describe", node)
        assert code == 0, err
        [state] = [line.split()[1] for line in lines if line.startswith("State:")]
        described[node] = state
    seen["describe"] = described
    return seen


def agree(seen: dict[str, dict[str, str]]) -> bool:
    """``nodes`` and the API show every node as ``describe`` does, ``gpus`` each it lists."""
    described = seen["describe"]
    return (
        seen["nodes"] == described
        and seen["api"] == described
        and all(described[node] == state for node, state in seen["gpus"].items())
    )


async def agreeing_views(fleet: Fleet, port: int) -> dict[str, dict[str, str]]:
    """:func:`views` once they agree. Read one after another, they can differ while a node
    changes between two reads: on a starved machine an agent's probe comes late, and its
    node is ``degraded`` (probe_freshness) for a beat or two. A view that keeps
    disagreeing fails, with what each showed."""
    seen: dict[str, dict[str, str]] = {}

    async def agreeing() -> bool:
        nonlocal seen
        seen = await views(fleet, port)
        return agree(seen)

    try:
        await wait_for(agreeing, timeout=2 * HANG)
    except AssertionError:
        raise AssertionError(f"the views never agreed: {seen}") from None
    return seen


@pytest.mark.timeout(300)
async def test_kill_drain_and_xid_at_the_defaults_every_view_agrees(
    nats_server: NatsServer, fleet: Fleet, bus: NatsBus, prefix: str, tmp_path: Path
) -> None:
    """Replicas on a1 and a2; r1 then x1 get XID 79 (r1 refuses the policy's key: a
    refused hold, not cordoned, not counted by the default breaker, so x1 is cordoned);
    then a1 is killed and a2 drained.
    a2's replica moves and its old copy is stopped within a heartbeat + 2 s of the new
    one's ready; a1's replica is deployed within the grace + one reconciler interval of
    a1 turning stale; both land on a3 and a4 (healthy, able to run it). Then every view
    shows each node's state as describe does, a1's copy is unknown (never ready, no
    endpoint, no GPU readings), the two ready copies are on a3 and a4, and the only
    cordoned node is x1."""
    operator_file = tmp_path / "operator.nk"
    for name in ("operator", "reconciler", "policy"):
        signing.create_key_file(tmp_path / f"{name}.nk")
    first = await provider(fleet, bus, tmp_path, http=True)
    await provider(fleet, await fleet.connect("aggregator-2"), tmp_path, http=False)
    assert first.http is not None and first.http.port is not None
    script = standin_script(tmp_path / "bin")
    await agents(fleet, tmp_path, ("a1", "a2"), workload_binaries=[f"llamacpp={script}"])
    missing = f"llamacpp={tmp_path / 'nowhere' / 'llama-server'}"
    await agents(fleet, tmp_path, INCAPABLE, workload_binaries=[missing])
    code, out, err = await finish(
        await fleetctl(
            nats_server, prefix, operator_file, "deploy", "chat", *DEPLOY,
            "--replicas", "2", "--wait",
        )
    )  # fmt: skip
    assert code == 0, out + err
    assert sorted(r.node for r in (await placed(bus, prefix, "chat")).replicas) == ["a1", "a2"]
    await agents(fleet, tmp_path, CAPABLE[2:], workload_binaries=[f"llamacpp={script}"])
    # r1 first: its refusal frees the breaker's one slot (10 % of 11) for x1.
    await inject(fleet, "r1", "xid", 79)

    async def refused() -> bool:
        current = await record(bus, prefix)
        hold = current.holds.get("r1") if current is not None else None
        return hold is not None and bool(hold.refused)

    await wait_for(refused)
    await inject(fleet, "x1", "xid", 79)
    await wait_record(bus, prefix, "x1", lambda r: r.state == "cordoned")
    results = await Results().start(bus, prefix)
    traffic = await Traffic().start(bus, prefix)
    killed_at = time.time()
    await fleet.agents["a1"].stop(goodbye=False)  # killed: no goodbye
    drain = await send(bus, prefix, signing.load_key_file(operator_file), Drain(), node="a2")
    stale = await wait_record(bus, prefix, "a1", lambda r: r.state == "stale")
    try:
        for node in ("a3", "a4"):
            await wait_record(
                bus,
                prefix,
                node,
                lambda r: running(r, "chat"),
                timeout=DEFAULTS.workloads_grace + 60,
            )
    except AssertionError:
        where = [(r.index, r.node, r.why) for r in (await placed(bus, prefix, "chat")).replicas]
        answers = [(r.node_id, r.status, r.detail) for r in results.results]
        raise AssertionError(
            f"replicas not ready on a3 and a4: {where}; results {answers}"
        ) from None
    final = await results.final(drain.id)
    assert final.status == "done", final.detail
    # The drained replica: its old copy stopped within a heartbeat of the new one's ready.
    [stop] = traffic.stops("a2")
    [(moved_from_a2, drained_to)] = [
        (c, c.node_id) for c in traffic.deploys() if "a2" in c.reason and "draining" in c.reason
    ]
    ready = traffic.first_beat(drained_to, "chat", frozenset({"ready"}))
    took = stop.issued_at - ready.ts
    bound = INTERVAL + HANDOFF_SLACK
    print(f"a2's old copy stopped {took:.2f}s after the new one was ready (bound {bound:.1f}s)")
    assert took <= bound, f"a2's old copy stopped {took:.2f}s after ready (bound {bound:.1f}s)"
    # The killed node's replica: deployed within the grace + one interval of the stale.
    [(moved_from_a1, killed_to)] = [(c, c.node_id) for c in traffic.deploys() if "a1" in c.reason]
    assert stale.stale_since is not None
    took = moved_from_a1.issued_at - stale.stale_since
    bound = DEFAULTS.workloads_grace + DEFAULTS.workloads_interval + HANDOFF_SLACK
    print(f"a1's replica deployed {took:.2f}s after a1 turned stale (bound {bound:.1f}s)")
    assert took <= bound, f"a1's replica deployed {took:.2f}s after stale (bound {bound:.1f}s)"
    assert {killed_to, drained_to} == {"a3", "a4"} and moved_from_a2.issued_at > 0
    back = traffic.first_beat(killed_to, "chat", frozenset({"ready"})).ts - killed_at
    print(f"a1's replica ready on {killed_to} {back:.2f}s after the kill")
    # Every view says what describe says.
    seen = await agreeing_views(fleet, first.http.port)
    states = seen["describe"]
    assert states["a1"] == "stale" and states["a2"] == "drained" and states["r1"] == "unhealthy"
    assert [node for node, state in states.items() if state == "cordoned"] == ["x1"]
    current = await record(bus, prefix)
    assert current is not None and sorted(current.holds) == ["r1", "x1"]
    assert not current.holds["x1"].refused and current.tripped_at is None
    # Nothing dead is shown ready; the ready copies are where the replicas are.
    code, lines, err = await plain_fleetctl(fleet, "workloads", "--json")
    assert code == 0, err
    rows = [row for row in json.loads("\n".join(lines)) if row["name"] == "chat"]
    shown = {row["node"]: (row["status"], row["endpoint"]) for row in rows}
    assert shown["a1"][0].startswith("unknown (node stale") and shown["a1"][1] == "", shown
    assert {node for node, (status, _) in shown.items() if status == "ready"} == {"a3", "a4"}
    assert all(endpoint for node, (_, endpoint) in shown.items() if node in ("a3", "a4"))
    assert "a2" not in shown, shown
    code, lines, err = await plain_fleetctl(fleet, "gpus", "-o", "json", "--node", "a1")
    assert code == 0, err
    assert all(json.loads(line)["power_w"] is None for line in lines), lines
