"""The health actor's hard checks as plain functions, plus the hysteresis latch.

Checks answer "is something wrong that a score would hide?": the GPU count at boot, NVML
answers and temperature, required binaries and kernel modules, and whether the event
feeds the score depends on are fresh. The latch keeps a bad result until ``clear_after`` better
results in a row, so a condition neither flaps nor sticks forever.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from pathlib import Path

import msgspec

from schemas.base import MAX_GPUS, MAX_TEXT, CheckStatus, HealthStatus
from schemas.events import HealthCheck, Sample, Scheduler
from schemas.health_limits import HOT_GPU_C

STALE_FACTOR = 3.0
"""A feed's event is stale once older than this many of its periods."""

NVML_ACTION = (
    "check the NVIDIA driver: nvidia-smi, dmesg (NVRM); reload it (modprobe nvidia) or "
    "reboot; drain the node until nvidia-smi answers"
)

RANK: dict[str, int] = {"ok": 0, "unknown": 0, "healthy": 0, "degraded": 1, "unhealthy": 2}
_BY_RANK: tuple[HealthStatus, ...] = ("healthy", "degraded", "unhealthy")


def boot_check(sample: Sample, expected: int | None) -> HealthCheck:
    """Expected GPU count against the GPUs that answer."""
    seen = sum(1 for gpu in sample.gpus if not gpu.lost)
    if expected is None:
        reason = f"{seen} GPUs answer; no expected count configured"
        return HealthCheck(name="boot", status="ok", reason=reason)
    if seen == expected:
        return HealthCheck(name="boot", status="ok", reason=f"{seen}/{expected} GPUs answer")
    if seen < expected:
        error = f" ({sample.gpu_error})" if sample.gpu_error else ""
        return HealthCheck(
            name="boot",
            status="unhealthy",
            reason=f"expected {expected} GPUs, {seen} answer{error}"[:MAX_TEXT],
            action="check the GPUs' seating, power and driver (nvidia-smi, dmesg); reboot",
        )
    return HealthCheck(
        name="boot",
        status="degraded",
        reason=f"expected {expected} GPUs, {seen} answer",
        action="update expected_gpus for this node",
    )


def nvml_check(
    sample: Sample, expected: int | None = None, hot_c: float | None = HOT_GPU_C
) -> HealthCheck:
    """NVML failing or seeing fewer devices than ``expected``, a lost GPU or one answering
    no query: unhealthy; a GPU above ``hot_c`` (85 C unless set; None: never): degraded."""
    if sample.gpu_error:
        return HealthCheck(
            name="nvml",
            status="unhealthy",
            reason=f"NVML fails: {sample.gpu_error}"[:MAX_TEXT],
            action=NVML_ACTION,
        )
    if sample.gpu_source == "nvml" and expected is not None and len(sample.gpus) < expected:
        return HealthCheck(
            name="nvml",
            status="unhealthy",
            reason=f"NVML sees {len(sample.gpus)} devices, expected {expected}",
            action=NVML_ACTION,
        )
    lost = [gpu.index for gpu in sample.gpus if gpu.lost]
    if lost:
        return HealthCheck(
            name="nvml",
            status="unhealthy",
            reason=f"GPU {', '.join(map(str, lost))} lost (stopped answering)",
            action="drain the node and reboot; RMA if it recurs",
            gpus=lost[:MAX_GPUS],
        )
    hot_gpus = [
        gpu
        for gpu in sample.gpus
        if gpu.temperature_c is not None and hot_c is not None and gpu.temperature_c > hot_c
    ]
    hot = [f"GPU {gpu.index} at {gpu.temperature_c:g} C" for gpu in hot_gpus]
    silent = [
        gpu.index
        for gpu in sample.gpus
        if gpu.temperature_c is None and gpu.utilization_pct is None and gpu.power_w is None
    ]
    if silent:
        # A device that answers no query at all does no work either.
        return HealthCheck(
            name="nvml",
            status="unhealthy",
            reason=f"GPU {', '.join(map(str, silent))} answer no NVML query",
            action=NVML_ACTION,
            gpus=silent[:MAX_GPUS],
        )
    if hot:
        return HealthCheck(
            name="nvml",
            status="degraded",
            reason="; ".join(f"{text} (> {hot_c:g} C)" for text in hot),
            action="check cooling and airflow",
            gpus=[gpu.index for gpu in hot_gpus][:MAX_GPUS],
        )
    if not sample.gpus:
        return HealthCheck(name="nvml", status="ok", reason="no GPUs to query")
    reason = f"{len(sample.gpus)} GPUs answer {sample.gpu_source} queries"
    return HealthCheck(name="nvml", status="ok", reason=reason)


def loaded_modules(proc_modules: Path, sys_module: Path) -> set[str]:
    """Kernel modules from /proc/modules, plus built-ins that only /sys/module lists."""
    names: set[str] = set()
    try:
        names.update(line.split(" ", 1)[0] for line in proc_modules.read_text().splitlines())
    except OSError:
        pass
    try:
        names.update(entry.name for entry in sys_module.iterdir())
    except OSError:
        pass
    return names


