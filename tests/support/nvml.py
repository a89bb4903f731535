"""An NVML stand-in answering from a real GPU's recorded answers (tests/support/data/).

``RecordedNvml`` replaces the pynvml module: its constants and error classes are
pynvml's own, and each device call answers what the recorded H100 (SXM, driver 580)
answered, error included (``NotSupported`` raises the NVMLError NVML raised). Tests
change an answer by its recorded name (``set``), make a call fail (``fail``) or hang
(``hang``), and queue XID events (``xid``).
"""

from __future__ import annotations

import ctypes
import json
import threading
from collections import deque
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml

from schemas.events import Gpu, GpuHealth

RECORDING = Path(__file__).parent / "data" / "h100-sxm-580.json"

ERROR_CODES: dict[str, int] = {
    type(pynvml.NVMLError(getattr(pynvml, name))).__name__: getattr(pynvml, name)
    for name in dir(pynvml)
    if name.startswith("NVML_ERROR_") and isinstance(getattr(pynvml, name), int)
}
"""``NVMLError_NotSupported`` -> NVML_ERROR_NOT_SUPPORTED, for every NVML error."""

_CLOCKS = {
    pynvml.NVML_CLOCK_GRAPHICS: "graphics",
    pynvml.NVML_CLOCK_SM: "sm",
    pynvml.NVML_CLOCK_MEM: "mem",
    pynvml.NVML_CLOCK_VIDEO: "video",
}
_ECC_TYPES = {
    pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED: "corrected",
    pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED: "uncorrected",
}
_ECC_COUNTERS = {pynvml.NVML_VOLATILE_ECC: "volatile", pynvml.NVML_AGGREGATE_ECC: "aggregate"}
_RETIRE_CAUSES = {
    pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS: "sbe",
    pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR: "dbe",
}
_NVLINK_COUNTERS = {
    pynvml.NVML_NVLINK_ERROR_DL_REPLAY: "replay",
    pynvml.NVML_NVLINK_ERROR_DL_RECOVERY: "recovery",
    pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT: "crc_flit",
}
NOT_SUPPORTED = {"error": "NVMLError_NotSupported"}


def health_of(gpu: Gpu) -> GpuHealth:
    """The GPU's deep readings, which an NVML-read GPU always has."""
    assert gpu.health is not None, f"GPU {gpu.index} has no health readings"
    return gpu.health


def recorded_key(function: str, args: tuple[Any, ...]) -> str:
    """The recording's name for one call: ``nvmlDeviceGetClockInfo(h, SM)`` ->
    ``ClockInfo.sm``, ``nvmlDeviceGetNvLinkState(h, 3)`` -> ``NvLink.3.State``."""
    name = function.removeprefix("nvmlDeviceGet").removeprefix("nvmlDevice")
    if name in ("ClockInfo", "MaxClockInfo"):
        return f"{name}.{_CLOCKS[args[0]]}"
    if name == "TotalEccErrors":
        return f"TotalEccErrors.{_ECC_TYPES[args[0]]}.{_ECC_COUNTERS[args[1]]}"
    if name == "Temperature":
        return "Temperature.GPU"
    if name == "RetiredPages":
        return f"RetiredPages.{_RETIRE_CAUSES[args[0]]}"
    if name == "NvLinkState":
        return f"NvLink.{args[0]}.State"
    if name == "NvLinkErrorCounter":
        return f"NvLink.{args[0]}.ErrorCounter.{_NVLINK_COUNTERS[args[1]]}"
    if name == "MemoryInfo" and args and args[0]:
        return "MemoryInfo_v2"  # nvmlDeviceGetMemoryInfo(handle, version=nvmlMemory_v2)
    if name == "RegisterEvents":
        return "RegisterEvents.XidCriticalError"
    return name


def _struct(value: dict[str, Any], struct: type[ctypes.Structure]) -> Any:
    instance = struct()
    for field, _ in struct._fields_:  # type: ignore[misc]
        if field in value and not isinstance(value[field], list):
            setattr(instance, field, value[field])
    return instance


