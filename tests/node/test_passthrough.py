"""Passthrough GPUs: NVIDIA GPUs bound to vfio-pci, found on a fake sysfs PCI bus beside
the one NVML reads (the recorded H100), counted in the node's identity, never
health-checked nor given to workloads."""

from __future__ import annotations

import os
from pathlib import Path

import aiohttp
import pytest

from actors.node.health.actor import HealthActor
from actors.node.inventory import nvml_gpus
from actors.node.inventory.actor import InventoryActor, read_identity
from actors.node.inventory.nvml_gpus import NvmlGpus
from actors.node.inventory.pci import passthrough_gpus
from actors.node.labels import found_labels
from actors.node.workloads.admission import admit
from actors.runtime.bus import NatsBus
from schemas import codec
from schemas.inventory import NodeInventory
from schemas.pci import PassthroughGpu
from schemas.workloads import Deploy
from tests.support.fleet import Fleet, agent_config, wait_record
from tests.support.nvml import RecordedNvml

NVIDIA_BUS = "0000:3b:00.0"
"""Where the recorded H100 NVML reads sits (RecordedNvml(1): bus 3B)."""
VFIO_BUS = "0000:3c:00.0"


def pci_device(
    root: Path, address: str, vendor: str, device: str, pci_class: str, driver: str = ""
) -> None:
    """One device as sysfs shows it: a directory of attributes and, when bound, a
    ``driver`` link into /sys/bus/pci/drivers (made relative, as the kernel does)."""
    path = root / "bus" / "pci" / "devices" / address
    path.mkdir(parents=True)
    (path / "vendor").write_text(f"{vendor}\n")
    (path / "device").write_text(f"{device}\n")
    (path / "class").write_text(f"{pci_class}\n")
    if driver:
        target = root / "bus" / "pci" / "drivers" / driver
        target.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(target, path), path / "driver")


def fake_sysfs(root: Path) -> Path:
    """An H100 bound to nvidia, an H100 bound to vfio-pci (IOMMU group 42) with its audio
    function bound to vfio-pci too, an unbound NVIDIA GPU and a NIC bound to vfio-pci."""
    pci_device(root, NVIDIA_BUS, "0x10de", "0x2330", "0x030200", "nvidia")
    pci_device(root, VFIO_BUS, "0x10de", "0x2330", "0x030200", "vfio-pci")
    groups = root / "kernel" / "iommu_groups" / "42"
    groups.mkdir(parents=True)
    vfio = root / "bus" / "pci" / "devices" / VFIO_BUS
    os.symlink(os.path.relpath(groups, vfio), vfio / "iommu_group")
    pci_device(root, "0000:3c:00.1", "0x10de", "0x22a3", "0x040300", "vfio-pci")
    pci_device(root, "0000:3d:00.0", "0x10de", "0x2330", "0x030200")
    pci_device(root, "0000:5e:00.0", "0x8086", "0x1593", "0x020000", "vfio-pci")
    return root


def test_only_nvidia_gpus_bound_to_vfio_are_passthrough(tmp_path: Path) -> None:
    """Of the fake bus, only the GPU bound to vfio-pci is found: its address, device id,
    product name and IOMMU group; not the nvidia-bound GPU (NVML's), the unbound one, the
    GPU's audio function or another vendor's device; no sysfs, or "", finds none."""
    root = fake_sysfs(tmp_path / "sys")
    assert passthrough_gpus(str(root)) == [
        PassthroughGpu(
            pci_bus_id=VFIO_BUS,
            device_id="0x2330",
            name="NVIDIA H100 80GB HBM3",
            driver="vfio-pci",
            iommu_group="42",
        )
    ]
    assert passthrough_gpus(str(tmp_path / "absent")) == []
    assert passthrough_gpus("") == []


