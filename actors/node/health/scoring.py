"""The health score, 0-100, as pure functions: every component says its points and why.

Weights: inference engine 50, hottest GPU temperature 20, fullest GPU's VRAM 15, CPU 10,
round trip to the NATS server 5. Bands (lower bound included, upper excluded unless said):

- temperature: < 70 C: 20; 70 to < 80: 15; 80 to 90 (inclusive): 10; > 90: 0
- VRAM use:    < 80 %: 15; 80 to 90 (inclusive): 10; > 90: 5
- CPU:         < 70 %: 10; 70 to 90 (inclusive): 5; > 90: 0
- NATS RTT:    < 10 ms: 5; 10 to 50 ms (inclusive): 3; > 50 ms: 0; no measurement: 0

A component whose input is missing or stale gets 0 points and says so: stale data is
never scored as if it were current. Status from the score: < 50 unhealthy, < 80 degraded.
A hard check worse than the score caps it (see :func:`capped`), so score and status always
agree: an alert on the score never stays quiet on an unhealthy node.
"""

from __future__ import annotations

from schemas.base import MAX_TEXT, CheckStatus, HealthStatus
from schemas.events import Engine, Gpu, HealthCheck, HealthComponent, Latency, Sample
from schemas.health_limits import DEGRADED_BELOW, UNHEALTHY_BELOW

ENGINE_POINTS = 50
TEMPERATURE_POINTS = 20
VRAM_POINTS = 15
CPU_POINTS = 10
LATENCY_POINTS = 5


def engine_component(engine: Engine | None, expected: int, missing: str) -> HealthComponent:
    """All configured engines healthy: 50; some: proportional; none configured: 50."""
    name, top = "engine", ENGINE_POINTS
    if expected == 0:
        return HealthComponent(
            name=name, points=top, max_points=top, reason="no engine configured; none expected"
        )
    if engine is None:
        return HealthComponent(name=name, points=0, max_points=top, reason=missing)
    healthy = [status for status in engine.engines if status.healthy]
    sick = [
        f"{status.kind} {status.url}: {status.reason or 'unhealthy'}"
        for status in engine.engines
        if not status.healthy
    ]
    points = top * min(len(healthy), expected) // expected
    reason = f"{len(healthy)}/{expected} configured engines healthy"
    if sick:
        reason += "; " + "; ".join(sick)
    return HealthComponent(name=name, points=points, max_points=top, reason=reason)


def _no_gpus(name: str, top: int, sample: Sample) -> HealthComponent:
    """A GPU component of a sample without GPUs: none to judge (full points), unless the
    GPU source failed: then nothing is known, and the reason says NVML's error."""
    if sample.gpu_error:
        reason = f"GPUs unreadable: {sample.gpu_error}"[:MAX_TEXT]
        return HealthComponent(name=name, points=0, max_points=top, reason=reason)
    return HealthComponent(name=name, points=top, max_points=top, reason="no GPUs on node")


def _answering(sample: Sample) -> list[Gpu]:
    return [gpu for gpu in sample.gpus if not gpu.lost]


def temperature_component(sample: Sample | None, missing: str) -> HealthComponent:
    name, top = "gpu_temperature", TEMPERATURE_POINTS
    if sample is None:
        return HealthComponent(name=name, points=0, max_points=top, reason=missing)
    if not sample.gpus:
        return _no_gpus(name, top, sample)
    readings = [gpu for gpu in _answering(sample) if gpu.temperature_c is not None]
    if not readings:
        reason = "no GPU reports a temperature"
        return HealthComponent(name=name, points=0, max_points=top, reason=reason)
    hottest = max(readings, key=lambda gpu: gpu.temperature_c or 0.0)
    celsius = hottest.temperature_c or 0.0
    if celsius < 70:
        points = top
    elif celsius < 80:
        points = 15
    elif celsius <= 90:
        points = 10
    else:
        points = 0
    reason = f"hottest GPU {celsius:g} C (GPU {hottest.index})"
    return HealthComponent(name=name, points=points, max_points=top, reason=reason)


def vram_component(sample: Sample | None, missing: str) -> HealthComponent:
    name, top = "vram", VRAM_POINTS
    if sample is None:
        return HealthComponent(name=name, points=0, max_points=top, reason=missing)
    if not sample.gpus:
        return _no_gpus(name, top, sample)
    sized = [gpu for gpu in _answering(sample) if gpu.memory_total > 0]
    if not sized:
        reason = "no GPU reports its memory"
        return HealthComponent(name=name, points=0, max_points=top, reason=reason)
    fullest = max(sized, key=lambda gpu: gpu.memory_used / gpu.memory_total)
    percent = 100.0 * fullest.memory_used / fullest.memory_total
    if percent < 80:
        points = top
    elif percent <= 90:
        points = 10
    else:
        points = 5
    reason = f"fullest GPU {percent:.1f}% VRAM used (GPU {fullest.index})"
    return HealthComponent(name=name, points=points, max_points=top, reason=reason)


def cpu_component(sample: Sample | None, missing: str) -> HealthComponent:
    name, top = "cpu", CPU_POINTS
    if sample is None:
        return HealthComponent(name=name, points=0, max_points=top, reason=missing)
    percent = sample.capacity.cpu_percent
    if percent < 70:
        points = top
    elif percent <= 90:
        points = 5
    else:
        points = 0
    reason = f"CPU {percent:.1f}% busy over the last sample period"
    return HealthComponent(name=name, points=points, max_points=top, reason=reason)


def latency_component(latency: Latency | None, missing: str) -> HealthComponent:
    name, top = "nats_latency", LATENCY_POINTS
    if latency is None:
        return HealthComponent(name=name, points=0, max_points=top, reason=missing)
    if latency.gateway_rtt_us is None:
        reason = "no round trip to the NATS server measured yet"
        return HealthComponent(name=name, points=0, max_points=top, reason=reason)
    millis = latency.gateway_rtt_us / 1000.0
    if millis < 10:
        points = top
    elif millis <= 50:
        points = 3
    else:
        points = 0
    reason = f"NATS server round trip {millis:.1f} ms"
    return HealthComponent(name=name, points=points, max_points=top, reason=reason)


def score_check(score: int) -> HealthCheck:
    """The score as a check (kept internal; it feeds the status through the latch)."""
    status: CheckStatus = "ok"
    if score < UNHEALTHY_BELOW:
        status = "unhealthy"
    elif score < DEGRADED_BELOW:
        status = "degraded"
    return HealthCheck(name="score", status=status, reason=f"score {score}")


def capped(score: int, status: HealthStatus) -> int:
    """``score`` lowered into ``status``'s band: at most 49 when unhealthy, 79 when
    degraded. A lost GPU or an XID 79 costs no points of its own (the components only
    weigh readings), but it must not leave the node at 100."""
    if status == "unhealthy":
        return min(score, UNHEALTHY_BELOW - 1)
    if status == "degraded":
        return min(score, DEGRADED_BELOW - 1)
    return score
