"""Inventory actor: what the node has (CPU, memory, disk, GPUs), published as ``Sample``.

GPUs come from NVML, or from simulated GPUs only when asked (``fake_gpus``). With
``fake_gpus`` unset (``auto``): NVML when it works; no GPUs when the NVML library is absent
and none are expected; and when NVML is there but fails (or is absent while
``expected_gpus`` says GPUs should be there), no GPUs plus NVML's error in every sample, so
health says unhealthy rather than a node that looks fine. GPUs are read through a
watchdog (:mod:`.watchdog`): an NVML call that hangs leaves the last readings in the
sample, names the call in ``gpu_error`` and fails ``/healthz``. Simulated GPUs take faults
injected on ``fleet.evt.<node>.inject``; a sample follows each fault at once so the fault
reaches health and the heartbeat without waiting a whole sample period.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import platform
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal, NamedTuple, Protocol

import psutil

from actors.node.config import AgentConfig
from actors.node.events import NodeEvents
from actors.node.gpu.capacity import free_gpus
from actors.node.inventory.fake_gpus import FakeGpus
from actors.node.inventory.nvml_gpus import FailedNvml, NvmlGpus, NvmlUnavailable, open_within
from actors.node.inventory.pci import passthrough_gpus
from actors.node.inventory.versions import read_versions
from actors.node.inventory.watchdog import GpuWatchdog
from actors.node.labels import cloud_labels, node_labels
from actors.node.tuning import retuned
from actors.runtime.bus import Bus
from actors.runtime.schedule import jittered, wait_or_timeout
from actors.runtime.subscriptions import listening
from schemas.base import MAX_GPUS, MAX_NAME, MAX_TEXT
from schemas.events import (
    Capacity,
    CloudFacts,
    Dependency,
    Event,
    Gpu,
    HostFacts,
    Inject,
    Sample,
)
from schemas.messages import NodeIdentity, identity_of
from schemas.settings import Settings
from schemas.subjects import EVENT_INJECT, EVENT_SAMPLE, EVENT_SETTINGS, Subjects

log = logging.getLogger(__name__)

KMSG_CURSOR = "kmsg.cursor"
"""File in the state dir: the last kernel-log XID record counted in this boot."""


class GpuSource(Protocol):
    @property
    def source(self) -> Literal["nvml", "fake"]: ...

    @property
    def error(self) -> str:
        """Why the source cannot see (some of) its GPUs; empty when it can."""
        ...

    @property
    def versions(self) -> tuple[str, str]:
        """The GPU driver's version and the CUDA version it supports; "" when unknown."""
        ...

    def read(self) -> list[Gpu]: ...

    def hung(self, deadline: float) -> str:
        """The call that has run ``deadline`` seconds or more ("" if none)."""
        ...

    def close(self) -> None:
        """Free what the source holds (NVML: nvmlShutdown); called once, on the way out."""
        ...


def choose_gpus(config: AgentConfig) -> GpuSource | None:
    """Simulated GPUs only when ``fake_gpus`` asks (0: none); otherwise NVML, never a
    simulation standing in for a broken driver, opened within ``nvml_deadline`` (an init
    that hangs leaves a failing source that names it and reads the GPUs once it returns)."""
    if config.fake_gpus == 0:
        return None
    if isinstance(config.fake_gpus, int):
        return FakeGpus(config.fake_gpus, config.node_id)

    def open_nvml() -> NvmlGpus:
        cursor = Path(config.state_dir) / KMSG_CURSOR
        return NvmlGpus(xid_log_path=config.xid_log_path, kmsg_cursor=cursor)

    try:
        return open_within(open_nvml, config.nvml_deadline)
    except NvmlUnavailable as exc:
        if exc.library_missing and not config.expected_gpus:
            log.info("no NVML library: a node without GPUs", extra={"reason": exc.reason})
            return None
        log.error(
            "NVML fails: GPUs reported unhealthy",
            extra={"reason": exc.reason, "expected_gpus": config.expected_gpus},
        )
        return FailedNvml(exc.reason, reopen=open_nvml)


class DiskUsage(NamedTuple):
    total: int
    free: int
    percent: float


class CpuMeter:
    """CPU busy % over the time between two reads — a delta, never since boot. Unlike
    ``psutil.cpu_percent(interval=None)`` it keeps its own previous reading, so several
    agents in one process (``fleetctl up``) do not reset each other's period."""

    def __init__(self) -> None:
        self._busy, self._total = self._times()

    @staticmethod
    def _times() -> tuple[float, float]:
        times = psutil.cpu_times()
        # Linux counts guest time inside user/nice too; psutil leaves it out of the total.
        total = sum(times) - getattr(times, "guest", 0.0) - getattr(times, "guest_nice", 0.0)
        idle = times.idle + getattr(times, "iowait", 0.0)
        return total - idle, total

    def read(self) -> float:
        busy, total = self._times()
        busy_delta, total_delta = busy - self._busy, total - self._total
        self._busy, self._total = busy, total
        if total_delta <= 0:
            return 0.0
        return round(min(100.0, max(0.0, 100.0 * busy_delta / total_delta)), 1)


