"""Real GPUs through NVML (the ``pynvml`` module of nvidia-ml-py).

``read()`` runs in a worker thread (the inventory's watchdog, :mod:`.watchdog`), so
NVML's blocking calls never stall the event loop; the call in progress and since when are
kept (``calling``), so a call that hangs is named (``hung``). A field NVML cannot give
(not supported, no permission, ...) is None for that field, and ``Gpu.unread`` says why,
by NVML call; ``GpuIsLost`` marks the device lost for good (only a reset or reboot brings
it back, and the agent restarts with those). XIDs come from an NVML event set polled with
timeout 0 and from the kernel log (:mod:`actors.node.inventory.kmsg`), one XID seen by
both counted once (:class:`actors.node.gpu.xid.XidDedup`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import msgspec
import pynvml

from actors.node.gpu.xid import XidDedup, count_xid, in_code_order
from actors.node.inventory import nvml_readings
from actors.node.inventory.kmsg import KmsgXids, pci_key
from schemas.base import MAX_UNREAD
from schemas.errors import FleetError
from schemas.events import Gpu, GpuHealth, XidCount

log = logging.getLogger(__name__)

# Bounds one drain of the event set; more events wait for the next read.
MAX_EVENTS_PER_READ = 1024
CLOSE_WAIT = 2.0
"""Seconds close() waits for a read in progress; a hung NVML call is left behind."""


class NvmlUnavailable(FleetError):
    """NVML could not be initialised (no driver, no library, no permission).
    ``library_missing``: the NVML library itself is not installed (a host without NVIDIA's
    driver), as opposed to one present and failing."""

    def __init__(self, reason: str, library_missing: bool = False) -> None:
        self.reason = reason
        self.library_missing = library_missing
        super().__init__(f"NVML not available: {reason}")


NVML_RETRY = 60.0
"""Seconds between two attempts to open a failing NVML (a driver reloaded by hand)."""


class Opening:
    """An open of NVML (``nvmlInit``, the device handles, XID event registration) running
    in a daemon thread of its own: an init that hangs never holds the agent's start."""

    def __init__(self, open_nvml: Callable[[], NvmlGpus]) -> None:
        self.started = time.monotonic()
        self.done = threading.Event()
        self.result: NvmlGpus | NvmlUnavailable | None = None

        def work() -> None:
            try:
                self.result = open_nvml()
            except NvmlUnavailable as exc:
                self.result = exc
            finally:
                self.done.set()

        threading.Thread(target=work, name="nvml-open", daemon=True).start()

    def hung(self) -> str:
        """What the open waits on, for how long ("" once it returned)."""
        if self.done.is_set():
            return ""
        return f"nvmlInit hung for {time.monotonic() - self.started:.0f} s"


def open_within(open_nvml: Callable[[], NvmlGpus], deadline: float) -> NvmlGpus | FailedNvml:
    """NVML opened, waiting at most ``deadline`` seconds: NvmlUnavailable if it fails in
    time; a FailedNvml saying the init hangs if it does not return, which takes the GPUs
    over once it does."""
    opening = Opening(open_nvml)
    if not opening.done.wait(deadline):
        log.error("NVML init hangs", extra={"reason": opening.hung()})
        return FailedNvml(opening.hung(), reopen=open_nvml, opening=opening)
    if isinstance(opening.result, NvmlUnavailable):
        raise opening.result
    assert opening.result is not None
    return opening.result


