"""fleetctl gpus: every GPU of the fleet in one table, filtered, sorted and as JSON, read
from the records in fleet_nodes with a plain client's view of the same records."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import msgspec

from actors.cli.fleetctl import gpus
from actors.runtime.bus import NatsBus
from schemas import codec
from schemas.events import Gpu, Sample, XidCount
from schemas.messages import NodeRecord, WorkloadSummary
from schemas.subjects import BUCKET_NODES, Subjects
from tests.cli.test_describe_host import CAPACITY
from tests.support.fleet import Fleet, heartbeat

GIB = 2**30


def gpu(index: int, temperature: float, **changes: object) -> Gpu:
    """An H100 reading ``temperature`` C, 10 GiB of 80 used, 300/700 W, 50 % busy."""
    values: dict[str, object] = {
        "index": index,
        "uuid": f"GPU-{index}",
        "name": "NVIDIA H100 80GB HBM3",
        "pci_bus_id": f"0000:0{index}:00.0",
        "memory_total": 80 * GIB,
        "memory_used": 10 * GIB,
        "temperature_c": temperature,
        "power_w": 300.0,
        "power_limit_w": 700.0,
        "utilization_pct": 50.0,
        "ecc_corrected": 0,
        "ecc_uncorrected": 0,
    }
    return Gpu(**(values | changes))  # type: ignore[arg-type]


def record(node: str, state: str, cluster: str, gpu_list: list[Gpu], **beat: object) -> NodeRecord:
    sample = Sample(ts=time.time(), capacity=CAPACITY, gpus=gpu_list, gpu_source="nvml")
    return NodeRecord(
        node_id=node,
        cluster=cluster,
        state=state,
        last_seq=1,
        last_seen=time.time(),
        heartbeat=msgspec.structs.replace(heartbeat(node, sample=sample, cluster=cluster), **beat),
        labels={"zone": "a"} if node == "a1" else {},
    )


FLEET = [
    record(
        "a1",
        "active",
        "c1",
        [
            gpu(0, 40.0),
            gpu(1, 85.0, xids=[XidCount(code=79, count=2, last_at=1.0)], ecc_uncorrected=3),
        ],
        workloads=[
            WorkloadSummary(
                name="llama", engine="llamacpp", state="ready", since=1.0, port=1, gpus=[1]
            ),
            WorkloadSummary(
                name="old", engine="vllm", state="stopped", since=1.0, port=2, gpus=[0]
            ),
        ],
    ),
    record("b1", "stale", "c1", [gpu(0, 90.0)]),
    record("c1", "active", "c2", [gpu(0, 60.0, lost=True, temperature_c=None)]),
    record("gone", "deregistered", "c1", [gpu(0, 30.0)]),
]


async def put(bus: NatsBus, prefix: str) -> None:
    bucket = await bus.kv(Subjects(prefix).bucket_name(BUCKET_NODES))
    for one in FLEET:
        await bucket.put(one.node_id, codec.encode(one))


async def fleetctl(fleet: Fleet, *args: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "actors.cli.fleetctl", *args),
        *("--server", fleet.url, "--prefix", fleet.prefix),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    stdout, stderr = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode is not None
    return process.returncode, stdout.decode(), stderr.decode()


async def test_table_of_every_gpu(fleet: Fleet, bus: NatsBus, prefix: str) -> None:
    """One row per GPU in node order: readings, ECC, XIDs and the workload holding it; a
    stale node's readings unknown, a lost GPU marked, a forgotten node left out."""
    await put(bus, prefix)
    code, out, err = await fleetctl(fleet, "gpus")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split() == list(gpus.COLUMNS)
    assert [line.split()[:2] for line in lines[1:]] == [
        ["a1", "0"],
        ["a1", "1"],
        ["b1", "0"],
        ["c1", "0"],
    ]
    assert lines[2].split()[-5:] == ["300/700W", "50%", "0/3", "79x2", "llama"]
    assert "85C" in lines[2] and "10.0/80.0 GiB" in lines[2]
    assert lines[1].split()[-1] == "-"  # a stopped workload holds nothing
    assert lines[3].endswith("(node stale)") and "-/80.0 GiB" in lines[3]
    assert " 90C" not in lines[3]
    assert "LOST" in lines[4]
    assert "gone" not in out


async def test_filters_sort_and_json(fleet: Fleet, bus: NatsBus, prefix: str) -> None:
    """--cluster, --node and -l narrow; --sort temp puts the hottest first and unknown
    readings last; -o json is one object per GPU with null for what is not known."""
    await put(bus, prefix)
    code, out, _ = await fleetctl(fleet, "gpus", "--cluster", "c2")
    assert code == 0 and [line.split()[0] for line in out.splitlines()[1:]] == ["c1"]
    code, out, _ = await fleetctl(fleet, "gpus", "--node", "a1", "--node", "b1", "-o", "json")
    rows = [json.loads(line) for line in out.splitlines()]
    assert [(row["node"], row["index"]) for row in rows] == [("a1", 0), ("a1", 1), ("b1", 0)]
    assert rows[1]["workloads"] == ["llama"] and rows[1]["xids"] == {"79": 2}
    assert rows[2]["state"] == "stale" and rows[2]["temperature_c"] is None
    code, out, _ = await fleetctl(fleet, "gpus", "-l", "zone=a", "--sort", "temp")
    assert [line.split()[:2] for line in out.splitlines()[1:]] == [["a1", "1"], ["a1", "0"]]
    code, out, _ = await fleetctl(fleet, "gpus", "--sort", "temp", "-o", "json")
    order = [(row["node"], row["temperature_c"]) for row in map(json.loads, out.splitlines())]
    assert order == [("a1", 85.0), ("a1", 40.0), ("b1", None), ("c1", None)]


async def test_no_gpus_is_said(fleet: Fleet, bus: NatsBus, prefix: str) -> None:
    """A selection with no GPUs says so on stderr and exits 0 with nothing on stdout."""
    code, out, err = await fleetctl(fleet, "gpus", "--cluster", "nowhere")
    assert (code, out) == (0, "")
    assert err == "no GPUs reported by the nodes chosen\n"