async def read_identity(config: AgentConfig, cloud: CloudFacts | None = None) -> NodeIdentity:
    """This machine's host name, GPUs (NVML's or the stand-in's, read once, bounded by
    ``nvml_deadline``; passthrough ones from the PCI bus) and, from ``cloud`` and the
    operator's labels (which win, as in heartbeats), its provider, region and instance
    type: the identity ``node-agent register`` sends, which an approval records as the
    node's enrolled identity. No GPUs when they cannot be read in time."""
    source = choose_gpus(config)
    gpus: list[Gpu] = []
    if source is not None:
        watchdog = GpuWatchdog(source, config.nvml_deadline)
        gpus = await watchdog.read()
        if not watchdog.hung:
            source.close()  # a hung read keeps its source: the process is about to exit
    passthrough = await asyncio.to_thread(passthrough_gpus, pci_root(config))
    labels = node_labels(config.labels, cloud_labels(cloud) if cloud is not None else {})
    return identity_of(socket.gethostname()[:255], gpus[:MAX_GPUS], passthrough, labels)


def pci_root(config: AgentConfig) -> str:
    """The sysfs searched for passthrough GPUs: none where ``fake_gpus`` is set (a
    simulated node has no PCI bus, and must not show its host's; 0 says it has no GPU)."""
    return "" if isinstance(config.fake_gpus, int) else config.sysfs_root


def idle_cores(cores: int, busy_pct: float) -> int:
    """Cores free for more work as the CPU meter sees them: the idle share, rounded down."""
    return max(0, math.floor(cores * (100.0 - busy_pct) / 100.0))


def host_identity() -> list[str]:
    """Identifiers of the machine that survive reboots: machine id, CPU count, memory."""
    try:
        machine_id = Path("/etc/machine-id").read_text().strip()
    except OSError:
        machine_id = socket.gethostname()
    return [machine_id, str(psutil.cpu_count()), str(psutil.virtual_memory().total)]


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name as the kernel gives it (x86 ``model name``, Arm ``Model`` or
    ``Hardware``), else what the platform module says; read once, it does not change."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        text = ""
    for key in ("model name", "Model", "Hardware", "cpu model"):
        for line in text.splitlines():
            name, _, value = line.partition(":")
            if name.strip() == key and value.strip():
                return " ".join(value.split())[:MAX_NAME]
    return (platform.processor() or platform.machine())[:MAX_NAME]


def mean_utilization(gpus: list[Gpu]) -> float | None:
    """Mean utilization of the GPUs that report one (lost ones do not); None if none does."""
    readings = [
        gpu.utilization_pct for gpu in gpus if not gpu.lost and gpu.utilization_pct is not None
    ]
    return round(sum(readings) / len(readings), 1) if readings else None


def process_running(name: str) -> bool:
    """Whether a process called ``name`` runs (as far as this agent can see)."""
    for process in psutil.process_iter(["name"]):
        if process.info["name"] == name:
            return True
    return False


def fingerprint(gpus: list[Gpu], host: list[str] | None = None) -> str:
    """SHA-256 of the host's stable identifiers and the GPUs' UUIDs: it changes when the
    hardware does."""
    parts = (host if host is not None else host_identity()) + sorted(gpu.uuid for gpu in gpus)
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


