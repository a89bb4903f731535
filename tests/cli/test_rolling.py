"""Rolling operations by selector, as an operator runs them: ``fleetctl drain -l KEY=VALUE
--max-unavailable 2`` over 10 labelled agents against a real nats-server."""

from __future__ import annotations

import asyncio
import re
import shutil
import sys
from pathlib import Path

from nats.aio.msg import Msg

from actors.runtime.bus import NatsBus
from actors.runtime.embedded import NatsServer
from schemas import codec, signing
from schemas.messages import FINAL_STATUSES, CommandResult, NodeRecord
from schemas.subjects import BUCKET_NODES, Subjects
from schemas.workloads import Deploy
from tests.support.commanding import Results, send, set_in_flight
from tests.support.fleet import Fleet, wait_for, wait_record
from tests.support.workloads import killing_leftovers

FLEETCTL = str(Path(sys.executable).parent / "fleetctl")
RACK = [f"n{index}" for index in range(10)]


async def fleetctl(server: NatsServer, prefix: str, key: Path, *args: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        FLEETCTL,
        *args,
        "--server",
        server.url,
        "--prefix",
        prefix,
        "--key-file",
        str(key),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 120)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def test_rolling_drain_never_more_than_max_unavailable(
    nats_server: NatsServer, fleet: Fleet, bus: NatsBus, prefix: str, tmp_path: Path
) -> None:
    """--dry-run lists the 10 labelled nodes in order (not the unlabelled one); the rolling
    drain then drains all 10, never more than 2 at once, each waiting for its work to
    finish; run again, it skips them all (the resume); a rolling deploy's dry run lists
    the same nodes."""
    key_file = tmp_path / "operator.nk"
    operator = signing.create_key_file(key_file)
    await fleet.start_aggregator()
    for node in [*RACK, "other"]:
        labels = {"rack": "r7"} if node != "other" else {"rack": "r8"}
        config = fleet.config(
            node, trust_operators=[operator.public_key], labels=labels, fake_gpus=0
        )
        agent = await fleet.start_agent(config)
        assert agent.supervisor is not None and await agent.supervisor.wait_ready(10)
    for node in [*RACK, "other"]:
        await wait_record(bus, prefix, node, lambda r: r.labels.get("rack") is not None)
    code, out, err = await fleetctl(
        nats_server, prefix, key_file, "drain", "-l", "rack=r7", "--dry-run"
    )
    assert code == 0, err
    assert [line.split()[0] for line in out.splitlines()] == sorted(RACK)

    draining: set[str] = set()
    most = 0
    work: list[asyncio.Task[None]] = []

    async def finish_work(node: str) -> None:
        await asyncio.sleep(0.3)
        await set_in_flight(fleet, 0, node)

    async def on_result(msg: Msg) -> None:
        nonlocal most
        signing.verify(msg.headers, msg.data)
        result = codec.decode(msg.data, CommandResult, msg.subject)
        if result.status == "accepted":
            draining.add(result.node_id)
            most = max(most, len(draining))
            work.append(asyncio.create_task(finish_work(result.node_id)))
        elif result.status in FINAL_STATUSES:
            draining.discard(result.node_id)

    await bus.subscribe(Subjects(prefix).results(), on_result)
    await bus.flush()
    for node in RACK:
        # Each node has work in flight: its drain lasts until the work finishes.
        await set_in_flight(fleet, 1, node)
    code, out, err = await fleetctl(
        nats_server,
        prefix,
        key_file,
        "drain",
        "-l",
        "rack=r7",
        "--max-unavailable",
        "2",
        "--deadline",
        "30",
    )
    assert code == 0, err + out
    assert most == 2
    assert out.count(": done: drained") == 10
    for node in RACK:
        await wait_record(bus, prefix, node, lambda r: r.schedulability == "drained")
    other = await wait_record(bus, prefix, "other", lambda r: True)
    assert other.schedulability == "schedulable"
    code, out, err = await fleetctl(nats_server, prefix, key_file, "drain", "-l", "rack=r7")
    assert code == 0, err
    assert "0 nodes" in out and "10 already done" in out
    await asyncio.gather(*work)
    code, out, err = await fleetctl(
        nats_server,
        prefix,
        key_file,
        "deploy",
        "-l",
        "rack=r7",
        "llm",
        "--engine",
        "vllm",
        "--dry-run",
    )
    assert code == 0, err
    assert [line.split()[0] for line in out.splitlines()] == sorted(RACK)


