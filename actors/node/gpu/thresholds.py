"""The one table of GPU health thresholds (like the XID table), its overrides, and the
one-line summaries of the memory and NVLink readings that the XID check ties in.

Every deep GPU reading is judged against an entry here: a finding once its reading reaches
``limit``, with the entry's status and action. Operators override a limit, or switch an
entry off, with ``gpu_thresholds = ["pcie_replays_per_min=20", "persistence_off=off"]``
(NAME=LIMIT or NAME=off). Yes/no readings (a remap pending) use limit 1.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Literal

import msgspec

from schemas.events import GpuHealth
from schemas.health_limits import HOT_GPU_C

Finding = Literal["degraded", "unhealthy"]
GPU_THRESHOLD_PATTERN = r"^[a-z_]{1,64}=(\d+(\.\d+)?|off)$"
"""An override of ``gpu_thresholds``: NAME=LIMIT or NAME=off, e.g. pcie_replays_per_min=20."""
_SPEC = re.compile(GPU_THRESHOLD_PATTERN)

HARMFUL_CLOCK_REASONS: dict[int, str] = {
    0x8: "HW slowdown",
    0x10: "sync boost",
    0x20: "SW thermal slowdown",
    0x40: "HW thermal slowdown",
    0x80: "HW power brake",
}
"""Clock event reasons that mean the GPU is held back by a fault or its environment."""
BENIGN_CLOCK_REASONS: dict[int, str] = {
    0x1: "idle",
    0x2: "application clocks",
    0x4: "SW power cap",
    0x100: "display clock",
}
"""Reasons that are the GPU doing what it was told (or resting): never a finding."""
IDLE = 0x1


class Threshold(msgspec.Struct, frozen=True, kw_only=True):
    """One reading's limit, what crossing it means and what to do."""

    check: str
    """The Health check the finding lands in."""
    limit: float
    status: Finding
    meaning: str
    action: str


GPU_THRESHOLDS: dict[str, Threshold] = {
    "ecc_uncorrected": Threshold(
        check="gpu_memory",
        limit=1,
        status="unhealthy",
        meaning="uncorrectable ECC errors since the driver loaded",
        action="drain, then reset the GPU; RMA if uncorrectable errors recur",
    ),
    "ecc_corrected": Threshold(
        check="gpu_memory",
        limit=1000,
        status="degraded",
        meaning="corrected ECC errors since the driver loaded",
        action="watch the ECC counters; reset the GPU when drained, RMA if the rate stays high",
    ),
    "retired_pages": Threshold(
        check="gpu_memory",
        limit=60,
        status="unhealthy",
        meaning="retired memory pages (the GPU's spare pages run out near 64)",
        action="drain and RMA the GPU",
    ),
    "retired_pending": Threshold(
        check="gpu_memory",
        limit=1,
        status="degraded",
        meaning="a page retirement waits for a GPU reset",
        action="drain and reset the GPU (or reload the driver) to retire the pages",
    ),
    "remap_pending": Threshold(
        check="gpu_memory",
        limit=1,
        status="degraded",
        meaning="a row remap waits for a GPU reset",
        action="drain and reset the GPU so the row remap takes effect",
    ),
    "remap_failed": Threshold(
        check="gpu_memory",
        limit=1,
        status="unhealthy",
        meaning="a row remap failed",
        action="drain and RMA the GPU",
    ),
    "remap_banks_exhausted": Threshold(
        check="gpu_memory",
        limit=1,
        status="degraded",
        meaning="memory banks with no spare row left (the next error there cannot be remapped)",
        action="plan an RMA of the GPU",
    ),
    "clocks_harmful": Threshold(
        check="gpu_clocks",
        limit=1,
        status="degraded",
        meaning="clocks held down by " + ", ".join(HARMFUL_CLOCK_REASONS.values()),
        action="check cooling, power supply and the GPU's board (nvidia-smi -q -d PERFORMANCE)",
    ),
    "sm_clock_min_pct": Threshold(
        check="gpu_clocks",
        limit=50,
        status="unhealthy",
        meaning="SM clock below this % of its maximum while a harmful reason holds it",
        action="drain the node; check cooling and power; RMA if it persists",
    ),
    "pcie_replays_per_min": Threshold(
        check="gpu_pcie",
        limit=8,
        status="degraded",
        meaning="PCIe replays per minute (link errors the link retried)",
        action="reseat the GPU or its riser; check the slot; RMA if it persists",
    ),
    "pcie_downgraded": Threshold(
        check="gpu_pcie",
        limit=1,
        status="degraded",
        meaning="PCIe link width below its maximum, or generation below it while not idle",
        action="reseat the GPU or its riser; check the slot and BIOS PCIe settings",
    ),
    "nvlink_down": Threshold(
        check="gpu_nvlink",
        limit=1,
        status="unhealthy",
        meaning="NVLink links inactive on a GPU that has active links (or had them)",
        action="drain, reset the GPU and check NVLink/NVSwitch; RMA if it persists",
    ),
    "nvlink_errors_per_min": Threshold(
        check="gpu_nvlink",
        limit=100,
        status="degraded",
        meaning="NVLink replay + recovery + CRC errors per minute on one link",
        action="drain, reset the GPU; check NVSwitch and cabling if it persists",
    ),
    "fabric_incomplete": Threshold(
        check="gpu_fabric",
        limit=1,
        status="unhealthy",
        meaning="the GPU's NVLink fabric registration not completed, failed or unhealthy",
        action="check nvidia-fabricmanager (systemctl status nvidia-fabricmanager) and NVSwitch",
    ),
    "fabric_degraded": Threshold(
        check="gpu_fabric",
        limit=1,
        status="degraded",
        meaning="fabric running at degraded bandwidth",
        action="drain when convenient; check NVSwitch trays and NVLink",
    ),
    "fabric_manager_down": Threshold(
        check="gpu_fabric",
        limit=1,
        status="unhealthy",
        meaning="nvidia-fabricmanager not running on an NVSwitch system",
        action="systemctl restart nvidia-fabricmanager; drain the node until it runs",
    ),
    "temperature": Threshold(
        check="nvml",
        limit=HOT_GPU_C,
        status="degraded",
        meaning="GPU temperature in C: a GPU hotter than this (not at it) degrades the nvml check",
        action="check cooling and airflow",
    ),
    "persistence_off": Threshold(
        check="gpu_settings",
        limit=1,
        status="degraded",
        meaning="persistence mode off (the driver unloads between jobs)",
        action="enable it: systemctl enable --now nvidia-persistenced (or nvidia-smi -pm 1)",
    ),
}


