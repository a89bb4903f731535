"""Health score components, checks, hysteresis, freshness, and the actor over a real bus."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import msgspec
import pytest

from actors.node.health import checks, scoring
from actors.node.health.actor import HealthActor
from actors.runtime.bus import NatsBus
from actors.runtime.embedded import NatsServer
from schemas import codec
from schemas.events import (
    Capacity,
    Engine,
    EngineStatus,
    Gpu,
    Health,
    HealthCheck,
    Latency,
    Sample,
)
from schemas.subjects import EVENT_HEALTH, EVENT_SAMPLE, Subjects
from tests.support.fleet import Fleet, agent_config, node_events, wait_for

GIB = 1024**3


def make_gpu(index: int = 0, **readings: object) -> Gpu:
    values: dict[str, object] = dict(
        index=index,
        uuid=f"GPU-{index}",
        name="test",
        pci_bus_id=f"00000000:{index:02X}:00.0",
        memory_total=100 * GIB,
        memory_used=10 * GIB,
        temperature_c=40.0,
        power_w=100.0,
        utilization_pct=10.0,
    )
    values.update(readings)
    return Gpu(**values)  # type: ignore[arg-type]


def make_sample(gpus: list[Gpu] | None = None, cpu: float = 5.0) -> Sample:
    capacity = Capacity(
        cpu_cores=4,
        cpu_percent=cpu,
        load_avg_1m=0.1,
        memory_total=GIB,
        memory_available=GIB,
        gpus_total=0,
        gpus_available=0,
        storage_total=GIB,
        storage_available=GIB,
    )
    return Sample(
        ts=time.time(),
        capacity=capacity,
        gpus=[make_gpu()] if gpus is None else gpus,
        gpu_source="fake",
    )


@pytest.mark.parametrize(
    ("celsius", "points"),
    [(69.9, 20), (70.0, 15), (79.9, 15), (80.0, 10), (90.0, 10), (90.1, 0)],
)
def test_temperature_bands(celsius: float, points: int) -> None:
    """The hottest GPU's temperature scores 20/15/10/0 at the documented band edges."""
    sample = make_sample([make_gpu(0), make_gpu(2, temperature_c=celsius)])
    component = scoring.temperature_component(sample, "")
    assert component.points == points
    assert component.max_points == 20
    assert component.reason == f"hottest GPU {celsius:g} C (GPU 2)"


@pytest.mark.parametrize(("used_pct", "points"), [(79, 15), (80, 10), (90, 10), (91, 5), (100, 5)])
def test_vram_bands(used_pct: int, points: int) -> None:
    """The fullest GPU's VRAM use scores 15/10/5 at the documented band edges."""
    sample = make_sample([make_gpu(1, memory_used=used_pct * GIB)])
    component = scoring.vram_component(sample, "")
    assert (component.points, component.max_points) == (points, 15)
    assert "(GPU 1)" in component.reason


@pytest.mark.parametrize(("cpu", "points"), [(69.9, 10), (70.0, 5), (90.0, 5), (90.1, 0)])
def test_cpu_bands(cpu: float, points: int) -> None:
    """CPU use over the sample period scores 10/5/0 at the documented band edges."""
    component = scoring.cpu_component(make_sample(cpu=cpu), "")
    assert (component.points, component.max_points) == (points, 10)


@pytest.mark.parametrize(
    ("rtt_us", "points"), [(9_999, 5), (10_000, 3), (50_000, 3), (50_001, 0), (None, 0)]
)
def test_latency_bands(rtt_us: int | None, points: int) -> None:
    """The NATS round trip scores 5/3/0; no measurement scores 0 and says so."""
    component = scoring.latency_component(Latency(ts=1.0, gateway_rtt_us=rtt_us), "")
    assert (component.points, component.max_points) == (points, 5)
    if rtt_us is None:
        assert "no round trip" in component.reason


def test_engine_component() -> None:
    """No engine configured: 50; all healthy: 50; half healthy: 25 naming the sick one."""
    none = scoring.engine_component(None, 0, "")
    assert none.points == 50 and none.reason == "no engine configured; none expected"
    good = EngineStatus(kind="vllm", url="http://a", healthy=True)
    bad = EngineStatus(kind="sglang", url="http://b", healthy=False, reason="HTTP 503")
    assert scoring.engine_component(Engine(ts=1.0, engines=[good]), 1, "").points == 50
    half = scoring.engine_component(Engine(ts=1.0, engines=[good, bad]), 2, "")
    assert half.points == 25
    assert "sglang http://b: HTTP 503" in half.reason
    missing = scoring.engine_component(None, 1, "no fresh data")
    assert (missing.points, missing.reason) == (0, "no fresh data")


