"""GPU health depth: the recorded H100 judged healthy, one case per reading failing, the
threshold table and its overrides, the XID tie-in, kernel-log replays and the NVML watchdog."""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pynvml
import pytest

from actors.node.config import ENV_PREFIX, AgentConfig
from actors.node.gpu.thresholds import GPU_THRESHOLDS, parse_gpu_thresholds
from actors.node.health.actor import HealthActor
from actors.node.health.gpu_checks import CHECK_NAMES, GpuJudge
from actors.node.http_api import HttpApiActor
from actors.node.inventory import nvml_gpus
from actors.node.inventory.actor import InventoryActor
from actors.node.inventory.kmsg import KmsgXids
from actors.node.inventory.nvml_gpus import NvmlGpus
from actors.runtime.config import ConfigError, build
from schemas import codec
from schemas.events import Capacity, HealthCheck, Sample
from tests.support.fleet import Fleet, agent_config, poll, wait_for
from tests.support.nvml import RecordedNvml, health_of

HW_SLOWDOWN = 0x8
ACTIVE = pynvml.NVML_FEATURE_ENABLED
INACTIVE = pynvml.NVML_FEATURE_DISABLED


def judge(
    nvml: RecordedNvml, tmp_path: Path, **settings: Any
) -> tuple[Sample, dict[str, HealthCheck]]:
    """One inventory sample read from ``nvml`` and the sample checks health makes of it."""
    config = agent_config("nats://127.0.0.1:1", "t", tmp_path, fake_gpus=0, **settings)
    sample = InventoryActor(config, None, None, NvmlGpus(nvml=nvml)).sample()  # type: ignore[arg-type]
    codec.decode(codec.encode(sample), Sample)
    health = HealthActor(config, None, None)  # type: ignore[arg-type]
    health.observe_sample(sample)
    return sample, health.sample_checks


def test_recorded_h100_is_healthy(tmp_path: Path) -> None:
    """The recorded H100 (idle, NVLink and retired pages NotSupported, no fabric state):
    every GPU check ok, the unsupported calls named, the versions in the host facts."""
    sample, found = judge(RecordedNvml(2), tmp_path)
    for name in CHECK_NAMES:
        assert found[name].status == "ok", found[name]
        assert found[name].reason.startswith("2 GPUs within thresholds")
    assert "nvmlDeviceGetRetiredPages: Not Supported (GPU 0, 1)" in found["gpu_memory"].reason
    assert "nvmlDeviceGetNvLinkState: Not Supported" in found["gpu_nvlink"].reason
    assert sample.host is not None
    assert (sample.host.gpu_driver_version, sample.host.cuda_driver_version) == (
        "580.159.04",
        "13.0",
    )
    assert sample.host.fabric_manager_running is None


@pytest.mark.parametrize(
    ("rows", "status", "text"),
    [
        ([0, 0, 1, 0], "degraded", "GPU 1: row remap pending"),
        ([0, 2, 0, 1], "unhealthy", "GPU 1: row remap failed"),
    ],
)
def test_row_remap_pending_or_failed(
    tmp_path: Path, rows: list[int], status: str, text: str
) -> None:
    """A row remap pending makes gpu_memory degraded (reset the GPU), a failed one
    unhealthy (RMA), each with the table's action."""
    nvml = RecordedNvml(2)
    nvml.set(1, "RemappedRows", rows)
    sample, found = judge(nvml, tmp_path)
    assert (
        health_of(sample.gpus[1]).remap is not None and health_of(sample.gpus[0]).remap is not None
    )
    assert found["gpu_memory"].status == status
    assert text in found["gpu_memory"].reason
    entry = "remap_pending" if status == "degraded" else "remap_failed"
    assert found["gpu_memory"].action == GPU_THRESHOLDS[entry].action


def test_uncorrectable_ecc_is_unhealthy(tmp_path: Path) -> None:
    """Volatile uncorrectable ECC errors make gpu_memory unhealthy, naming the GPU."""
    nvml = RecordedNvml(1)
    nvml.set(0, "TotalEccErrors.uncorrected.volatile", 3)
    _, found = judge(nvml, tmp_path)
    assert found["gpu_memory"].status == "unhealthy"
    assert "GPU 0: 3 uncorrectable ECC errors" in found["gpu_memory"].reason
    assert found["gpu_memory"].gpus == [0]