class InventoryActor:
    """Subscribes to fleet.evt.<node>.{inject,settings}; publishes Sample on
    fleet.evt.<node>.sample."""

    name = "inventory"

    def __init__(
        self, config: AgentConfig, bus: Bus, events: NodeEvents, gpus: GpuSource | None = None
    ) -> None:
        self.config = config
        self.bus = bus
        self.events = events
        self.gpus = gpus if gpus is not None else choose_gpus(config)
        subjects = Subjects(config.prefix)
        self.subject = subjects.event(config.node_id, EVENT_SAMPLE)
        self.inject_subject = subjects.event(config.node_id, EVENT_INJECT)
        self.settings_subject = subjects.event(config.node_id, EVENT_SETTINGS)
        self.disk_path = config.storage_path or (
            config.state_dir if Path(config.state_dir).exists() else "/"
        )
        self._disk_failing = False
        self.cpu_model = cpu_model()
        self.versions: list[Dependency] = []
        """The latest dependency versions, refreshed off the sample path (_refresh_versions)."""
        self._sample_now = asyncio.Event()
        self.cpu = CpuMeter()
        self.host = host_identity()
        self.hostname = socket.gethostname()
        self.watchdog = (
            GpuWatchdog(self.gpus, config.nvml_deadline) if self.gpus is not None else None
        )
        self.sysfs_root = pci_root(config)

    def problem(self) -> str:
        """What hangs in NVML right now (``/healthz`` fails while it does)."""
        return self.watchdog.hung if self.watchdog is not None else ""

    async def _on_inject(self, event: Event) -> None:
        match event:
            case Inject(fault="spot"):
                pass  # the spot watcher's: a rehearsed notice, no GPU fault
            case Inject():
                self._inject(event)
            case Settings():
                # sample_interval is read at each sample.
                self.config = retuned(self.config, event)

    def _inject(self, inject: Inject) -> None:
        if not isinstance(self.gpus, FakeGpus):
            log.warning(
                "ignoring injected fault: GPUs are real",
                extra={
                    "fault": inject.fault,
                    "gpu_source": self.gpus.source if self.gpus else "none",
                },
            )
            return
        try:
            self.gpus.apply(inject)
        except ValueError as exc:
            log.warning("ignoring inject", extra={"reason": str(exc)})
            return
        log.info(
            "injected fault",
            extra={"fault": inject.fault, "gpu": inject.gpu, "value": inject.value},
        )
        self._sample_now.set()

    def sample(self, read: list[Gpu] | None = None) -> Sample:
        """The node now, with ``read`` as the GPUs' readings (None: read them here)."""
        if read is None:
            read = self.gpus.read() if self.gpus else []
        # A Sample reports at most MAX_GPUS devices: a heartbeat with more would be
        # refused by every aggregator, and the node would look dead instead of large.
        gpus = read[:MAX_GPUS]
        driver, cuda = self.gpus.versions if self.gpus else ("", "")
        fabric_manager = None
        process = self.config.fabric_manager_process
        if process and any(gpu.health and gpu.health.fabric for gpu in gpus):
            fabric_manager = process_running(process)
        memory = psutil.virtual_memory()
        disk = self._disk()
        cores, busy = psutil.cpu_count() or 0, self.cpu.read()
        capacity = Capacity(
            cpu_cores=cores,
            cpu_percent=busy,
            load_avg_1m=round(psutil.getloadavg()[0], 2),
            memory_total=memory.total,
            memory_available=memory.available,
            gpus_total=len(gpus),
            gpus_available=free_gpus(gpus, set()),
            storage_total=disk.total,
            storage_available=disk.free,
            cpu_cores_available=idle_cores(cores, busy),
        )
        host = HostFacts(
            uptime_s=max(0.0, round(time.time() - psutil.boot_time(), 1)),
            memory_used_pct=round(min(100.0, max(0.0, memory.percent)), 1),
            cpu_model=self.cpu_model,
            gpu_utilization_pct=mean_utilization(gpus),
            storage_path=self.disk_path[:MAX_TEXT],
            storage_used_pct=round(min(100.0, max(0.0, disk.percent)), 1),
            dependencies=self.versions,
            gpu_driver_version=driver[:MAX_NAME],
            cuda_driver_version=cuda[:MAX_NAME],
            fabric_manager_running=fabric_manager,
        )
        return Sample(
            ts=time.time(),
            capacity=capacity,
            gpus=gpus,
            gpu_source=self.gpus.source if self.gpus else "none",
            fingerprint=fingerprint(gpus, self.host),
            hostname=self.hostname,
            gpu_error=self._gpu_error()[:MAX_TEXT],
            host=host,
            passthrough_gpus=passthrough_gpus(self.sysfs_root),
        )

    def _gpu_error(self) -> str:
        """NVML's failure, or the call that hangs; "" when the GPUs answer."""
        errors = [self.gpus.error if self.gpus else "", self.problem()]
        return "; ".join(error for error in errors if error)

    async def _refresh_versions(self) -> None:
        """Read the dependency versions now and every version_refresh seconds; a sample
        takes the latest reading, never waits for one."""
        config = self.config
        while True:
            self.versions = await read_versions(config.version_programs, config.version_timeout)
            await asyncio.sleep(jittered(config.version_refresh))

    def _disk(self) -> DiskUsage:
        """Usage of the storage path; all 0 (and one warning until it is back) while it
        cannot be measured (a mount not there yet), rather than no sample at all."""
        try:
            usage = psutil.disk_usage(self.disk_path)
        except OSError as exc:
            if not self._disk_failing:
                log.warning(
                    "storage path cannot be measured",
                    extra={"path": self.disk_path, "reason": str(exc)},
                )
            self._disk_failing = True
            return DiskUsage(total=0, free=0, percent=0.0)
        self._disk_failing = False
        return DiskUsage(total=usage.total, free=usage.free, percent=usage.percent)

    def close(self) -> None:
        """Free the GPU source (NVML is shut down); the agent calls this once its actors
        have stopped."""
        if self.gpus is not None:
            self.gpus.close()

    async def run(self, ready: Callable[[], None]) -> None:
        routes = {
            subject: self.events.decoding(self.name, self._on_inject)
            for subject in (self.inject_subject, self.settings_subject)
        }
        versions = asyncio.create_task(self._refresh_versions(), name="dependency-versions")
        try:
            async with listening(self.bus, routes, ready):
                while True:
                    self._sample_now.clear()
                    read = await self.watchdog.read() if self.watchdog is not None else []
                    sample = await asyncio.to_thread(self.sample, read)
                    await self.events.publish(self.bus, self.subject, sample)
                    await wait_or_timeout(self._sample_now, jittered(self.config.sample_interval))
        finally:
            versions.cancel()
            await asyncio.gather(versions, return_exceptions=True)
