"""GPUs as the PCI bus shows them, beside those NVML reads: part of the node's ``Sample``.

A GPU bound to ``vfio-pci`` is given to virtual machines (passthrough): the host's NVML
never sees it, yet it is the machine's. The inventory finds such GPUs in sysfs
(``/sys/bus/pci/devices``: vendor, device, class, the ``driver`` link) and reports them
here, so they are counted (the ``gpu.count`` label, the node's identity) without being
health-checked through NVML or given to workloads.
"""

from __future__ import annotations

from schemas.base import Name, Wire


class PassthroughGpu(Wire, frozen=True, kw_only=True):
    """One NVIDIA GPU bound to ``vfio-pci``, as sysfs describes it."""

    pci_bus_id: Name
    """The device's PCI address as sysfs names it (``0000:3b:00.0``)."""
    device_id: Name
    """NVIDIA's PCI device id (``0x2330``: H100 SXM5 80GB)."""
    name: Name = ""
    """The product name for a device id the agent knows (NVML's name for it); empty
    otherwise."""
    driver: Name = "vfio-pci"
    """The kernel driver it is bound to."""
    iommu_group: Name = ""
    """Its IOMMU group (what a VM is given whole); empty when sysfs shows none."""


__all__ = ["PassthroughGpu"]