class RecordedNvml:
    """Stands in for the pynvml module with ``count`` copies of the recorded H100."""

    def __init__(self, count: int = 2, recording: Path = RECORDING) -> None:
        doc = json.loads(recording.read_text())
        self.system: dict[str, Any] = doc["system"]
        self.devices: list[dict[str, Any]] = []
        for index in range(count):
            device = dict(doc["devices"][0])
            for link, answers in device.pop("NvLink").items():
                for name, answer in answers.items():
                    device[f"NvLink.{link}.{name}"] = answer
            device["UUID"] = {"value": f"GPU-0000000{index}-aaaa-bbbb-cccc-dddddddddddd"}
            bus = f"00000000:{0x3B + index:02X}:00.0"
            device["PciInfo"] = {"value": {**device["PciInfo"]["value"], "busId": bus}}
            self.devices.append(device)
        self.init_error: int | None = None
        self.init_release: threading.Event | None = None
        """Set: nvmlInit blocks until it is (a driver that hangs)."""
        self.errors: dict[tuple[int, str], int] = {}
        """(GPU, NVML function) -> NVML error code every such call raises."""
        self.hanging: dict[tuple[int, str], threading.Event] = {}
        self.events: deque[SimpleNamespace] = deque()
        self.calls: list[tuple[int, str]] = []
        self.initialised = self.shutdowns = self.freed = 0

    # -- what tests change
    def set(self, gpu: int, key: str, value: Any) -> None:
        """Answer ``value`` for the recorded name ``key`` on ``gpu``."""
        self.devices[gpu][key] = {"value": value}

    def fail(self, gpu: int, key: str, error: int) -> None:
        """Raise NVML ``error`` for the recorded name ``key`` on ``gpu``."""
        name = type(pynvml.NVMLError(error)).__name__
        self.devices[gpu][key] = {"error": name}

    def hang(self, gpu: int, function: str) -> threading.Event:
        """Make ``function`` on ``gpu`` block until the returned event is set."""
        release = threading.Event()
        self.hanging[(gpu, function)] = release
        return release

    def xid(self, gpu: int, code: int) -> None:
        self.events.append(
            SimpleNamespace(
                device=gpu, eventType=pynvml.nvmlEventTypeXidCriticalError, eventData=code
            )
        )

    # -- pynvml's surface
    def __getattr__(self, name: str) -> Any:
        if name.startswith("nvmlDevice"):
            return lambda handle, *args: self._answer(handle, name, args)
        return getattr(pynvml, name)

    def _answer(self, handle: int, function: str, args: tuple[Any, ...]) -> Any:
        self.calls.append((handle, function))
        release = self.hanging.get((handle, function))
        if release is not None:
            release.wait()
        if (handle, function) in self.errors:
            raise pynvml.NVMLError(self.errors[(handle, function)])
        if function == "nvmlDeviceGetIndex":
            return handle
        key = recorded_key(function, args)
        answer = self.devices[handle].get(key, NOT_SUPPORTED)
        if "error" in answer:
            raise pynvml.NVMLError(ERROR_CODES[answer["error"]])
        if key == "GpuFabricInfoV":
            # NVML fills the struct it is given: the recording kept what it held after.
            fields = answer["value"] if isinstance(answer["value"], dict) else answer["struct"]
            for field in ("state", "status", "healthMask"):
                setattr(args[0]._obj, field, fields[field])
            return pynvml.NVML_SUCCESS
        return self._typed(key, answer["value"])

    @staticmethod
    def _typed(key: str, value: Any) -> Any:
        """The recorded plain value in the shape pynvml returns it."""
        if key == "PciInfo":
            info = pynvml.nvmlPciInfo_t()
            info.busId = value["busId"].encode()
            return info
        if key == "MemoryInfo":
            return _struct(value, pynvml.c_nvmlMemory_t)
        if key == "MemoryInfo_v2":
            return _struct(value, pynvml.c_nvmlMemory_v2_t)
        if key == "UtilizationRates":
            return _struct(value, pynvml.c_nvmlUtilization_t)
        if key == "RowRemapperHistogram":
            return _struct(value, pynvml.c_nvmlRowRemapperHistogramValues)
        if key == "RemappedRows":
            return tuple(value)
        return value

    def nvmlInit(self) -> None:
        if self.init_release is not None:
            self.init_release.wait()
        if self.init_error is not None:
            raise pynvml.NVMLError(self.init_error)
        self.initialised += 1

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlSystemGetDriverVersion(self) -> str:
        return str(self.system["DriverVersion"]["value"])

    def nvmlSystemGetCudaDriverVersion_v2(self) -> int:
        return int(self.system["CudaDriverVersion_v2"]["value"])

    def nvmlDeviceGetCount(self) -> int:
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlEventSetCreate(self) -> str:
        return "event-set"

    def nvmlEventSetFree(self, event_set: str) -> None:
        self.freed += 1

    def nvmlEventSetWait_v2(self, event_set: str, timeout_ms: int) -> SimpleNamespace:
        assert timeout_ms == 0, "the event set must be polled, never waited on"
        if not self.events:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)
        return self.events.popleft()
