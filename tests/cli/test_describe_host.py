"""``fleetctl describe`` tells a failing NVML apart from a node without GPUs, and shows
the host facts and dependency versions the node reports."""

from __future__ import annotations

import time

from actors.cli.render import describe
from schemas.events import Capacity, Dependency, HostFacts, Sample

CAPACITY = Capacity(
    cpu_cores=8,
    cpu_percent=1.0,
    load_avg_1m=0.1,
    memory_total=1,
    memory_available=1,
    gpus_total=0,
    gpus_available=0,
    storage_total=1,
    storage_available=1,
)


def test_failing_nvml_is_not_shown_as_no_gpus() -> None:
    """No GPUs because NVML fails reads as that failure, with NVML's words."""
    failing = Sample(
        ts=time.time(), capacity=CAPACITY, gpu_source="nvml", gpu_error="Driver Not Loaded"
    )
    assert describe._gpus(failing) == ["GPUs:            none (nvml fails: Driver Not Loaded)"]
    none = Sample(ts=time.time(), capacity=CAPACITY)
    assert describe._gpus(none) == ["GPUs:            none"]


def test_host_facts_and_versions_lines() -> None:
    """The host's and the agent's uptimes, each named, then memory, mean GPU utilization,
    storage and CPU on one line, versions on the next."""
    host = HostFacts(
        uptime_s=3 * 86400 + 5,
        memory_used_pct=41.6,
        cpu_model="AMD EPYC 9654",
        gpu_utilization_pct=72.4,
        storage_path="/data",
        storage_used_pct=55.0,
        dependencies=[
            Dependency(name="slurmd", version="slurm 23.02.7"),
            Dependency(name="docker", version="Docker version 27.1.1"),
        ],
    )
    assert describe._host(host, 172.0) == [
        "Host uptime:     3d",
        "Agent uptime:    2m",
        "Host:            memory 42% used, GPU util 72% (mean), /data 55% used, CPU AMD EPYC 9654",
        "Versions:        slurm 23.02.7; Docker version 27.1.1",
    ]
    assert describe._host(None) == []
    without_agent = describe._host(host)
    assert without_agent[:2] == ["Host uptime:     3d", without_agent[1]]
    assert without_agent[1].startswith("Host:            memory 42% used")
