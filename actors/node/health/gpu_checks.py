"""The GPU hardware checks: each deep reading of a sample against the GPU health table.

Six checks, one per kind of fault, so a finding names what broke: ``gpu_memory`` (ECC,
retired pages, row remapping), ``gpu_clocks`` (harmful clock event reasons, SM clock
against its maximum), ``gpu_pcie`` (replays per minute, link below its maximum),
``gpu_nvlink`` (links down, errors per minute), ``gpu_fabric`` (fabric registration and
health, nvidia-fabricmanager) and ``gpu_settings`` (persistence mode). A reading the GPU
cannot give (None; ``NotSupported`` is an answer, not a fault) is never a finding: an ok
check says which calls were not supported. Rates are counts within the last minute of
samples, never extrapolated from one sample.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from actors.node.gpu.thresholds import (
    HARMFUL_CLOCK_REASONS,
    IDLE,
    Threshold,
    reasons_text,
    thresholds,
)
from actors.node.health.checks import RANK
from schemas.base import MAX_GPUS, MAX_TEXT
from schemas.events import Gpu, GpuHealth, HealthCheck, Sample

WINDOW = 60.0
"""Seconds a rate (PCIe replays, NVLink errors) is counted over."""

CALLS: dict[str, tuple[str, ...]] = {
    "gpu_memory": (
        "nvmlDeviceGetTotalEccErrors",
        "nvmlDeviceGetRetiredPages",
        "nvmlDeviceGetRetiredPagesPendingStatus",
        "nvmlDeviceGetRemappedRows",
        "nvmlDeviceGetRowRemapperHistogram",
    ),
    "gpu_clocks": (
        "nvmlDeviceGetCurrentClocksEventReasons",
        "nvmlDeviceGetClockInfo",
        "nvmlDeviceGetMaxClockInfo",
    ),
    "gpu_pcie": (
        "nvmlDeviceGetPcieReplayCounter",
        "nvmlDeviceGetCurrPcieLinkGeneration",
        "nvmlDeviceGetCurrPcieLinkWidth",
        "nvmlDeviceGetMaxPcieLinkGeneration",
        "nvmlDeviceGetMaxPcieLinkWidth",
    ),
    "gpu_nvlink": ("nvmlDeviceGetNvLinkState", "nvmlDeviceGetNvLinkErrorCounter"),
    "gpu_fabric": ("nvmlDeviceGetGpuFabricInfoV",),
    "gpu_settings": ("nvmlDeviceGetPersistenceMode",),
}
"""The NVML calls behind each check (an ok check names those that were not supported)."""
CHECK_NAMES = tuple(CALLS)

Finding = tuple[Threshold, str]
Located = tuple[Threshold, str, int | None]
"""A finding with the index of the GPU it is about (None: the host's, not one GPU's)."""


class Window:
    """How much each counter grew over the last ``WINDOW`` seconds of samples."""

    def __init__(self) -> None:
        self._seen: dict[tuple[str, int], deque[tuple[float, int]]] = {}

    def increase(self, key: tuple[str, int], at: float, value: int) -> int | None:
        """Growth since the latest reading at least a window old (or the oldest kept);
        None on the first reading or after the counter went back (a reset)."""
        seen = self._seen.setdefault(key, deque(maxlen=1024))
        if seen and value < seen[-1][1]:
            seen.clear()
        seen.append((at, value))
        while len(seen) > 1 and seen[1][0] <= at - WINDOW:
            seen.popleft()
        return value - seen[0][1] if len(seen) > 1 else None

    def keep_only(self, keys: Iterable[tuple[str, int]]) -> None:
        """Forget counters of GPUs and links no longer reported (bounded memory)."""
        wanted = set(keys)
        for key in [key for key in self._seen if key not in wanted]:
            del self._seen[key]


class GpuJudge:
    """Judges successive samples' GPUs; keeps what rates and NVLink-down need."""

    def __init__(self, overrides: dict[str, float | None] | None = None) -> None:
        self.table = thresholds(overrides)
        self.window = Window()
        self.links_seen_active: dict[str, set[int]] = {}
        """Per GPU UUID, the links seen active since the agent started."""

    def _over(self, name: str, value: float | None, text: str) -> list[Finding]:
        entry = self.table.get(name)
        if entry is None or value is None or value < entry.limit:
            return []
        return [(entry, text)]

    def checks(self, sample: Sample) -> list[HealthCheck]:
        """One check per CHECK_NAMES entry; none for a sample without GPU health readings
        (no GPUs, simulated ones, NVML failing)."""
        read = [gpu for gpu in sample.gpus if gpu.health is not None and not gpu.lost]
        if not read:
            return []
        findings: dict[str, list[Located]] = {name: [] for name in CHECK_NAMES}
        counters: list[tuple[str, int]] = []
        for gpu in read:
            health = gpu.health
            assert health is not None
            for finding in (
                *self._memory(gpu, health),
                *self._clocks(gpu, health),
                *self._pcie(gpu, health, sample.ts),
                *self._nvlink(gpu, health, sample.ts),
                *self._fabric(gpu, health),
                *self._over(
                    "persistence_off", health.persistence_mode is False, f"GPU {gpu.index}"
                ),
            ):
                findings[finding[0].check].append((*finding, gpu.index))
            counters.append((gpu.uuid, -1))
            counters.extend((gpu.uuid, link.link) for link in health.nvlinks or [])
        self.window.keep_only(counters)
        if sample.host is not None and sample.host.fabric_manager_running is False:
            findings["gpu_fabric"] += [
                (*finding, None)
                for finding in self._over(
                    "fabric_manager_down", 1, "nvidia-fabricmanager not running"
                )
            ]
        return [_check(name, found, read) for name, found in findings.items()]

    def _memory(self, gpu: Gpu, health: GpuHealth) -> list[Finding]:
        at = f"GPU {gpu.index}"
        remap = health.remap
        return [
            *self._over(
                "ecc_uncorrected",
                gpu.ecc_uncorrected,
                f"{at}: {gpu.ecc_uncorrected} uncorrectable ECC errors",
            ),
            *self._over(
                "ecc_corrected",
                gpu.ecc_corrected,
                f"{at}: {gpu.ecc_corrected} corrected ECC errors",
            ),
            *self._over(
                "retired_pages", health.retired_pages, f"{at}: {health.retired_pages} retired pages"
            ),
            *self._over(
                "retired_pending", health.retired_pending, f"{at}: page retirement pending"
            ),
            *self._over(
                "remap_pending", remap.pending if remap else None, f"{at}: row remap pending"
            ),
            *self._over("remap_failed", remap.failed if remap else None, f"{at}: row remap failed"),
            *self._over(
                "remap_banks_exhausted",
                remap.banks_none if remap else None,
                f"{at}: {remap.banks_none if remap else 0} memory banks without spare rows",
            ),
        ]

    def _clocks(self, gpu: Gpu, health: GpuHealth) -> list[Finding]:
        harmful = reasons_text(health.clock_reasons or 0, HARMFUL_CLOCK_REASONS)
        if not harmful:
            return []
        clock = ""
        percent = None
        if health.sm_clock_mhz is not None and health.sm_clock_max_mhz:
            clock = f" (SM {health.sm_clock_mhz}/{health.sm_clock_max_mhz} MHz)"
            percent = 100.0 * health.sm_clock_mhz / health.sm_clock_max_mhz
        text = f"GPU {gpu.index} clocks held down by {', '.join(harmful)}{clock}"
        slow = self.table.get("sm_clock_min_pct")
        if slow is not None and percent is not None and percent < slow.limit:
            return [(slow, f"{text}: below {slow.limit:g} % of its maximum")]
        return self._over("clocks_harmful", 1, text)

    def _pcie(self, gpu: Gpu, health: GpuHealth, at: float) -> list[Finding]:
        where = f"GPU {gpu.index}"
        found: list[Finding] = []
        if health.pcie_replays is not None:
            grew = self.window.increase((gpu.uuid, -1), at, health.pcie_replays)
            found += self._over(
                "pcie_replays_per_min", grew, f"{where}: {grew} PCIe replays in the last minute"
            )
        width, widest = health.pcie_width, health.pcie_width_max
        if width is not None and widest and width < widest:
            text = f"{where}: PCIe link x{width} of x{widest}"
            found += self._over("pcie_downgraded", 1, text)
        idle = (
            bool(health.clock_reasons & IDLE)
            if health.clock_reasons is not None
            else not gpu.utilization_pct
        )
        generation, top = health.pcie_generation, health.pcie_generation_max
        if generation is not None and top and generation < top and not idle:
            text = f"{where}: PCIe Gen{generation} of Gen{top} while busy"
            found += self._over("pcie_downgraded", 1, text)
        return found

    def _nvlink(self, gpu: Gpu, health: GpuHealth, at: float) -> list[Finding]:
        if health.nvlinks is None:
            return []
        seen = self.links_seen_active.setdefault(gpu.uuid, set())
        seen.update(link.link for link in health.nvlinks if link.active)
        down = [link.link for link in health.nvlinks if not link.active]
        found: list[Finding] = []
        if down and seen:
            links = ", ".join(map(str, down))
            found += self._over(
                "nvlink_down",
                len(down),
                f"GPU {gpu.index}: NVLink {links} down "
                f"({len(health.nvlinks) - len(down)}/{len(health.nvlinks)} active)",
            )
        for link in health.nvlinks:
            counts = (link.replay_errors, link.recovery_errors, link.crc_errors)
            if all(count is None for count in counts):
                continue
            total = sum(count or 0 for count in counts)
            grew = self.window.increase((gpu.uuid, link.link), at, total)
            found += self._over(
                "nvlink_errors_per_min",
                grew,
                f"GPU {gpu.index} NVLink {link.link}: {grew} errors in the last minute",
            )
        return found

    def _fabric(self, gpu: Gpu, health: GpuHealth) -> list[Finding]:
        fabric = health.fabric
        if fabric is None:
            return []
        where = f"GPU {gpu.index}"
        if fabric.state != "completed":
            state = fabric.state.replace("_", " ")
            return self._over("fabric_incomplete", 1, f"{where}: fabric registration {state}")
        found: list[Finding] = []
        if fabric.status != 0:
            text = f"{where}: fabric registration failed (NVML status {fabric.status})"
            found += self._over("fabric_incomplete", 1, text)
        mask = fabric.health_mask
        if (mask >> 4) & 0x3 == 1:
            found += self._over("fabric_incomplete", 1, f"{where}: fabric route unhealthy")
        if (mask >> 14) & 0x3 == 2:
            found += self._over("fabric_manager_down", 1, f"{where}: fabric manager disconnected")
        if mask & 0x3 == 1:
            found += self._over("fabric_degraded", 1, f"{where}: fabric bandwidth degraded")
        return found