def test_harmful_clock_reason(tmp_path: Path) -> None:
    """HW slowdown is a finding (degraded), escalated to unhealthy when the SM clock is
    below half its maximum; benign reasons (idle, application clocks, SW power cap) are
    never findings."""
    nvml = RecordedNvml(1)
    nvml.set(0, "CurrentClocksEventReasons", HW_SLOWDOWN)
    nvml.set(0, "ClockInfo.sm", 1800)
    _, found = judge(nvml, tmp_path)
    assert found["gpu_clocks"].status == "degraded"
    assert found["gpu_clocks"].reason == "GPU 0 clocks held down by HW slowdown (SM 1800/1980 MHz)"
    nvml.set(0, "ClockInfo.sm", 600)
    _, found = judge(nvml, tmp_path)
    assert found["gpu_clocks"].status == "unhealthy"
    nvml.set(0, "CurrentClocksEventReasons", 0x1 | 0x2 | 0x4)
    _, found = judge(nvml, tmp_path)
    assert found["gpu_clocks"].status == "ok"


def test_pcie_downgrade(tmp_path: Path) -> None:
    """A link narrower than its maximum is degraded; a lower generation only while the
    GPU is not idle (idle GPUs lower their link speed to save power)."""
    nvml = RecordedNvml(1)
    nvml.set(0, "CurrPcieLinkGeneration", 3)
    _, found = judge(nvml, tmp_path)
    assert found["gpu_pcie"].status == "ok"  # the recorded GPU is idle
    nvml.set(0, "CurrentClocksEventReasons", 0)
    _, found = judge(nvml, tmp_path)
    assert found["gpu_pcie"].status == "degraded"
    assert "GPU 0: PCIe Gen3 of Gen5 while busy" in found["gpu_pcie"].reason
    nvml.set(0, "CurrPcieLinkGeneration", 5)
    nvml.set(0, "CurrPcieLinkWidth", 8)
    _, found = judge(nvml, tmp_path)
    assert found["gpu_pcie"].status == "degraded"
    assert found["gpu_pcie"].reason == "GPU 0: PCIe link x8 of x16"


def test_pcie_replay_rate_counts_one_minute() -> None:
    """Replays are judged as the counter's growth over the last minute, not per sample."""
    nvml = RecordedNvml(1)
    source = NvmlGpus(nvml=nvml)
    judge_ = GpuJudge()
    start = 1_700_000_000.0

    def pcie_at(offset: float, replays: int) -> HealthCheck:
        nvml.set(0, "PcieReplayCounter", replays)
        sample = Sample(ts=start + offset, capacity=_capacity(), gpus=source.read())
        return {check.name: check for check in judge_.checks(sample)}["gpu_pcie"]

    assert pcie_at(0, 2).status == "ok"
    assert pcie_at(30, 9).status == "ok"  # 7 in 30 s: below 8 a minute
    assert pcie_at(60, 12).status == "degraded"  # 10 within the last minute
    assert "10 PCIe replays in the last minute" in pcie_at(61, 12).reason
    assert pcie_at(125, 14).status == "ok"  # 2 since the reading a minute before


def test_nvlink_down_only_on_a_gpu_with_links(tmp_path: Path) -> None:
    """A GPU whose links answer, one inactive, is unhealthy naming the link; the recorded
    GPU (every link NotSupported) never raises NVLink-down."""
    nvml = RecordedNvml(2)
    for link in range(18):
        nvml.set(0, f"NvLink.{link}.State", INACTIVE if link == 3 else ACTIVE)
    sample, found = judge(nvml, tmp_path)
    links = health_of(sample.gpus[0]).nvlinks
    assert links is not None and len(links) == 18
    assert health_of(sample.gpus[1]).nvlinks is None
    assert found["gpu_nvlink"].status == "unhealthy"
    assert found["gpu_nvlink"].reason == "GPU 0: NVLink 3 down (17/18 active)"


def test_fabric_degraded_incomplete_and_manager(tmp_path: Path) -> None:
    """Fabric at degraded bandwidth: degraded; registration not started: unhealthy; on a
    GPU with a fabric state, a missing nvidia-fabricmanager process: unhealthy."""
    nvml = RecordedNvml(1)
    nvml.set(0, "GpuFabricInfoV", {"state": 3, "status": 0, "healthMask": 1})
    sample, found = judge(nvml, tmp_path, fabric_manager_process="")
    fabric = health_of(sample.gpus[0]).fabric
    assert fabric is not None and fabric.state == "completed"
    assert found["gpu_fabric"].status == "degraded"
    assert found["gpu_fabric"].reason == "GPU 0: fabric bandwidth degraded"
    nvml.set(0, "GpuFabricInfoV", {"state": 1, "status": 0, "healthMask": 0})
    _, found = judge(nvml, tmp_path, fabric_manager_process="")
    assert found["gpu_fabric"].status == "unhealthy"
    assert "fabric registration not started" in found["gpu_fabric"].reason
    nvml.set(0, "GpuFabricInfoV", {"state": 3, "status": 0, "healthMask": 2 << 14})
    sample, found = judge(nvml, tmp_path, fabric_manager_process="no-such-fabricmanager")
    assert sample.host is not None and sample.host.fabric_manager_running is False
    assert found["gpu_fabric"].status == "unhealthy"
    assert "fabric manager disconnected" in found["gpu_fabric"].reason
    assert "nvidia-fabricmanager not running" in found["gpu_fabric"].reason