def test_missing_sample_scores_zero_with_reason() -> None:
    """Without a fresh sample, GPU and CPU components score 0 and carry the reason."""
    for component in (
        scoring.temperature_component(None, "stale"),
        scoring.vram_component(None, "stale"),
        scoring.cpu_component(None, "stale"),
    ):
        assert (component.points, component.reason) == (0, "stale")


def test_no_gpus_scores_full() -> None:
    """A node without GPUs is not penalised for GPU temperature or VRAM."""
    sample = make_sample([])
    assert scoring.temperature_component(sample, "").points == 20
    assert scoring.vram_component(sample, "").points == 15


def test_unreadable_gpus_say_nvmls_error_in_the_components() -> None:
    """NVML failing (no GPUs, its error in the sample): the GPU components score 0 and
    say "GPUs unreadable: <error>", not "no GPUs on node" at full points."""
    sample = msgspec.structs.replace(make_sample([]), gpu_error="NVML_ERROR_DRIVER_NOT_LOADED")
    for component in (
        scoring.temperature_component(sample, ""),
        scoring.vram_component(sample, ""),
    ):
        assert component.points == 0
        assert component.reason == "GPUs unreadable: NVML_ERROR_DRIVER_NOT_LOADED"


@pytest.mark.parametrize(
    ("score", "status"), [(49, "unhealthy"), (50, "degraded"), (79, "degraded"), (80, "ok")]
)
def test_score_thresholds(score: int, status: str) -> None:
    """Score below 50 is unhealthy, below 80 degraded, else ok."""
    assert scoring.score_check(score).status == status


def test_boot_check() -> None:
    """Fewer GPUs answering than expected is unhealthy; the expected count is ok."""
    sample = make_sample([make_gpu(0), make_gpu(1, lost=True)])
    assert checks.boot_check(sample, 2).status == "unhealthy"
    assert checks.boot_check(sample, 1).status == "ok"
    assert checks.boot_check(sample, None).status == "ok"


def test_nvml_check() -> None:
    """A GPU above 85 C is degraded; a lost GPU or one answering no query unhealthy."""
    assert checks.nvml_check(make_sample([make_gpu(0, temperature_c=85.0)])).status == "ok"
    hot = checks.nvml_check(make_sample([make_gpu(0, temperature_c=85.5)]))
    assert hot.status == "degraded" and "GPU 0 at 85.5 C" in hot.reason
    lost = checks.nvml_check(make_sample([make_gpu(0), make_gpu(1, lost=True)]))
    assert lost.status == "unhealthy" and "GPU 1 lost" in lost.reason
    silent = make_gpu(0, temperature_c=None, utilization_pct=None, power_w=None)
    assert checks.nvml_check(make_sample([silent])).status == "unhealthy"


