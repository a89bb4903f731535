"""Host facts in every sample: host uptime, memory used %, CPU model, mean GPU
utilization, the storage path measured, and dependency versions from ``--version`` (run
under a timeout, off the sample path, cached)."""

from __future__ import annotations

import asyncio
import os
import socket
import time
from pathlib import Path

import msgspec
import pytest
from nats.aio.msg import Msg

from actors.node.inventory.actor import (
    InventoryActor,
    cpu_model,
    idle_cores,
    mean_utilization,
    read_identity,
)
from actors.node.inventory.fake_gpus import FakeGpus
from actors.node.inventory.versions import read_versions, version_of
from schemas import codec
from schemas.events import Gpu, Inject, Sample
from schemas.messages import Heartbeat
from schemas.subjects import Subjects
from tests.support.fleet import Fleet, agent_config, wait_for


def program(directory: Path, name: str, body: str) -> Path:
    """An executable shell script ``name`` in ``directory``."""
    path = directory / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return path


async def test_versions_of_programs_that_answer(tmp_path: Path) -> None:
    """Answering programs give their first line (stdout, else stderr); absent, failing and
    hanging ones are left out, the hanging one within the timeout."""
    program(tmp_path, "docker", 'echo ""; echo "Docker version 27.1.1, build 6312585"')
    program(tmp_path, "slurmd", 'echo "slurm 23.02.7" >&2')
    program(tmp_path, "podman", "echo broken; exit 3")
    program(tmp_path, "nvidia-smi", "sleep 30")
    path = str(tmp_path)
    started = time.monotonic()
    # 2 s: ample for a loaded machine to start a shell script, far below the 30 s hang.
    found = await read_versions(["nvidia-smi", "slurmd", "docker", "podman", "absent"], 2.0, path)
    assert time.monotonic() - started < 10  # the hanging one killed at its timeout
    assert [(dep.name, dep.version) for dep in found] == [
        ("slurmd", "slurm 23.02.7"),
        ("docker", "Docker version 27.1.1, build 6312585"),
    ]
    assert await version_of("absent", 2.0, path) is None


def test_cpu_model_from_cpuinfo(tmp_path: Path) -> None:
    """x86 ``model name`` and Arm ``Model`` lines name the CPU; without either, something."""
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nmodel name\t: AMD EPYC  9654 96-Core Processor\n")
    assert cpu_model(x86) == "AMD EPYC 9654 96-Core Processor"
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nBogoMIPS\t: 2000.00\n\nModel\t: NVIDIA Grace\n")
    assert cpu_model(arm) == "NVIDIA Grace"
    assert cpu_model(tmp_path / "missing") != ""


def test_mean_gpu_utilization_skips_lost_and_silent() -> None:
    """The node's GPU utilization is the mean over GPUs that report one."""

    def gpu(index: int, utilization: float | None, lost: bool = False) -> Gpu:
        return Gpu(
            index=index,
            uuid=f"u{index}",
            name="g",
            pci_bus_id="p",
            memory_total=1,
            memory_used=0,
            utilization_pct=utilization,
            lost=lost,
        )

    assert mean_utilization([gpu(0, 30.0), gpu(1, 60.0), gpu(2, None), gpu(3, 99.0, True)]) == 45
    assert mean_utilization([gpu(0, None)]) is None and mean_utilization([]) is None


def test_sample_carries_host_facts(tmp_path: Path) -> None:
    """A sample reports uptime, memory used %, CPU model, mean GPU utilization and the
    configured storage path with its use; capacity measures that same path."""
    storage = tmp_path / "models"
    storage.mkdir()
    config = agent_config("nats://127.0.0.1:1", "t", tmp_path, storage_path=str(storage))
    gpus = FakeGpus(2, "n1")
    gpus.apply(Inject(ts=1.0, node_id="n1", fault="util", value=70.0))
    actor = InventoryActor(config, None, None, gpus)  # type: ignore[arg-type]
    sample = codec.decode(codec.encode(actor.sample()), Sample)
    host = sample.host
    assert host is not None
    assert host.uptime_s > 0 and 0 < host.memory_used_pct <= 100
    assert host.cpu_model == cpu_model()
    assert host.gpu_utilization_pct == 70.0
    assert host.storage_path == str(storage) and 0 <= host.storage_used_pct <= 100
    assert sample.capacity.storage_total > 0


