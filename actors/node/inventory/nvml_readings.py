"""The deep GPU health readings NVML gives (what DCGM's health checks read), as Gpu fields.

Each function takes ``ask``, which makes one NVML call and answers None when NVML will
not (the caller notes why, in ``Gpu.unread``), and returns the Gpu fields it read.
Readings that cannot change while the driver runs (maximum clocks and PCIe link, which
NVLink links answer at all) are read once per GPU (:func:`static_readings`); the rest on
every sample. None of these calls is slow on an H100 (``PcieThroughput``, which samples
for about 20 ms, is not read at all).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

from schemas.events import Fabric, NvLink, RowRemap

Ask = Callable[..., Any]

FABRIC_STATES = {1: "not_started", 2: "in_progress", 3: "completed"}
"""NVML_GPU_FABRIC_STATE_*; 0 (not supported) means the GPU has no fabric state."""


def _count(value: Any) -> int | None:
    return int(value) if value is not None else None


def static_readings(ask: Ask, nvml: Any, handle: Any) -> dict[str, Any]:
    """Maximum clocks and PCIe link, and the NVLink links that answer (``links``)."""
    links = [
        link
        for link in range(int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18)))
        if ask("nvmlDeviceGetNvLinkState", handle, link) is not None
    ]
    return {
        "sm_clock_max_mhz": _count(ask("nvmlDeviceGetMaxClockInfo", handle, nvml.NVML_CLOCK_SM)),
        "memory_clock_max_mhz": _count(
            ask("nvmlDeviceGetMaxClockInfo", handle, nvml.NVML_CLOCK_MEM)
        ),
        "pcie_generation_max": _count(ask("nvmlDeviceGetMaxPcieLinkGeneration", handle)),
        "pcie_width_max": _count(ask("nvmlDeviceGetMaxPcieLinkWidth", handle)),
        "links": links,
    }


def memory_readings(ask: Ask, nvml: Any, handle: Any) -> dict[str, Any]:
    """Aggregate ECC counts, retired pages and row remapping."""
    aggregate = {
        field: _count(ask("nvmlDeviceGetTotalEccErrors", handle, error, nvml.NVML_AGGREGATE_ECC))
        for field, error in (
            ("ecc_corrected_aggregate", nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED),
            ("ecc_uncorrected_aggregate", nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED),
        )
    }
    retired: int | None = None
    for cause in (
        nvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS,
        nvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR,
    ):
        pages = ask("nvmlDeviceGetRetiredPages", handle, cause)
        if pages is not None:
            retired = (retired or 0) + len(pages)
    pending = ask("nvmlDeviceGetRetiredPagesPendingStatus", handle)
    return {
        **aggregate,
        "retired_pages": retired,
        "retired_pending": bool(pending) if pending is not None else None,
        "remap": _remap(ask, handle),
    }


def _remap(ask: Ask, handle: Any) -> RowRemap | None:
    rows = ask("nvmlDeviceGetRemappedRows", handle)
    if rows is None:
        return None
    correctable, uncorrectable, pending, failed = (int(value) for value in rows)
    histogram = ask("nvmlDeviceGetRowRemapperHistogram", handle)
    return RowRemap(
        correctable=correctable,
        uncorrectable=uncorrectable,
        pending=bool(pending),
        failed=bool(failed),
        banks_none=_count(getattr(histogram, "none", None)),
        banks_low=_count(getattr(histogram, "low", None)),
    )


def clock_readings(ask: Ask, nvml: Any, handle: Any) -> dict[str, Any]:
    """Why clocks are held down, SM and memory clocks now."""
    return {
        "clock_reasons": _count(ask("nvmlDeviceGetCurrentClocksEventReasons", handle)),
        "sm_clock_mhz": _count(ask("nvmlDeviceGetClockInfo", handle, nvml.NVML_CLOCK_SM)),
        "memory_clock_mhz": _count(ask("nvmlDeviceGetClockInfo", handle, nvml.NVML_CLOCK_MEM)),
    }


def link_readings(ask: Ask, nvml: Any, handle: Any, links: list[int]) -> dict[str, Any]:
    """PCIe replays and link, NVLink per answering link, fabric state, persistence mode."""
    persistence = ask("nvmlDeviceGetPersistenceMode", handle)
    return {
        "pcie_replays": _count(ask("nvmlDeviceGetPcieReplayCounter", handle)),
        "pcie_generation": _count(ask("nvmlDeviceGetCurrPcieLinkGeneration", handle)),
        "pcie_width": _count(ask("nvmlDeviceGetCurrPcieLinkWidth", handle)),
        "nvlinks": [_nvlink(ask, nvml, handle, link) for link in links] if links else None,
        "fabric": _fabric(ask, nvml, handle),
        "persistence_mode": persistence == nvml.NVML_FEATURE_ENABLED
        if persistence is not None
        else None,
    }


def _nvlink(ask: Ask, nvml: Any, handle: Any, link: int) -> NvLink:
    state = ask("nvmlDeviceGetNvLinkState", handle, link)
    counters = {
        field: _count(ask("nvmlDeviceGetNvLinkErrorCounter", handle, link, counter))
        for field, counter in (
            ("replay_errors", nvml.NVML_NVLINK_ERROR_DL_REPLAY),
            ("recovery_errors", nvml.NVML_NVLINK_ERROR_DL_RECOVERY),
            ("crc_errors", nvml.NVML_NVLINK_ERROR_DL_CRC_FLIT),
        )
    }
    return NvLink(link=link, active=state == nvml.NVML_FEATURE_ENABLED, **counters)


def _fabric(ask: Ask, nvml: Any, handle: Any) -> Fabric | None:
    info = nvml.c_nvmlGpuFabricInfoV_t()
    info.version = nvml.nvmlGpuFabricInfo_v2
    if ask("nvmlDeviceGetGpuFabricInfoV", handle, ctypes.byref(info)) is None:
        return None
    state = FABRIC_STATES.get(int(info.state))
    if state is None:
        return None
    return Fabric(state=state, status=int(info.status), health_mask=int(info.healthMask))  # type: ignore[arg-type]


def versions(ask: Ask) -> tuple[str, str]:
    """The driver version and the highest CUDA version it supports (``13.0``)."""
    driver = ask("nvmlSystemGetDriverVersion")
    cuda = ask("nvmlSystemGetCudaDriverVersion_v2")
    driver_text = driver.decode() if isinstance(driver, bytes) else str(driver or "")
    cuda_text = f"{cuda // 1000}.{cuda % 1000 // 10}" if isinstance(cuda, int) else ""
    return driver_text, cuda_text