def test_dependencies_check(tmp_path: Path) -> None:
    """Missing binaries and kernel modules are unhealthy; present ones are ok."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tool = bin_dir / "nvidia-smi"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    proc_modules = tmp_path / "modules"
    proc_modules.write_text("nvidia 1 0 - Live 0x0\nnvidia_uvm 1 0 - Live 0x0\n")
    sys_module = tmp_path / "sys"
    (sys_module / "nvidia_peermem").mkdir(parents=True)
    roots = dict(search_path=str(bin_dir), proc_modules=proc_modules, sys_module=sys_module)
    ok = checks.dependencies_check(["nvidia-smi"], ["nvidia", "nvidia_peermem"], **roots)  # type: ignore[arg-type]
    assert ok.status == "ok"
    bad = checks.dependencies_check(["dcgmi"], ["nvidia", "ib_core"], **roots)  # type: ignore[arg-type]
    assert bad.status == "unhealthy"
    assert bad.reason == "missing binary dcgmi, module ib_core"
    assert checks.dependencies_check([], []).reason == "no dependencies required"


def test_freshness() -> None:
    """Fresh feeds are ok; stale ones, or none past 3 periods since start, are degraded."""
    fresh = checks.Feed(name="sample", period=1.0, received_at=100.0)
    assert checks.freshness_check([fresh], now=102.9, started=0.0).status == "ok"
    stale = checks.freshness_check([fresh], now=103.1, started=0.0)
    assert stale.status == "degraded" and "sample stale" in stale.reason
    never = checks.Feed(name="latency", period=10.0, received_at=None)
    assert checks.freshness_check([never], now=29.0, started=0.0).status == "ok"
    late = checks.freshness_check([never], now=31.0, started=0.0)
    assert late.status == "degraded" and "latency: none received" in late.reason


def test_latch_needs_n_good_results_to_clear() -> None:
    """A bad check holds through N-1 good results, clears on the Nth, and worsens at once."""
    latch = checks.Latch(clear_after=3)
    bad = HealthCheck(name="nvml", status="unhealthy", reason="GPU 0 lost")
    good = HealthCheck(name="nvml", status="ok", reason="fine")
    assert latch.update(bad).status == "unhealthy"
    first = latch.update(good)
    assert first.status == "unhealthy" and "clearing: 1/3" in first.reason
    assert latch.update(good).status == "unhealthy"
    assert latch.update(good) == good
    assert latch.update(bad) == bad
    assert latch.update(good).status == "unhealthy"  # the count restarted


def test_overall_status() -> None:
    """Overall status is the worst check; ok checks give healthy."""
    ok = HealthCheck(name="a", status="ok", reason="")
    degraded = HealthCheck(name="b", status="degraded", reason="")
    unhealthy = HealthCheck(name="c", status="unhealthy", reason="")
    assert checks.overall([ok]) == "healthy"
    assert checks.overall([ok, degraded]) == "degraded"
    assert checks.overall([degraded, unhealthy, ok]) == "unhealthy"


async def test_actor_publishes_explained_health(fleet: Fleet, bus: NatsBus, prefix: str) -> None:
    """The actor scores the node's own samples and publishes Health with every component."""
    config = fleet.config(health_interval=0.2)
    subjects = Subjects(prefix)
    received: asyncio.Queue[Health] = asyncio.Queue()

    async def on_health(msg: object) -> None:
        received.put_nowait(codec.decode(msg.data, Health))  # type: ignore[attr-defined]

    await bus.subscribe(subjects.event("n1", EVENT_HEALTH), on_health)
    await fleet.start_supervisor(HealthActor(config, bus, node_events(config)), ready_timeout=5)
    hot = make_sample([make_gpu(0), make_gpu(1, temperature_c=95.0)])
    await fleet.publish_event(EVENT_SAMPLE, hot)

    async def hot_health() -> Health | None:
        health = await asyncio.wait_for(received.get(), 5)
        return health if health.components[1].points == 0 else None

    health: Health = await wait_for(hot_health)
    names = [component.name for component in health.components]
    assert names == ["engine", "gpu_temperature", "vram", "cpu", "nats_latency"]
    assert health.components[1].reason == "hottest GPU 95 C (GPU 1)"
    by_name = {check.name: check for check in health.checks}
    assert by_name["nvml"].status == "degraded"
    assert set(by_name) == {"boot", "nvml", "xid", "dependencies", "probe_freshness"}
    assert health.score == 50 + 0 + 15 + 10 + 0
    assert health.status == "degraded"


async def test_actor_condition_clears_after_n_good_samples(
    nats_server: NatsServer, bus: NatsBus, prefix: str, state_dir: Path
) -> None:
    """A lost GPU stays unhealthy through clear_after-1 good samples and clears on the Nth."""
    config = agent_config(nats_server.url, prefix, state_dir, clear_after_samples=3)
    actor = HealthActor(config, bus, node_events(config))
    actor.observe_sample(make_sample([make_gpu(0, lost=True)]))
    assert actor.sample_checks["nvml"].status == "unhealthy"
    seen = []
    for _ in range(3):
        actor.observe_sample(make_sample([make_gpu(0)]))
        seen.append(actor.sample_checks["nvml"].status)
    assert seen == ["unhealthy", "unhealthy", "ok"]


async def test_actor_never_scores_stale_samples(
    nats_server: NatsServer, bus: NatsBus, prefix: str, state_dir: Path
) -> None:
    """A sample older than 3 sample periods scores 0 and makes probe_freshness degraded."""
    config = agent_config(nats_server.url, prefix, state_dir, sample_interval=1.0)
    actor = HealthActor(config, bus, node_events(config))
    actor.observe_sample(make_sample())
    actor.received["sample"] = time.monotonic() - 10.0
    health = actor.assess()
    cpu = next(c for c in health.components if c.name == "cpu")
    assert cpu.points == 0 and "sample stale" in cpu.reason
    freshness = next(c for c in health.checks if c.name == "probe_freshness")
    assert freshness.status == "degraded"
    assert health.status == "degraded"
