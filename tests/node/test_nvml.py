"""NVML inventory against a replaced pynvml (recorded answers), and kernel-log XIDs."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pynvml
import pytest

from actors.node.health.actor import HealthActor
from actors.node.inventory import actor as inventory
from actors.node.inventory import nvml_gpus
from actors.node.inventory.actor import InventoryActor
from actors.node.inventory.fake_gpus import FakeGpus
from actors.node.inventory.kmsg import KmsgXids, parse_xid_line, pci_key
from actors.node.inventory.nvml_gpus import FailedNvml, NvmlGpus, NvmlUnavailable, open_within
from actors.node.inventory.watchdog import GpuWatchdog
from schemas import codec
from schemas.events import HealthCheck, RowRemap, Sample
from tests.support.fleet import Fleet, agent_config, wait_for
from tests.support.nvml import RecordedNvml, health_of

H100_MEMORY = 85_520_809_984
LOST = pynvml.NVML_ERROR_GPU_IS_LOST
NOT_SUPPORTED = pynvml.NVML_ERROR_NOT_SUPPORTED


def two_gpus() -> RecordedNvml:
    """Two copies of the recorded H100 (bus ids 3B and 3C)."""
    return RecordedNvml(2)


def failing_init(error: int) -> RecordedNvml:
    """An NVML whose nvmlInit raises ``error``."""
    nvml = RecordedNvml(0)
    nvml.init_error = error
    return nvml


def test_a_driver_without_memory_info_v2_reads_v1() -> None:
    """A driver without nvmlDeviceGetMemoryInfo_v2: memory from v1 (used includes the
    reserved memory, none reported beside it), and v2 is not asked again."""
    nvml = two_gpus()
    for index in (0, 1):
        nvml.errors[(index, "nvmlDeviceGetMemoryInfo")] = pynvml.NVML_ERROR_FUNCTION_NOT_FOUND
    gpus = NvmlGpus(nvml=nvml)
    first = gpus.read()  # v2 refused on GPU 0: v1 from there on (the stand-in refuses both)
    assert health_of(first[0]).memory_reserved is None and not gpus.memory_v2
    nvml.errors.clear()
    gpu = gpus.read()[0]
    assert (gpu.memory_used, health_of(gpu).memory_reserved) == (480 * 2**20, None)


def test_recorded_answers_become_gpus() -> None:
    """Every recorded H100 answer lands in its Gpu field: power in W, names decoded,
    versions from the system calls; what the H100 does not support is None with NVML's
    reason in ``unread`` (retired pages, NVLink, fabric), never a fault."""
    source = NvmlGpus(nvml=two_gpus())
    gpus = source.read()
    assert [gpu.index for gpu in gpus] == [0, 1]
    gpu = gpus[1]
    assert gpu.uuid == "GPU-00000001-aaaa-bbbb-cccc-dddddddddddd"
    assert gpu.name == "NVIDIA H100 80GB HBM3"
    assert gpu.pci_bus_id == "00000000:3C:00.0"
    assert gpu.memory_total == H100_MEMORY
    # nvidia-smi's count (v2): the driver's reserved 480 MiB beside used, not in it.
    assert (gpu.memory_used, health_of(gpu).memory_reserved) == (0, 480 * 2**20)
    assert gpu.temperature_c == 39.0
    assert gpu.power_w == pytest.approx(71.514)
    assert gpu.power_limit_w == 700.0
    assert gpu.utilization_pct == 0.0
    assert (gpu.ecc_corrected, gpu.ecc_uncorrected) == (0, 0)
    assert (health_of(gpu).ecc_corrected_aggregate, health_of(gpu).ecc_uncorrected_aggregate) == (
        0,
        0,
    )
    assert health_of(gpu).remap == RowRemap(
        correctable=0, uncorrectable=0, pending=False, failed=False, banks_none=0, banks_low=0
    )
    assert health_of(gpu).retired_pages is None and health_of(gpu).retired_pending is None
    assert health_of(gpu).unread["nvmlDeviceGetRetiredPages"] == "Not Supported"
    assert health_of(gpu).unread["nvmlDeviceGetRetiredPagesPendingStatus"] == "Not Supported"
    assert health_of(gpu).clock_reasons == 1
    assert (health_of(gpu).sm_clock_mhz, health_of(gpu).sm_clock_max_mhz) == (345, 1980)
    assert (health_of(gpu).memory_clock_mhz, health_of(gpu).memory_clock_max_mhz) == (2619, 2619)
    assert health_of(gpu).pcie_replays == 2
    assert (health_of(gpu).pcie_generation, health_of(gpu).pcie_generation_max) == (5, 5)
    assert (health_of(gpu).pcie_width, health_of(gpu).pcie_width_max) == (16, 16)
    assert health_of(gpu).nvlinks is None and "nvmlDeviceGetNvLinkState" in health_of(gpu).unread
    assert health_of(gpu).fabric is None and health_of(gpu).persistence_mode is True
    assert not gpu.lost and gpu.xids == []
    assert source.versions == ("580.159.04", "13.0")
    again = source.read()[1]
    assert health_of(again).nvlinks is None and health_of(again).unread == health_of(gpu).unread


def test_not_supported_fields_are_none() -> None:
    """A field NVML does not support is None for that field only; the read goes on."""
    nvml = two_gpus()
    for name in ("nvmlDeviceGetTemperature", "nvmlDeviceGetPowerUsage"):
        nvml.errors[(0, name)] = NOT_SUPPORTED
    nvml.errors[(0, "nvmlDeviceGetTotalEccErrors")] = pynvml.NVML_ERROR_NO_PERMISSION
    gpu = NvmlGpus(nvml=nvml).read()[0]
    assert gpu.temperature_c is None and gpu.power_w is None
    assert gpu.ecc_corrected is None and gpu.ecc_uncorrected is None
    assert gpu.utilization_pct == 0.0 and gpu.power_limit_w == 700.0
    assert health_of(gpu).unread["nvmlDeviceGetTemperature"] == "Not Supported"
    assert health_of(gpu).unread["nvmlDeviceGetTotalEccErrors"] == "Insufficient Permissions"


def test_gpu_is_lost_marks_device_lost_for_good() -> None:
    """GpuIsLost marks that GPU lost, keeps its identity, and stops querying it."""
    nvml = two_gpus()
    gpus = NvmlGpus(nvml=nvml)
    gpus.read()
    nvml.errors[(1, "nvmlDeviceGetMemoryInfo")] = LOST
    first = gpus.read()
    assert first[1].lost and not first[0].lost
    assert first[1].uuid == "GPU-00000001-aaaa-bbbb-cccc-dddddddddddd"
    assert first[1].memory_total == H100_MEMORY and first[1].temperature_c is None
    nvml.calls.clear()
    assert gpus.read()[1].lost
    assert all(handle == 0 for handle, _ in nvml.calls)


def test_xid_events_are_counted_per_gpu_and_code() -> None:
    """XID events drained from the event set become XidCounts on their GPU."""
    nvml = two_gpus()
    gpus = NvmlGpus(nvml=nvml)
    nvml.xid(1, 79)
    nvml.xid(1, 79)
    nvml.xid(0, 13)
    result = gpus.read()
    assert [(xid.code, xid.count) for xid in result[1].xids] == [(79, 2)]
    assert [(xid.code, xid.count) for xid in result[0].xids] == [(13, 1)]
    nvml.xid(1, 48)
    assert [(xid.code, xid.count) for xid in gpus.read()[1].xids] == [(48, 1), (79, 2)]


def test_kmsg_fallback_for_gpus_without_events(tmp_path: Path) -> None:
    """A GPU whose event registration fails gets its XIDs from the kernel log, by PCI id;
    an XID both NVML's events and the kernel log report counts once."""
    log = tmp_path / "kmsg"
    log.write_text("6,1,2,-;nvidia: loading\n")
    nvml = two_gpus()
    nvml.errors[(1, "nvmlDeviceRegisterEvents")] = NOT_SUPPORTED
    gpus = NvmlGpus(nvml=nvml, xid_log_path=str(log))
    try:
        assert all(gpu.xids == [] for gpu in gpus.read())
        nvml.xid(0, 48)
        with log.open("a") as handle:
            handle.write("4,2,3,-;NVRM: Xid (PCI:0000:3c:00): 79, pid=1, GPU has fallen off\n")
            # GPU 0's XID 48 also came as an NVML event: one XID, counted once.
            handle.write("4,3,4,-;NVRM: Xid (PCI:0000:3b:00): 48, pid=1, DBE\n")
        result = gpus.read()
        assert [(xid.code, xid.count) for xid in result[1].xids] == [(79, 1)]
        assert [(xid.code, xid.count) for xid in result[0].xids] == [(48, 1)]
    finally:
        gpus.close()