async def test_heartbeat_reports_dependency_versions(fleet: Fleet, tmp_path: Path) -> None:
    """An agent's heartbeats carry the versions of its configured programs."""
    tool = program(tmp_path, "slurmd", 'echo "slurm 24.05.1"')
    await fleet.start_aggregator()
    beats: list[Heartbeat] = []

    async def collect(msg: Msg) -> None:
        beats.append(codec.decode(msg.data, Heartbeat, msg.subject))

    subscription = await fleet.bus.nc.subscribe(
        Subjects(fleet.prefix).heartbeat("c1", "n1"), cb=collect
    )
    fleet.stack.push_async_callback(subscription.unsubscribe)
    await fleet.bus.flush()
    await fleet.start_agent(fleet.config(version_programs=[str(tool), "no-such-program"]))

    def versions() -> list[tuple[str, str]]:
        for beat in reversed(beats):
            if beat.sample and beat.sample.host and beat.sample.host.dependencies:
                return [(dep.name, dep.version) for dep in beat.sample.host.dependencies]
        return []

    assert await wait_for(versions) == [("slurmd", "slurm 24.05.1")]


async def test_stopping_mid_version_leaves_no_process(tmp_path: Path) -> None:
    """A version read cancelled (the agent stopping) kills and reaps the program's session."""
    marker = tmp_path / "pid"
    program(tmp_path, "slow", f"echo $$ > {marker}; exec sleep 30")
    task = asyncio.create_task(version_of("slow", 30, str(tmp_path)))
    await wait_for(lambda: marker.exists() and marker.read_text().strip())
    pid = int(marker.read_text())
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_storage_path_that_is_not_there_still_samples(tmp_path: Path) -> None:
    """A storage path that cannot be measured reports 0 bytes instead of stopping samples."""
    missing = tmp_path / "not-mounted"
    config = agent_config("nats://127.0.0.1:1", "t", tmp_path, storage_path=str(missing))
    sample = InventoryActor(config, None, None, FakeGpus(1, "n1")).sample()  # type: ignore[arg-type]
    assert sample.capacity.storage_total == 0 and sample.host is not None
    assert sample.host.storage_path == str(missing) and sample.host.storage_used_pct == 0


async def test_the_registration_identity_is_this_hosts_name_and_gpus(tmp_path: Path) -> None:
    """What ``node-agent register`` sends as the node's identity: this host's name and its
    GPUs' uuids (sorted), product and count, as its samples say them; none without GPUs."""
    config = agent_config("nats://127.0.0.1:4222", "p", tmp_path, "n1", fake_gpus=2)
    found = await read_identity(config)
    gpus = FakeGpus(2, "n1").read()
    assert found.hostname == socket.gethostname() and found.gpu_count == 2
    assert found.gpus == sorted(gpu.uuid for gpu in gpus) and found.gpu_product == gpus[0].name
    bare = await read_identity(msgspec.structs.replace(config, fake_gpus=0))
    assert (bare.gpus, bare.gpu_count, bare.gpu_product) == ([], 0, "")


def test_free_cores_are_the_idle_share_rounded_down() -> None:
    """cpu_cores_available from the CPU meter: 64 cores 25 % busy leave 48, 12.5 % busy
    on 8 cores leave 7 (not 7.0 rounded up), a saturated host none."""
    assert idle_cores(64, 25.0) == 48
    assert idle_cores(8, 12.5) == 7
    assert idle_cores(8, 13.0) == 6
    assert idle_cores(8, 100.0) == 0
    assert idle_cores(0, 0.0) == 0