class FailedNvml:
    """NVML is there but does not work (init or the device count failed, or the init
    hangs): no GPUs, and the NVML error in each sample (``Sample.gpu_error``), so the
    health checks say unhealthy with NVML's own words instead of a node that looks
    GPU-less or healthy. ``reopen`` is tried again every ``retry_every`` seconds; once it
    works, its GPUs are read from then on. An ``opening`` that hangs is waited for by the
    read (in the inventory's watchdog thread, which names it while it hangs) and its GPUs
    are read once it returns."""

    source: Final = "nvml"

    def __init__(
        self,
        error: str,
        reopen: Callable[[], NvmlGpus] | None = None,
        retry_every: float = NVML_RETRY,
        opening: Opening | None = None,
    ) -> None:
        self._error = error
        self.reopen = reopen
        self.retry_every = retry_every
        self._next_try = time.monotonic() + retry_every
        self.opened: NvmlGpus | None = None
        self.opening = opening
        self._closed = False
        self._lock = threading.Lock()

    @property
    def error(self) -> str:
        if self.opened is not None:
            return self.opened.error
        opening = self.opening
        return (opening.hung() if opening is not None else "") or self._error

    @property
    def versions(self) -> tuple[str, str]:
        return self.opened.versions if self.opened is not None else ("", "")

    def hung(self, deadline: float) -> str:
        opening = self.opening
        if opening is not None and time.monotonic() - opening.started >= deadline:
            return opening.hung()
        return self.opened.hung(deadline) if self.opened is not None else ""

    def read(self) -> list[Gpu]:
        opening = self.opening
        if opening is not None:
            opening.done.wait()  # in the watchdog's thread: it names the hang meanwhile
            self._take(opening)
        with self._lock:
            if self.opened is None and self.reopen is not None:
                if time.monotonic() >= self._next_try:
                    self._next_try = time.monotonic() + self.retry_every
                    try:
                        self.opened = self.reopen()
                        log.info("NVML works again")
                    except NvmlUnavailable as exc:
                        self._error = exc.reason
            opened = self.opened
        return opened.read() if opened is not None else []

    def _take(self, opening: Opening) -> None:
        """What a hung open came back with: its GPUs, or why NVML fails."""
        with self._lock:
            self.opening = None
            if isinstance(opening.result, NvmlGpus):
                if self._closed:
                    opening.result.close()
                    return
                self.opened = opening.result
                log.warning("NVML init returned", extra={"reason": self._error})
            elif opening.result is not None:
                self._error = opening.result.reason

    def close(self) -> None:
        """Shut down NVML if a retry opened it; otherwise nothing was initialised (an
        open still hanging shuts down when it returns, if the process still runs)."""
        with self._lock:
            self.reopen = None
            self._closed = True
            if self.opened is not None:
                self.opened.close()


class _Lost(Exception):
    """Raised inside one device's read when NVML says the GPU is lost."""


def _text(value: Any) -> str:
    """pynvml returns bytes in old releases and str in new ones."""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _reserved(memory: Any) -> int | None:
    """The driver-reserved bytes of a v2 memory answer; None for a v1 answer."""
    reserved = getattr(memory, "reserved", None)
    return int(reserved) if reserved is not None else None