def test_init_failure_is_unavailable() -> None:
    """nvmlInit failing (no driver) raises NvmlUnavailable with NVML's reason."""
    with pytest.raises(NvmlUnavailable, match="Driver Not Loaded"):
        NvmlGpus(nvml=failing_init(pynvml.NVML_ERROR_DRIVER_NOT_LOADED))


def test_choose_gpus_never_simulates_unasked(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """fake_gpus unset (auto): NVML when it works; no GPUs when the library is absent and
    none expected; a failing source (never fake GPUs) when NVML fails or GPUs are expected;
    fake GPUs only when fake_gpus asks."""

    def choose(nvml: RecordedNvml, **settings: Any) -> inventory.GpuSource | None:
        monkeypatch.setattr(nvml_gpus, "pynvml", nvml)
        config = agent_config("nats://127.0.0.1:1", "t", tmp_path, **settings)
        return inventory.choose_gpus(config)

    assert isinstance(choose(two_gpus(), fake_gpus=None, expected_gpus=3), NvmlGpus)
    assert isinstance(choose(two_gpus(), fake_gpus="auto"), NvmlGpus)
    no_library = pynvml.NVML_ERROR_LIBRARY_NOT_FOUND
    assert choose(failing_init(no_library), fake_gpus=None) is None
    expected = choose(failing_init(no_library), fake_gpus=None, expected_gpus=8)
    assert isinstance(expected, FailedNvml) and "NVML Shared Library Not Found" in expected.error
    broken = choose(failing_init(pynvml.NVML_ERROR_DRIVER_NOT_LOADED), fake_gpus=None)
    assert isinstance(broken, FailedNvml) and "Driver Not Loaded" in broken.error
    assert choose(two_gpus(), fake_gpus=0) is None
    fake = choose(two_gpus(), fake_gpus=3)
    assert isinstance(fake, FakeGpus) and fake.count == 3


def judged(
    gpus: inventory.GpuSource | None, tmp_path: Path, expected: int | None
) -> tuple[Sample, dict[str, HealthCheck]]:
    """One inventory sample from ``gpus`` and the sample checks health makes of it."""
    config = agent_config("nats://127.0.0.1:1", "t", tmp_path, fake_gpus=0, expected_gpus=expected)
    sample = InventoryActor(config, None, None, gpus).sample()  # type: ignore[arg-type]
    codec.decode(codec.encode(sample), Sample)
    health = HealthActor(config, None, None)  # type: ignore[arg-type]
    health.observe_sample(sample)
    return sample, health.sample_checks


def test_broken_driver_is_unhealthy_not_eight_healthy_gpus(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """nvmlInit failing with expected_gpus 8: no GPUs, source nvml, and the nvml and boot
    checks unhealthy with NVML's error text and an action."""
    monkeypatch.setattr(nvml_gpus, "pynvml", failing_init(pynvml.NVML_ERROR_DRIVER_NOT_LOADED))
    config = agent_config("nats://127.0.0.1:1", "t", tmp_path, fake_gpus=None, expected_gpus=8)
    sample, found = judged(inventory.choose_gpus(config), tmp_path, 8)
    assert (sample.gpu_source, sample.gpus, sample.capacity.gpus_total) == ("nvml", [], 0)
    assert "Driver Not Loaded" in sample.gpu_error
    assert found["nvml"].status == "unhealthy" and "Driver Not Loaded" in found["nvml"].reason
    assert "nvidia-smi" in found["nvml"].action
    assert found["boot"].status == "unhealthy"
    assert found["boot"].reason.startswith("expected 8 GPUs, 0 answer (")


def test_failing_nvml_is_retried_until_it_works() -> None:
    """A failing NVML is opened again later; once the driver answers, its GPUs are read
    and the error is gone; close shuts the reopened NVML down."""
    nvml = two_gpus()
    nvml.init_error = pynvml.NVML_ERROR_DRIVER_NOT_LOADED
    failed = FailedNvml("Driver Not Loaded", reopen=lambda: NvmlGpus(nvml=nvml), retry_every=0)
    assert failed.read() == [] and "Driver Not Loaded" in failed.error
    nvml.init_error = None
    assert [gpu.index for gpu in failed.read()] == [0, 1] and failed.error == ""
    failed.close()
    assert nvml.shutdowns == 1


async def test_an_init_that_hangs_never_holds_the_start() -> None:
    """nvmlInit hanging: the open gives up at its deadline with a failing source naming
    the hang (the sample's gpu_error, and the watchdog's ``hung`` that /healthz reports);
    once the init returns, the GPUs are read and the error is gone."""
    nvml = two_gpus()
    nvml.init_release = threading.Event()
    started = time.monotonic()
    source = open_within(lambda: NvmlGpus(nvml=nvml), 0.2)
    assert time.monotonic() - started < 5.0
    assert isinstance(source, FailedNvml) and source.error.startswith("nvmlInit hung for ")
    watchdog = GpuWatchdog(source, 0.2)
    assert await watchdog.read() == [] and watchdog.hung.startswith("nvmlInit hung for ")
    nvml.init_release.set()
    await wait_for(lambda: nvml.initialised == 1)

    async def gpus_read() -> bool:
        return [gpu.index for gpu in await watchdog.read()] == [0, 1]

    await wait_for(gpus_read)
    assert (watchdog.hung, source.error) == ("", "")
    source.close()
    assert nvml.shutdowns == 1


async def test_an_init_that_returns_after_the_agent_stopped_is_shut_down() -> None:
    """A hung nvmlInit that returns after the source was closed is shut down again."""
    nvml = two_gpus()
    nvml.init_release = threading.Event()
    source = open_within(lambda: NvmlGpus(nvml=nvml), 0.2)
    watchdog = GpuWatchdog(source, 0.2)
    assert await watchdog.read() == []
    source.close()
    nvml.init_release.set()
    await wait_for(lambda: nvml.shutdowns == 1)


def test_an_init_that_fails_in_time_is_unavailable() -> None:
    """open_within passes an init that fails before its deadline on as NvmlUnavailable."""
    with pytest.raises(NvmlUnavailable, match="Driver Not Loaded"):
        open_within(lambda: NvmlGpus(nvml=failing_init(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)), 5)


def test_device_count_short_of_expected_is_unhealthy(tmp_path: Path) -> None:
    """NVML sees 2 GPUs where 4 are expected: boot and nvml unhealthy, naming both counts."""
    sample, found = judged(NvmlGpus(nvml=two_gpus()), tmp_path, 4)
    assert len(sample.gpus) == 2 and sample.gpu_source == "nvml"
    assert found["boot"].status == "unhealthy"
    assert found["boot"].reason == "expected 4 GPUs, 2 answer" and found["boot"].action
    assert found["nvml"].status == "unhealthy" and found["nvml"].action
    assert found["nvml"].reason == "NVML sees 2 devices, expected 4"


def test_zero_gpus_with_expected_gpus_is_unhealthy(tmp_path: Path) -> None:
    """A node without GPUs whose expected_gpus says 2 is unhealthy, not fine."""
    sample, found = judged(None, tmp_path, 2)
    assert sample.gpu_source == "none" and found["boot"].status == "unhealthy"


def test_gpu_answering_no_query_is_unhealthy(tmp_path: Path) -> None:
    """A GPU whose every reading fails (not lost, just silent) is unhealthy, not degraded."""
    nvml = two_gpus()
    for name in (
        "nvmlDeviceGetTemperature",
        "nvmlDeviceGetPowerUsage",
        "nvmlDeviceGetEnforcedPowerLimit",
        "nvmlDeviceGetUtilizationRates",
        "nvmlDeviceGetMemoryInfo",
        "nvmlDeviceGetTotalEccErrors",
    ):
        nvml.errors[(1, name)] = pynvml.NVML_ERROR_UNKNOWN
    sample, found = judged(NvmlGpus(nvml=nvml), tmp_path, 2)
    assert not sample.gpus[1].lost and sample.gpus[1].temperature_c is None
    assert found["nvml"].status == "unhealthy"
    assert found["nvml"].reason == "GPU 1 answer no NVML query" and found["nvml"].action


def test_gpu_without_handle_reports_nvml_error(tmp_path: Path) -> None:
    """A GPU NVML cannot open: lost, and NVML's error for it travels in the sample."""
    nvml = RecordedNvml(1)
    nvml.nvmlDeviceGetHandleByIndex = lambda index: (_ for _ in ()).throw(  # type: ignore[method-assign]
        pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)
    )
    sample, found = judged(NvmlGpus(nvml=nvml), tmp_path, 1)
    assert sample.gpus[0].lost and "GPU 0: nvmlDeviceGetHandleByIndex" in sample.gpu_error
    assert found["nvml"].status == "unhealthy" and "Unknown Error" in found["nvml"].reason


async def test_agent_shuts_nvml_down_on_exit(monkeypatch: pytest.MonkeyPatch, fleet: Fleet) -> None:
    """An agent reading real (recorded) GPUs calls nvmlShutdown once when it stops."""
    nvml = two_gpus()
    monkeypatch.setattr(nvml_gpus, "pynvml", nvml)
    await fleet.start_aggregator()
    agent = await fleet.start_agent(fleet.config(fake_gpus=None))
    await wait_for(lambda: nvml.calls)
    assert nvml.initialised == 1 and nvml.shutdowns == 0
    await agent.stop()
    assert nvml.shutdowns == 1 and nvml.freed == 1


@pytest.mark.parametrize(
    ("line", "parsed"),
    [
        (
            "NVRM: Xid (PCI:0000:3b:00): 79, pid=123, GPU has fallen off the bus.",
            ("0000:3b:00", 79),
        ),
        ("6,1234,5678,-;NVRM: Xid (PCI:0000:86:00): 48, pid=9, DBE", ("0000:86:00", 48)),
        ("[ 12.3] NVRM: Xid (PCI:00000000:3B:00.0): 13, Graphics Exception", ("0000:3b:00", 13)),
        ("NVRM: loading NVIDIA UNIX x86_64 Kernel Module", None),
        ("NVRM: Xid (PCI:garbage): 79", None),
    ],
)
def test_parse_xid_line(line: str, parsed: tuple[str, int] | None) -> None:
    """Driver XID lines give (PCI key, code) in any kernel-log framing; others give None."""
    assert parse_xid_line(line) == parsed


def test_pci_key_matches_nvml_and_kernel_forms() -> None:
    """NVML's bus id and the kernel's PCI tag normalise to the same key."""
    assert pci_key("00000000:3B:00.0") == pci_key("0000:3b:00") == "0000:3b:00"


def test_kmsg_reader_never_blocks_on_a_pipe(tmp_path: Path) -> None:
    """Reading an empty FIFO returns at once; lines come whole, partial lines wait."""
    fifo = tmp_path / "kmsg"
    os.mkfifo(fifo)
    reader = KmsgXids(str(fifo))
    writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    try:
        assert reader.poll() == []
        os.write(writer, b"NVRM: Xid (PCI:0000:3b:00): 79, pid=1\nNVRM: Xid (PCI:0000:3b:00)")
        assert reader.poll() == [("0000:3b:00", 79)]
        os.write(writer, b": 94, contained\n")
        assert reader.poll() == [("0000:3b:00", 94)]
        assert reader.poll() == []
    finally:
        os.close(writer)
        reader.close()


def test_unreadable_kernel_log_is_not_fatal(tmp_path: Path) -> None:
    """A kernel log that cannot be opened yields no XIDs rather than an error."""
    reader = KmsgXids(str(tmp_path / "missing"))
    assert reader.poll() == []
    reader.close()