def dependencies_check(
    binaries: Iterable[str],
    modules: Iterable[str],
    *,
    search_path: str | None = None,
    proc_modules: Path = Path("/proc/modules"),
    sys_module: Path = Path("/sys/module"),
) -> HealthCheck:
    """Every required binary on PATH (``search_path`` overrides) and module loaded."""
    binaries, modules = list(binaries), list(modules)
    if not binaries and not modules:
        return HealthCheck(name="dependencies", status="ok", reason="no dependencies required")
    missing = [
        f"binary {name}" for name in binaries if shutil.which(name, path=search_path) is None
    ]
    if modules:
        loaded = loaded_modules(proc_modules, sys_module)
        missing += [f"module {name}" for name in modules if name not in loaded]
    if missing:
        return HealthCheck(
            name="dependencies",
            status="unhealthy",
            reason="missing " + ", ".join(missing),
            action="install the missing binaries / load the modules (modprobe)",
        )
    reason = f"{len(binaries)} binaries and {len(modules)} modules present"
    return HealthCheck(name="dependencies", status="ok", reason=reason)


def scheduler_check(scheduler: Scheduler) -> HealthCheck:
    """Slurm unreachable, its node down or failing, or slurmd/munged not running: degraded
    with the reason (jobs cannot be placed here). A drain is not a health matter."""
    if not scheduler.reachable:
        return HealthCheck(
            name="scheduler",
            status="degraded",
            reason=f"Slurm not answering for {scheduler.node_name}: {scheduler.reason}",
            action="check slurmctld, slurmd and munged (systemctl status; scontrol ping)",
        )
    problems = []
    flags = set(scheduler.slurm_state.replace("*", "+not_responding").split("+"))
    bad = sorted(flags & {"down", "fail", "failing", "not_responding", "inval"})
    if bad:
        reason = f"Slurm has {scheduler.node_name} {scheduler.slurm_state}"
        problems.append(reason + (f" ({scheduler.state_reason})" if scheduler.state_reason else ""))
    if not scheduler.services.slurmd_running:
        problems.append("slurmd not running")
    if not scheduler.services.munge_running:
        problems.append("munged not running")
    if problems:
        return HealthCheck(
            name="scheduler",
            status="degraded",
            reason="; ".join(problems),
            action="check slurmd and munged (systemctl status; scontrol show node)",
        )
    reason = f"Slurm node {scheduler.node_name} {scheduler.slurm_state}"
    return HealthCheck(name="scheduler", status="ok", reason=reason)


class Feed(msgspec.Struct, frozen=True, kw_only=True):
    """One event stream the score depends on, and when it was last received (the
    ``probe_freshness`` check judges these)."""

    name: str
    period: float
    received_at: float | None
    """Monotonic time of the latest event; None when none came yet."""

    def fresh(self, now: float) -> bool:
        return self.received_at is not None and now - self.received_at <= STALE_FACTOR * self.period

    def describe(self, now: float, started: float) -> tuple[CheckStatus, str]:
        """(status, reason): stale or never received past its grace period is degraded."""
        limit = STALE_FACTOR * self.period
        if self.received_at is None:
            waited = now - started
            if waited <= limit:
                return "ok", f"{self.name}: awaiting first event ({waited:.0f}s of {limit:g}s)"
            return "degraded", f"{self.name}: none received in {waited:.0f}s"
        age = now - self.received_at
        if age <= limit:
            return "ok", f"{self.name} {age:.1f}s old"
        return "degraded", f"{self.name} stale: {age:.0f}s old (limit {limit:g}s)"


def freshness_check(feeds: Iterable[Feed], now: float, started: float) -> HealthCheck:
    results = [feed.describe(now, started) for feed in feeds]
    stale = [reason for status, reason in results if status != "ok"]
    if stale:
        return HealthCheck(
            name="probe_freshness",
            status="degraded",
            reason="; ".join(stale),
            action="check that the agent's actors are running (node-agent status)",
        )
    return HealthCheck(
        name="probe_freshness", status="ok", reason="; ".join(reason for _, reason in results)
    )


def missing_reason(feed: Feed, now: float, started: float) -> str:
    """Why a component scores 0 for lack of fresh input, in words."""
    return f"no fresh data ({feed.describe(now, started)[1]})"


def overall(checks: Iterable[HealthCheck]) -> HealthStatus:
    """The worst status among the checks (the score enters as a check of its own)."""
    worst = max([0, *(RANK[check.status] for check in checks)])
    return _BY_RANK[worst]


class Latch:
    """Hysteresis per check name: worse results take effect at once, better ones only
    after ``clear_after`` of them in a row."""

    def __init__(self, clear_after: int) -> None:
        self.clear_after = clear_after
        self._held: dict[str, HealthCheck] = {}
        self._better: dict[str, int] = {}

    def update(self, check: HealthCheck) -> HealthCheck:
        held = self._held.get(check.name)
        if held is None or RANK[check.status] >= RANK[held.status]:
            self._held[check.name] = check
            self._better[check.name] = 0
            return check
        better = self._better[check.name] + 1
        if better >= self.clear_after:
            self._held[check.name] = check
            self._better[check.name] = 0
            return check
        self._better[check.name] = better
        return msgspec.structs.replace(
            held,
            reason=f"{held.reason} (clearing: {better}/{self.clear_after} good in a row)",
        )
