"""NVIDIA GPUs on the PCI bus, read from sysfs: the passthrough GPUs NVML cannot see.

Under ``<sysfs_root>/bus/pci/devices`` every device is a directory with its ``vendor``
(``0x10de`` for NVIDIA), ``device``, ``class`` (``0x0300..``: VGA, ``0x0302..``: 3D
controller) and, when a driver holds it, a ``driver`` link whose target's name is the
driver's. A GPU bound to ``vfio-pci`` belongs to the virtual machines it is given to:
the host's NVML never sees it, so it is found here, reported in the sample's
``passthrough_gpus`` and counted in the node's identity, and nothing else (no NVML health,
no workloads). GPUs bound to ``nvidia`` are NVML's; those bound to no driver, or another
one (``nouveau``), are left out.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from schemas.base import MAX_GPUS, MAX_NAME
from schemas.pci import PassthroughGpu

log = logging.getLogger(__name__)

NVIDIA_VENDOR = "0x10de"
GPU_CLASSES = ("0x0300", "0x0302")
"""PCI class and subclass of a display controller: VGA compatible, 3D controller."""
PASSTHROUGH_DRIVER = "vfio-pci"
READ_LIMIT = 64
"""Bytes read of a sysfs attribute (each is one short line)."""
DEVICES = "bus/pci/devices"

PRODUCTS: dict[str, str] = {
    "0x2330": "NVIDIA H100 80GB HBM3",
    "0x2331": "NVIDIA H100 PCIe",
    "0x2321": "NVIDIA H100 NVL",
    "0x2335": "NVIDIA H200",
    "0x20b0": "NVIDIA A100-SXM4-40GB",
    "0x20b2": "NVIDIA A100-SXM4-80GB",
    "0x20f1": "NVIDIA A100-PCIE-40GB",
    "0x20b5": "NVIDIA A100 80GB PCIe",
    "0x26b9": "NVIDIA L40S",
    "0x26b5": "NVIDIA L40",
    "0x27b8": "NVIDIA L4",
    "0x2236": "NVIDIA A10",
    "0x1eb8": "Tesla T4",
}
"""NVML's product names of the data-centre GPUs' PCI device ids (``0x2330`` is the H100
recorded in tests/support/data: ``pciDeviceId`` 0x233010DE). An id not here is reported
by its id alone."""


def _read(path: Path) -> str:
    """One sysfs attribute, stripped and lower-cased; "" when it cannot be read."""
    try:
        with path.open("rb") as handle:
            return handle.read(READ_LIMIT).decode("ascii", "replace").strip().lower()
    except OSError:
        return ""


def _link_name(path: Path) -> str:
    """The last part of a symbolic link's target (a driver, an IOMMU group); "" if none."""
    try:
        return os.path.basename(os.readlink(path))[:MAX_NAME]
    except OSError:
        return ""


def passthrough_gpus(sysfs_root: str) -> list[PassthroughGpu]:
    """The NVIDIA GPUs bound to ``vfio-pci`` under ``sysfs_root`` (in PCI address order, at
    most MAX_GPUS); none when ``sysfs_root`` is "" or shows no PCI bus."""
    if not sysfs_root:
        return []
    devices = Path(sysfs_root) / DEVICES
    try:
        addresses = sorted(os.listdir(devices))
    except OSError:
        return []
    found = []
    for address in addresses:
        device = devices / address
        if _read(device / "vendor") != NVIDIA_VENDOR:
            continue
        if not _read(device / "class").startswith(GPU_CLASSES):
            continue
        if _link_name(device / "driver") != PASSTHROUGH_DRIVER:
            continue
        device_id = _read(device / "device")[:MAX_NAME]
        found.append(
            PassthroughGpu(
                pci_bus_id=address[:MAX_NAME],
                device_id=device_id,
                name=PRODUCTS.get(device_id, ""),
                driver=PASSTHROUGH_DRIVER,
                iommu_group=_link_name(device / "iommu_group"),
            )
        )
        if len(found) == MAX_GPUS:
            break
    return found