class NvmlGpus:
    """Every GPU NVML sees, read on demand; ``nvml`` replaces pynvml in tests."""

    source: Final = "nvml"

    def __init__(
        self, nvml: Any = None, xid_log_path: str = "", kmsg_cursor: Path | None = None
    ) -> None:
        self.nvml = nvml if nvml is not None else pynvml
        self.calling: tuple[str, int | None, float] | None = None
        """The NVML call in progress, the GPU it asks about and its monotonic start time."""
        self._gpu: int | None = None
        self._unread: dict[str, str] = {}
        try:
            self.nvml.nvmlInit()
        except self.nvml.NVMLError as exc:
            missing = getattr(exc, "value", None) == self.nvml.NVML_ERROR_LIBRARY_NOT_FOUND
            raise NvmlUnavailable(str(exc), library_missing=missing) from None
        try:
            count = self.nvml.nvmlDeviceGetCount()
        except self.nvml.NVMLError as exc:
            self._shutdown()
            raise NvmlUnavailable(f"nvmlDeviceGetCount: {exc}") from None
        # read() runs in a worker thread, close() on the way out: never both at once.
        self._lock = threading.Lock()
        self._closed = False
        self.handles: list[Any] = []
        self.lost: set[int] = set()
        self.failures: dict[int, str] = {}
        """Why a GPU has no handle, in NVML's words (each sample carries them)."""
        for index in range(count):
            try:
                self.handles.append(self.nvml.nvmlDeviceGetHandleByIndex(index))
            except self.nvml.NVMLError as exc:
                log.warning("GPU has no NVML handle", extra={"gpu": index, "reason": str(exc)})
                self.handles.append(None)
                self.lost.add(index)
                self.failures[index] = f"GPU {index}: nvmlDeviceGetHandleByIndex: {exc}"
        self.identity: dict[int, tuple[str, str, str]] = {}
        self.memory_total: dict[int, int] = {}
        self.static: dict[int, dict[str, Any]] = {}
        """Readings that cannot change while the driver runs, read once per GPU."""
        self.static_unread: dict[int, dict[str, str]] = {}
        """Why static (and identity) readings are None: every sample says it again."""
        self.memory_v2 = hasattr(self.nvml, "nvmlMemory_v2")
        """Whether to read memory with ``nvmlDeviceGetMemoryInfo_v2`` (off once the
        driver says it lacks it)."""
        self.xids: dict[int, dict[int, XidCount]] = {}
        self.dedup = XidDedup()
        self.versions = nvml_readings.versions(self._call)
        """The driver's version and the CUDA version it supports."""
        self.events = self._register_events()
        self.kmsg = KmsgXids(xid_log_path, kmsg_cursor) if xid_log_path else None

    def _register_events(self) -> Any:
        """An event set with XID events of every GPU that supports them."""
        try:
            events = self.nvml.nvmlEventSetCreate()
        except self.nvml.NVMLError as exc:
            log.warning(
                "NVML event set unavailable; XIDs from the kernel log", extra={"reason": str(exc)}
            )
            return None
        for index, handle in enumerate(self.handles):
            if handle is None:
                continue
            try:
                self.nvml.nvmlDeviceRegisterEvents(
                    handle, self.nvml.nvmlEventTypeXidCriticalError, events
                )
            except self.nvml.NVMLError as exc:
                log.warning(
                    "no NVML XID events; using the kernel log",
                    extra={"gpu": index, "reason": str(exc)},
                )
        return events

    def _invoke(self, function: str, *args: Any) -> Any:
        """One NVML call, kept in ``calling`` while it runs (the watchdog reads it)."""
        self.calling = (function, self._gpu, time.monotonic())
        try:
            return getattr(self.nvml, function)(*args)
        finally:
            self.calling = None

    def _call(self, function: str, *args: Any) -> Any:
        """One NVML query: its answer, or None when NVML cannot give it (why is kept for
        ``Gpu.unread``)."""
        try:
            return self._invoke(function, *args)
        except self.nvml.NVMLError as exc:
            if getattr(exc, "value", None) == self.nvml.NVML_ERROR_GPU_IS_LOST:
                raise _Lost from None
            log.debug("NVML query failed", extra={"function": function, "reason": str(exc)})
            if len(self._unread) < MAX_UNREAD:
                self._unread[function] = str(exc)[:64]
            return None

    def hung(self, deadline: float) -> str:
        """ "nvmlDeviceGetX hung for N s" while a call has run ``deadline`` seconds or more."""
        calling = self.calling
        if calling is None:
            return ""
        function, gpu, started = calling
        elapsed = time.monotonic() - started
        if elapsed < deadline:
            return ""
        where = f" (GPU {gpu})" if gpu is not None else ""
        return f"{function} hung for {elapsed:.0f} s{where}"

    def _record_xid(self, source: str, index: int, code: int) -> None:
        if self.dedup.is_new(source, index, code, time.monotonic()):
            count_xid(self.xids.setdefault(index, {}), code, time.time())

    def _drain_events(self) -> None:
        if self.events is None:
            return
        for _ in range(MAX_EVENTS_PER_READ):
            try:
                data = self._invoke("nvmlEventSetWait_v2", self.events, 0)
            except self.nvml.NVMLError as exc:
                if getattr(exc, "value", None) != self.nvml.NVML_ERROR_TIMEOUT:
                    log.warning("NVML event wait failed", extra={"reason": str(exc)})
                return
            if not data.eventType & self.nvml.nvmlEventTypeXidCriticalError:
                continue
            try:
                index = self.nvml.nvmlDeviceGetIndex(data.device)
            except self.nvml.NVMLError as exc:
                log.warning(
                    "XID on a GPU NVML cannot name",
                    extra={"xid": int(data.eventData), "reason": str(exc)},
                )
                continue
            self._record_xid("nvml", index, int(data.eventData))

    def _drain_kmsg(self) -> None:
        if self.kmsg is None:
            return
        by_pci = {pci_key(pci): index for index, (_, _, pci) in self.identity.items()}
        for pci, code in self.kmsg.poll():
            index = by_pci.get(pci)
            if index is not None:
                self._record_xid("kmsg", index, code)

    @property
    def error(self) -> str:
        """NVML's errors for GPUs it could not open; empty when every GPU has a handle."""
        return "; ".join(self.failures[index] for index in sorted(self.failures))

    def read(self) -> list[Gpu]:
        with self._lock:
            if self._closed:
                return []
            return self._read()

    def _read(self) -> list[Gpu]:
        gpus = [self._read_one(index, handle) for index, handle in enumerate(self.handles)]
        self._gpu = None
        self._drain_events()
        self._drain_kmsg()
        # XIDs drained after the readings belong in this sample, not the next one.
        for index, codes in self.xids.items():
            if index < len(gpus):
                gpus[index] = msgspec.structs.replace(gpus[index], xids=in_code_order(codes))
        return gpus

    def _read_one(self, index: int, handle: Any) -> Gpu:
        self._gpu = index
        try:
            if index not in self.lost:
                return self._query(index, handle)
        except _Lost:
            log.error("GPU is lost (NVML GpuIsLost)", extra={"gpu": index})
            self.lost.add(index)
        uuid, name, pci = self.identity.get(index, ("", "", ""))
        return Gpu(
            index=index,
            uuid=uuid,
            name=name,
            pci_bus_id=pci,
            memory_total=self.memory_total.get(index, 0),
            memory_used=0,
            lost=True,
        )

    def _query(self, index: int, handle: Any) -> Gpu:
        nvml = self.nvml
        self._unread = {}
        if index not in self.identity:
            pci_info = self._call("nvmlDeviceGetPciInfo", handle)
            self.identity[index] = (
                _text(self._call("nvmlDeviceGetUUID", handle) or ""),
                _text(self._call("nvmlDeviceGetName", handle) or ""),
                _text(pci_info.busId) if pci_info is not None else "",
            )
        uuid, name, pci = self.identity[index]
        if index not in self.static:
            self.static[index] = nvml_readings.static_readings(self._call, nvml, handle)
            self.static_unread[index] = dict(self._unread)
        self._unread = dict(self.static_unread[index])
        static = dict(self.static[index])
        links = static.pop("links")
        memory = self._memory(handle)
        if memory is not None:
            self.memory_total[index] = int(memory.total)
        temperature = self._call("nvmlDeviceGetTemperature", handle, nvml.NVML_TEMPERATURE_GPU)
        power_mw = self._call("nvmlDeviceGetPowerUsage", handle)
        limit_mw = self._call("nvmlDeviceGetEnforcedPowerLimit", handle)
        utilization = self._call("nvmlDeviceGetUtilizationRates", handle)
        corrected, uncorrected = (
            self._call("nvmlDeviceGetTotalEccErrors", handle, error_type, nvml.NVML_VOLATILE_ECC)
            for error_type in (
                nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED,
                nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
            )
        )
        return Gpu(
            index=index,
            uuid=uuid,
            name=name,
            pci_bus_id=pci,
            memory_total=self.memory_total.get(index, 0),
            memory_used=int(memory.used) if memory is not None else 0,
            temperature_c=float(temperature) if temperature is not None else None,
            power_w=power_mw / 1000.0 if power_mw is not None else None,
            power_limit_w=limit_mw / 1000.0 if limit_mw is not None else None,
            utilization_pct=float(utilization.gpu) if utilization is not None else None,
            ecc_corrected=int(corrected) if corrected is not None else None,
            ecc_uncorrected=int(uncorrected) if uncorrected is not None else None,
            health=self._health(handle, static, links, _reserved(memory)),
        )

    def _health(
        self, handle: Any, static: dict[str, Any], links: list[int], reserved: int | None
    ) -> GpuHealth:
        """The deep readings; ``unread`` gathers why every None reading of the GPU is None;
        ``reserved``: the driver's reserved memory (v2 memory answer)."""
        nvml = self.nvml
        return GpuHealth(
            **static,
            **nvml_readings.memory_readings(self._call, nvml, handle),
            **nvml_readings.clock_readings(self._call, nvml, handle),
            **nvml_readings.link_readings(self._call, nvml, handle, links),
            unread=self._unread,
            memory_reserved=reserved,
        )

    def _memory(self, handle: Any) -> Any:
        """The device's memory: the v2 answer (``used`` without the driver's reserved
        memory, ``reserved`` beside it, as nvidia-smi counts) where the driver has it, else
        the v1 answer (``used`` with it); None when NVML cannot say."""
        if self.memory_v2:
            try:
                return self._invoke("nvmlDeviceGetMemoryInfo", handle, self.nvml.nvmlMemory_v2)
            except self.nvml.NVMLError as exc:
                code = getattr(exc, "value", None)
                if code == self.nvml.NVML_ERROR_GPU_IS_LOST:
                    raise _Lost from None
                missing = ("FUNCTION_NOT_FOUND", "NOT_SUPPORTED", "ARGUMENT_VERSION_MISMATCH")
                if code not in [getattr(self.nvml, f"NVML_ERROR_{name}", -1) for name in missing]:
                    return None
                log.info("no nvmlDeviceGetMemoryInfo_v2; memory used includes reserved")
                self.memory_v2 = False
        return self._call("nvmlDeviceGetMemoryInfo", handle)

    def close(self) -> None:
        """Free the event set and shut NVML down, once; errors on the way out are logged.
        A read stuck in a hung NVML call is left behind (NVML is not shut down under it)."""
        if not self._lock.acquire(timeout=CLOSE_WAIT):
            log.error("NVML not shut down: a call hangs", extra={"call": self.hung(0.0)})
            return
        try:
            if self._closed:
                return
            self._closed = True
            if self.kmsg is not None:
                self.kmsg.close()
            try:
                if self.events is not None:
                    self.nvml.nvmlEventSetFree(self.events)
            except self.nvml.NVMLError as exc:
                log.debug("NVML event set not freed", extra={"reason": str(exc)})
            self._shutdown()
        finally:
            self._lock.release()

    def _shutdown(self) -> None:
        try:
            self.nvml.nvmlShutdown()
        except self.nvml.NVMLError as exc:
            log.debug("NVML shutdown failed", extra={"reason": str(exc)})
