"""What a node's record says is wrong with it, as the remediation policy's reason classes
name it: a heartbeat unhealthy for a class (:func:`classify`), or a node gone silent
without a goodbye (:func:`hung`). Pure; every detail, check name and GPU index is the
node's claim."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from actors.fleet.remediation.config import PolicyConfig
from schemas.messages import NodeRecord
from schemas.remediation import ReasonClass

GPU_CHECKS = frozenset(
    {"boot", "nvml", "gpu_memory", "gpu_clocks", "gpu_pcie", "gpu_nvlink", "gpu_fabric"}
)
CLASS_ORDER: tuple[ReasonClass, ...] = ("gpu", "xid", "engine", "dependency", "slurm")
"""The classes a heartbeat shows, most specific first (``hung`` is a node's silence)."""
REPORTING = frozenset({"active", "degraded", "unhealthy", "cordoned", "draining", "drained"})
"""Record states of a node whose heartbeats arrive (not pending, stale, offline or gone)."""
SILENT = frozenset({"stale", "offline"})
"""Record states of a node whose heartbeats stopped without a goodbye."""


@dataclass(frozen=True)
class Finding:
    """Why a node's last heartbeat is unhealthy for a reason class: the detail (without
    the class's own word: ``policy: xid: XID 79 ...``, never ``xid: xid:``), the check
    that said so and the GPUs it named (the node's claims)."""

    reason_class: ReasonClass
    detail: str
    check: str = ""
    gpus: tuple[int, ...] = ()


def classify(record: NodeRecord, classes: list[ReasonClass]) -> Finding | None:
    """The first configured reason class the node's last heartbeat is unhealthy for."""
    heartbeat = record.heartbeat
    if heartbeat is None:
        return None
    found: dict[ReasonClass, Finding] = {}
    health = heartbeat.health
    if health is not None:
        for check in health.checks:
            if check.status != "unhealthy":
                continue
            gpus = tuple(check.gpus)
            if check.name in GPU_CHECKS:
                detail = f"{check.name}: {check.reason}"
                found.setdefault("gpu", Finding("gpu", detail, check.name, gpus))
            elif check.name == "xid":
                found.setdefault("xid", Finding("xid", check.reason, check.name, gpus))
            elif check.name == "dependencies":
                found.setdefault("dependency", Finding("dependency", check.reason, check.name))
        engines = [part for part in health.components if part.name == "engine"]
        if engines and engines[0].points == 0:
            found.setdefault("engine", Finding("engine", engines[0].reason))
    scheduler = heartbeat.scheduler
    if scheduler is not None and "down" in scheduler.slurm_state:
        found.setdefault("slurm", Finding("slurm", f"node {scheduler.slurm_state}"))
    for name in CLASS_ORDER:
        if name in classes and name in found:
            finding = found[name]
            return dataclasses.replace(finding, detail=finding.detail[:512])
    return None


def hung(record: NodeRecord, config: PolicyConfig, now: float) -> Finding | None:
    """A ``hung`` finding for a node silent longer than ``hung_after`` that did not say
    goodbye and was schedulable when it last beat (an operator's, Slurm's or a spot
    cordon is theirs), where the policy acts on ``hung``."""
    if "hung" not in config.classes or record.state not in SILENT:
        return None
    beat = record.heartbeat
    if record.stopped_since is not None or beat is None or beat.schedulability != "schedulable":
        return None
    silent = now - record.last_seen
    if silent <= config.hung_after:
        return None
    return Finding("hung", f"no heartbeat for {silent:.0f}s (boot {record.boot_id or '?'})")