async def test_rolling_needs_a_node_or_a_selector(
    nats_server: NatsServer, bus: NatsBus, prefix: str, tmp_path: Path
) -> None:
    """cordon with neither a node nor -l (or both) is a one-line usage error; a selector no
    node matches is one line too. deploy with neither is a placed deploy (docs/commands.md,
    "Placed workloads"): with no node in the fleet its replica is pending."""
    key_file = tmp_path / "operator.nk"
    signing.create_key_file(key_file)
    code, _, err = await fleetctl(nats_server, prefix, key_file, "cordon")
    assert code == 2 and err.startswith("error: a node id (node-1, or a list: node[1-4],gpu-a)")
    code, out, err = await fleetctl(
        nats_server, prefix, key_file, "deploy", "llm", "--engine", "vllm"
    )
    assert code == 0 and out.startswith("replica 0: pending"), out + err
    code, _, err = await fleetctl(nats_server, prefix, key_file, "cordon", "n1", "-l", "a=b")
    assert code == 2 and "not both" in err
    code, _, err = await fleetctl(nats_server, prefix, key_file, "cordon", "-l", "rack=none")
    assert code == 1 and "no node matches -l rack=none" in err and "Traceback" not in err


async def test_node_lists_ranges_and_a_cluster_select_a_rolling_operation(
    nats_server: NatsServer, bus: NatsBus, prefix: str, tmp_path: Path
) -> None:
    """A node list with a range (n[1-3],gpu-a) and --cluster alone select a rolling
    cordon (its dry run lists them in order); a listed node the fleet does not know is
    one line with a did-you-mean."""
    key_file = tmp_path / "operator.nk"
    signing.create_key_file(key_file)
    bucket = await bus.kv(Subjects(prefix).bucket_name(BUCKET_NODES))
    placed = {"n1": "c1", "n2": "c1", "n3": "c2", "n4": "c2", "gpu-a": "c1"}
    for node, cluster in placed.items():
        record = NodeRecord(
            node_id=node, cluster=cluster, state="active", last_seq=1, last_seen=1.0
        )
        await bucket.put(node, codec.encode(record))

    async def dry_run(*args: str) -> list[str]:
        code, out, err = await fleetctl(nats_server, prefix, key_file, "cordon", *args, "--dry-run")
        assert code == 0, err
        return [line.split()[0] for line in out.splitlines()]

    assert await dry_run("n[1-3],gpu-a") == ["gpu-a", "n1", "n2", "n3"]
    assert await dry_run("--cluster", "c2") == ["n3", "n4"]
    assert await dry_run("n[1-4]", "--cluster", "c1") == ["n1", "n2"]
    code, _, err = await fleetctl(nats_server, prefix, key_file, "cordon", "n[1-2],gpu-b")
    assert code == 1 and "no such node" in err and "gpu-b (did you mean gpu-a?)" in err