def _unsupported(name: str, gpus: list[Gpu]) -> str:
    """ "; nvmlDeviceGetRetiredPages: Not Supported (GPU 0, 1)" for an ok check."""
    by_answer: dict[tuple[str, str], list[str]] = {}
    for gpu in gpus:
        unread = gpu.health.unread if gpu.health is not None else {}
        for call, why in unread.items():
            if call in CALLS[name]:
                by_answer.setdefault((call, why), []).append(str(gpu.index))
    return "".join(
        f"; {call}: {why} (GPU {', '.join(indexes)})"
        for (call, why), indexes in sorted(by_answer.items())
    )


def _check(name: str, found: list[Located], gpus: list[Gpu]) -> HealthCheck:
    if not found:
        reason = f"{len(gpus)} GPUs within thresholds{_unsupported(name, gpus)}"
        return HealthCheck(name=name, status="ok", reason=reason[:MAX_TEXT])
    worst = max(found, key=lambda finding: RANK[finding[0].status])[0]
    reason = "; ".join(text for _, text, _ in found)
    at_fault = sorted({index for _, _, index in found if index is not None})
    return HealthCheck(
        name=name,
        status=worst.status,
        reason=reason[:MAX_TEXT],
        action=worst.action,
        gpus=at_fault[:MAX_GPUS],
    )