def parse_gpu_thresholds(specs: Iterable[str]) -> dict[str, float | None]:
    """``["pcie_replays_per_min=20", "persistence_off=off"]`` -> ``{...: 20.0, ...: None}``
    (None: switched off); an unknown name or malformed spec raises ValueError."""
    overrides: dict[str, float | None] = {}
    for spec in specs:
        if not _SPEC.fullmatch(spec):
            raise ValueError(f"gpu threshold {spec!r} is not NAME=LIMIT or NAME=off")
        name, value = spec.split("=")
        if name not in GPU_THRESHOLDS:
            known = ", ".join(sorted(GPU_THRESHOLDS))
            raise ValueError(f"gpu threshold {name!r} is not one of: {known}")
        overrides[name] = None if value == "off" else float(value)
    return overrides


def thresholds(overrides: dict[str, float | None] | None = None) -> dict[str, Threshold]:
    """The table with the operator's overrides applied; entries switched off left out."""
    table: dict[str, Threshold] = {}
    for name, entry in GPU_THRESHOLDS.items():
        if overrides and name in overrides:
            limit = overrides[name]
            if limit is None:
                continue
            entry = msgspec.structs.replace(entry, limit=limit)
        table[name] = entry
    return table


def reasons_text(mask: int, names: dict[int, str]) -> list[str]:
    """The names of the bits of ``mask`` that ``names`` knows."""
    return [name for bit, name in names.items() if mask & bit]


def memory_summary(health: GpuHealth) -> str:
    """What the GPU's memory readings say, for the XID check's memory codes."""
    if health.remap is not None:
        remap = health.remap
        return (
            f"row remap: {remap.correctable} correctable, {remap.uncorrectable} uncorrectable, "
            f"pending {'yes' if remap.pending else 'no'}, failed {'yes' if remap.failed else 'no'}"
        )
    if health.retired_pages is not None:
        pending = "yes" if health.retired_pending else "no"
        return f"retired pages: {health.retired_pages}, pending {pending}"
    return "no row remap or page retirement reading"


def nvlink_summary(health: GpuHealth) -> str:
    """What the GPU's NVLink readings say, for the XID check's NVLink code."""
    if health.nvlinks is None:
        return "NVLink not visible to NVML"
    active = sum(1 for link in health.nvlinks if link.active)
    down = [str(link.link) for link in health.nvlinks if not link.active]
    text = f"NVLink: {active}/{len(health.nvlinks)} links active"
    return f"{text} (down: {', '.join(down)})" if down else text