async def test_rolling_drain_with_placed_work_not_moved_says_so_and_exits_3(
    nats_server: NatsServer, fleet: Fleet, bus: NatsBus, prefix: str, tmp_path: Path
) -> None:
    """Two nodes drained with --continue, n2 running a placed workload nobody moves (no
    reconciler): each result is printed with the time and node; one summary line says
    both drained, one with placed work not moved; exit 3, not 0."""
    key_file = tmp_path / "operator.nk"
    operator = signing.create_key_file(key_file)
    sleep = shutil.which("sleep")
    assert sleep is not None
    await fleet.start_aggregator()
    results = await Results().start(bus, prefix)
    for node in ("n1", "n2"):
        config = fleet.config(
            node,
            trust_operators=[operator.public_key],
            labels={"rack": "r9"},
            fake_gpus=0,
            workload_engines=["process"],
            workload_binaries=[sleep],
        )
        agent = await fleet.start_agent(config)
        assert agent.supervisor is not None and await agent.supervisor.wait_ready(10)
        await wait_record(bus, prefix, node, lambda r: r.labels.get("rack") == "r9")
    with killing_leftovers():
        deploy = Deploy(name="chat", engine="process", args=[sleep, "600"], placed=True)
        command = await send(bus, prefix, operator, deploy, node="n2")
        await wait_for(lambda: "accepted" in results.statuses(command.id))
        code, out, err = await fleetctl(
            nats_server, prefix, key_file, "drain", "-l", "rack=r9", "--deadline", "2",
            "--continue",
        )  # fmt: skip
    assert code == 3, (out, err)
    stamped = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ (n1|n2): ")
    progress = out.splitlines()[1:]
    assert progress and all(stamped.match(line) for line in progress), out
    assert any("n2: done: drained; 1 placed workloads not moved" in line for line in progress)
    assert err.splitlines() == [
        "error: rolling drain -l rack=r9: 2 of 2 drained, 1 with placed work not moved by "
        "the deadline (n2)"
    ]


async def test_identity_labels_select_a_rolling_drain(
    nats_server: NatsServer, fleet: Fleet, bus: NatsBus, prefix: str, tmp_path: Path
) -> None:
    """Agents given no labels at all (as under fleetctl up) carry their own: a rolling
    drain -l gpu.count=8 --max-unavailable 1 drains the two 8-GPU nodes one at a time and
    leaves the 4-GPU one; nodes -l gpu.product=... lists all three."""
    key_file = tmp_path / "operator.nk"
    operator = signing.create_key_file(key_file)
    await fleet.start_aggregator()
    sizes = {"big1": 8, "big2": 8, "small": 4}
    for node, gpus in sizes.items():
        config = fleet.config(node, trust_operators=[operator.public_key], fake_gpus=gpus)
        assert config.labels == {}
        await fleet.start_agent(config)
    for node, gpus in sizes.items():
        record = await wait_record(bus, prefix, node, lambda r: "gpu.count" in r.labels)
        assert record.labels["gpu.count"] == str(gpus)
    draining: set[str] = set()
    most = 0

    async def on_result(msg: Msg) -> None:
        nonlocal most
        result = codec.decode(msg.data, CommandResult, msg.subject)
        if result.status == "accepted":
            draining.add(result.node_id)
            most = max(most, len(draining))
        elif result.status in FINAL_STATUSES:
            draining.discard(result.node_id)

    await bus.subscribe(Subjects(prefix).results(), on_result)
    await bus.flush()
    code, out, err = await fleetctl(
        nats_server, prefix, key_file, "drain", "-l", "gpu.count=8", "--max-unavailable", "1"
    )
    assert code == 0, err + out
    assert out.count(": done: drained") == 2 and most == 1
    for node in ("big1", "big2"):
        await wait_record(bus, prefix, node, lambda r: r.schedulability == "drained")
    small = await wait_record(bus, prefix, "small", lambda r: True)
    assert small.schedulability == "schedulable"
    listing = await asyncio.create_subprocess_exec(
        FLEETCTL,
        "nodes",
        "-l",
        "gpu.product=NVIDIA-H100-80GB-HBM3",
        "-l",
        "gpu.memory=81559",
        "--server",
        nats_server.url,
        "--prefix",
        prefix,
        stdout=asyncio.subprocess.PIPE,
    )
    out_bytes, _ = await asyncio.wait_for(listing.communicate(), 60)
    rows = out_bytes.decode().splitlines()[1:4]
    assert listing.returncode == 0 and [row.split()[0] for row in rows] == sorted(sizes)