def test_a_passthrough_gpu_is_counted_not_checked_nor_given(tmp_path: Path) -> None:
    """With NVML reading the nvidia-bound H100 and the vfio-bound one on the bus: the
    sample has 1 GPU and 1 passthrough GPU; the node's labels count both (gpu.count 2,
    gpu.passthrough 1); health checks judge the one NVML GPU; a deploy on GPU 1 is
    refused (the workloads get only NVML's GPUs)."""
    root = fake_sysfs(tmp_path / "sys")
    config = agent_config("nats://127.0.0.1:1", "t", tmp_path, fake_gpus=None, sysfs_root=str(root))
    actor = InventoryActor(config, None, None, NvmlGpus(nvml=RecordedNvml(1)))  # type: ignore[arg-type]
    sample = actor.sample()
    assert codec.decode(codec.encode(sample), type(sample)) == sample
    assert [gpu.pci_bus_id for gpu in sample.gpus] == ["00000000:3B:00.0"]
    assert [gpu.pci_bus_id for gpu in sample.passthrough_gpus] == [VFIO_BUS]
    assert (sample.capacity.gpus_total, sample.capacity.gpus_available) == (1, 1)
    labels = found_labels(sample, {})
    assert labels["gpu.count"] == "2" and labels["gpu.passthrough"] == "1"
    assert labels["gpu.product"] == "NVIDIA-H100-80GB-HBM3" and labels["gpu.memory"] == "81559"
    assert labels["driver"] == "580.159.04"
    health = HealthActor(config, None, None)  # type: ignore[arg-type]
    health.observe_sample(sample)
    assert health.sample_checks["nvml"].reason == "1 GPUs answer nvml queries"
    deploy = Deploy(name="vm-gpu", engine="llamacpp", model="/m.gguf", gpus=[1])
    refusal = admit(deploy, {}, {gpu.index for gpu in sample.gpus}).refusal
    assert refusal == "no GPU 1 on this node (it has 0)"


def test_simulated_gpus_search_no_pci_bus(tmp_path: Path) -> None:
    """fake_gpus set: the host's PCI bus is not searched, so a simulated node never shows
    the GPUs its host gives to VMs."""
    root = fake_sysfs(tmp_path / "sys")
    config = agent_config("nats://127.0.0.1:1", "t", tmp_path, sysfs_root=str(root))
    sample = InventoryActor(config, None, None).sample()  # type: ignore[arg-type]
    assert len(sample.gpus) == 2 and sample.passthrough_gpus == []


async def test_a_vfio_only_host_reports_its_gpus_in_heartbeat_and_inventory(
    fleet: Fleet, bus: NatsBus, prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A host whose GPUs all go to VMs (its NVML sees none): its record's labels say
    gpu.count 1, gpu.passthrough 1 and the product, /v1/node/inventory lists the
    passthrough GPU, and its registration's identity counts it."""
    monkeypatch.setattr(nvml_gpus, "pynvml", RecordedNvml(0))
    root = fake_sysfs(tmp_path / "sys")
    await fleet.start_aggregator()
    config = fleet.config(fake_gpus=None, sysfs_root=str(root))
    agent = await fleet.start_agent(config)
    record = await wait_record(bus, prefix, "n1", lambda r: "gpu.count" in r.labels)
    assert record.gpus_total == 0
    assert {key: record.labels[key] for key in ("gpu.count", "gpu.passthrough")} == {
        "gpu.count": "1",
        "gpu.passthrough": "1",
    }
    assert record.labels["gpu.product"] == "NVIDIA-H100-80GB-HBM3"
    assert agent.supervisor is not None
    port = (Path(config.state_dir) / "http.port").read_text().strip()
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session,
        session.get(f"http://127.0.0.1:{port}/v1/node/inventory") as response,
    ):
        assert response.status == 200
        inventory = codec.decode(await response.read(), NodeInventory)
    assert inventory.sample is not None
    assert [gpu.pci_bus_id for gpu in inventory.sample.passthrough_gpus] == [VFIO_BUS]
    identity = await read_identity(config)
    assert (identity.gpu_count, identity.gpu_passthrough, identity.gpus) == (1, 1, [])
    assert identity.gpu_product == "NVIDIA H100 80GB HBM3"