def test_persistence_mode_off(tmp_path: Path) -> None:
    """Persistence mode off is degraded with the command that turns it on."""
    nvml = RecordedNvml(1)
    nvml.set(0, "PersistenceMode", 0)
    _, found = judge(nvml, tmp_path)
    assert found["gpu_settings"].status == "degraded"
    assert "nvidia-persistenced" in found["gpu_settings"].action


def test_thresholds_are_overridable(tmp_path: Path) -> None:
    """gpu_thresholds switches an entry off or moves its limit; unknown names and bad
    shapes are refused when the config loads."""
    nvml = RecordedNvml(1)
    nvml.set(0, "RemappedRows", [0, 0, 1, 0])
    nvml.set(0, "TotalEccErrors.corrected.volatile", 50)
    _, found = judge(nvml, tmp_path, gpu_thresholds=["remap_pending=off", "ecc_corrected=10"])
    assert found["gpu_memory"].status == "degraded"
    assert found["gpu_memory"].reason == "GPU 0: 50 corrected ECC errors"
    assert parse_gpu_thresholds(["pcie_replays_per_min=20.5"]) == {"pcie_replays_per_min": 20.5}
    for bad in (["no_such_reading=1"], ["remap_pending:1"]):
        with pytest.raises(ConfigError, match=r"gpu_thresholds|gpu threshold"):
            build(AgentConfig, ENV_PREFIX, env={}, flags={"gpu_thresholds": bad})


def test_xids_tie_into_remap_and_nvlink_readings(tmp_path: Path) -> None:
    """The xid check quotes the row-remap reading beside XID 63 and the NVLink reading
    beside XID 74."""
    nvml = RecordedNvml(2)
    nvml.set(0, "RemappedRows", [0, 1, 1, 0])
    nvml.xid(0, 63)
    nvml.xid(1, 74)
    _, found = judge(nvml, tmp_path)
    reason = found["xid"].reason
    assert (
        "XID 63 x1 on GPU 0 in 3600s: ECC page retirement / row remapping recorded (row "
        "remap: 0 correctable, 1 uncorrectable, pending yes, failed no)" in reason
    )
    assert "XID 74 x1 on GPU 1 in 3600s: NVLink error (NVLink not visible to NVML)" in reason


def kmsg_line(seq: int, pci: str, code: int) -> str:
    return f"3,{seq},{seq * 1000},-;NVRM: Xid (PCI:{pci}): {code}, pid=1, name=x\n"


def test_kmsg_replay_after_restart_not_counted_again(tmp_path: Path) -> None:
    """XIDs a previous agent counted in this boot are skipped when the restarted agent
    reads the replayed kernel log; new ones still count; a new boot counts them all."""
    log = tmp_path / "kmsg"
    cursor = tmp_path / "kmsg.cursor"
    log.write_text(kmsg_line(10, "0000:3b:00", 79) + kmsg_line(11, "0000:3c:00", 48))

    def xids(gpus: NvmlGpus) -> list[list[tuple[int, int]]]:
        return [[(xid.code, xid.count) for xid in gpu.xids] for gpu in gpus.read()]

    first = NvmlGpus(nvml=RecordedNvml(2), xid_log_path=str(log), kmsg_cursor=cursor)
    assert xids(first) == [[(79, 1)], [(48, 1)]]
    first.close()
    with log.open("a") as handle:
        handle.write(kmsg_line(12, "0000:3b:00", 94))
    again = NvmlGpus(nvml=RecordedNvml(2), xid_log_path=str(log), kmsg_cursor=cursor)
    assert xids(again) == [[(94, 1)], []]
    again.close()
    reboot = KmsgXids(str(log), cursor, boot="another-boot")
    assert len(reboot.poll()) == 3
    reboot.close()


def test_nvml_events_alone_when_kmsg_unreadable(tmp_path: Path) -> None:
    """With the kernel log unreadable (a container), NVML's XID events still count."""
    nvml = RecordedNvml(1)
    gpus = NvmlGpus(nvml=nvml, xid_log_path=str(tmp_path / "missing"))
    nvml.xid(0, 79)
    nvml.xid(0, 79)
    assert [(xid.code, xid.count) for xid in gpus.read()[0].xids] == [(79, 2)]


def test_hung_call_is_named_and_close_leaves_it(tmp_path: Path) -> None:
    """A hung NVML call is named with its GPU; close() does not wait for it forever and
    does not shut NVML down under it."""
    nvml = RecordedNvml(2)
    gpus = NvmlGpus(nvml=nvml)
    release = nvml.hang(1, "nvmlDeviceGetPowerUsage")
    reader = threading.Thread(target=gpus.read, daemon=True)
    reader.start()
    # Until the reader reaches the hanging call, hung(0.0) names whichever call is in
    # flight (on a starved machine the poll can catch an earlier one): wait for it.
    poll(lambda: gpus.hung(0.0).startswith("nvmlDeviceGetPowerUsage "), interval=0.01)
    assert re.match(r"nvmlDeviceGetPowerUsage hung for \d+ s \(GPU 1\)", gpus.hung(0.0))
    assert gpus.hung(60.0) == ""
    gpus.close()
    assert nvml.shutdowns == 0
    release.set()
    reader.join(5)


async def test_hung_nvml_fails_healthz_not_the_heartbeat(
    monkeypatch: pytest.MonkeyPatch, fleet: Fleet
) -> None:
    """An NVML call that hangs: /healthz 503 naming it, the nvml check unhealthy, and
    heartbeats keep going; once it returns, /healthz is 200 again."""
    nvml = RecordedNvml(2)
    monkeypatch.setattr(nvml_gpus, "pynvml", nvml)
    release = nvml.hang(1, "nvmlDeviceGetTemperature")
    await fleet.start_aggregator()
    agent = await fleet.start_agent(fleet.config(fake_gpus=None, nvml_deadline=0.3))
    assert agent.supervisor is not None and await agent.supervisor.wait_ready(10)
    http = next(actor for actor in agent.supervisor.actors if isinstance(actor, HttpApiActor))

    async def get(path: str) -> tuple[int, str]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
            async with session.get(f"http://127.0.0.1:{http.port}{path}") as response:
                return response.status, await response.text()

    async def hung_healthz() -> str | None:
        # Named once the read thread is inside the call: on a starved machine the first
        # 503 may say only "the GPU read has taken over 0.3 s".
        status, body = await get("/healthz")
        return body if status == 503 and "nvmlDeviceGetTemperature hung for" in body else None

    body = await wait_for(hung_healthz)
    assert "(GPU 1)" in body

    async def nvml_check() -> dict[str, Any] | None:
        _, text = await get("/status")
        status = msgspec.json.decode(text)
        checks = {check["name"]: check for check in (status["health"] or {}).get("checks", [])}
        nvml_found = checks.get("nvml")
        return status if nvml_found and "hung for" in nvml_found["reason"] else None

    status = await wait_for(nvml_check)
    assert {c["name"]: c for c in status["health"]["checks"]}["nvml"]["status"] == "unhealthy"

    # The heartbeat goes on while the call hangs.
    def sequence() -> float:
        return agent.metrics.value("node_agent_sequence_number") or 0.0

    seq = sequence()
    await wait_for(lambda: sequence() > seq + 1)
    assert (await get("/healthz"))[0] == 503
    release.set()

    async def healthy() -> bool:
        return (await get("/healthz"))[0] == 200

    await wait_for(healthy)


def _capacity() -> Capacity:
    return Capacity(
        cpu_cores=1,
        cpu_percent=0.0,
        load_avg_1m=0.0,
        memory_total=1,
        memory_available=1,
        gpus_total=1,
        gpus_available=1,
        storage_total=1,
        storage_available=1,
    )


def test_gpu_checks_leave_with_the_gpus(tmp_path: Path) -> None:
    """A sample without GPUs (NVML failing) drops the GPU hardware checks instead of
    keeping the last verdict for ever."""
    config = agent_config("nats://127.0.0.1:1", "t", tmp_path, fake_gpus=0)
    inventory = InventoryActor(config, None, None, NvmlGpus(nvml=RecordedNvml(1)))  # type: ignore[arg-type]
    health = HealthActor(config, None, None)  # type: ignore[arg-type]
    health.observe_sample(inventory.sample())
    assert set(CHECK_NAMES) <= set(health.sample_checks)
    health.observe_sample(inventory.sample(read=[]))
    assert not set(CHECK_NAMES) & set(health.sample_checks)


def test_stand_in_answers_memory_v1_and_v2_as_recorded() -> None:
    """The stand-in gives nvmlDeviceGetMemoryInfo's v1 answer (reserved counted as used)
    and, asked for version 2, the v2 answer (used 0, reserved apart), as the H100 did."""
    nvml = RecordedNvml(1)
    v1 = nvml.nvmlDeviceGetMemoryInfo(0)
    v2 = nvml.nvmlDeviceGetMemoryInfo(0, pynvml.nvmlMemory_v2)
    assert (v1.used, v1.total) == (503_316_480, 85_520_809_984)
    assert (v2.used, v2.reserved, v2.total) == (0, 503_316_480, 85_520_809_984)
