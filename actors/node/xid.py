"""The one NVIDIA XID table, how GPU sources count XIDs, and the tracker for the ``xid`` check.

Meanings and actions follow NVIDIA's XID catalog (docs.nvidia.com/deploy/xid-errors).
Every code has a count/window threshold: an XID is a finding only when it was seen at
least ``count`` times within ``window_s`` seconds on one GPU. Application-level codes
(13, 31, 43, 45) are caused by the workload, so one of them is not a node problem; only a
burst is. Hardware codes are findings at the first occurrence. Operators override the
thresholds per code with ``xid_thresholds = ["13=5/600"]`` (CODE=COUNT/WINDOW_S).
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterable
from typing import Literal

import msgspec

from actors.node.config import XID_THRESHOLD_PATTERN
from actors.node.gpu_health import memory_summary, nvlink_summary
from schemas.base import MAX_TEXT, MAX_XIDS
from schemas.events import Gpu, HealthCheck, XidCount

Finding = Literal["degraded", "unhealthy"]

HOUR = 3600.0
_SPEC = re.compile(XID_THRESHOLD_PATTERN)


class XidRule(msgspec.Struct, frozen=True, kw_only=True):
    """What one XID code means, how bad it is, what to do, and when it counts."""

    meaning: str
    status: Finding
    """The check status once the threshold is reached."""
    action: str
    count: int = 1
    window_s: float = HOUR
    reading: Literal["", "memory", "nvlink"] = ""
    """The GPU reading the XID check quotes beside this code (row remap, NVLink)."""


_APP_ACTION = "usually the workload's fault: check the application; repeated bursts on one GPU"
_APP_ACTION += " across workloads point at the GPU (reset it)"

XID_TABLE: dict[int, XidRule] = {
    13: XidRule(
        meaning="graphics engine exception (application)",
        status="degraded",
        action=_APP_ACTION,
        count=10,
        window_s=300.0,
    ),
    31: XidRule(
        meaning="GPU memory page fault (application)",
        status="degraded",
        action=_APP_ACTION,
        count=10,
        window_s=300.0,
    ),
    43: XidRule(
        meaning="GPU stopped processing (application)",
        status="degraded",
        action=_APP_ACTION,
        count=10,
        window_s=300.0,
    ),
    45: XidRule(
        meaning="preemptive cleanup after earlier errors (application)",
        status="degraded",
        action=_APP_ACTION,
        count=10,
        window_s=300.0,
    ),
    48: XidRule(
        meaning="double-bit ECC error",
        status="unhealthy",
        action="drain, then reset the GPU; RMA if it recurs",
        reading="memory",
    ),
    61: XidRule(
        meaning="internal micro-controller breakpoint/warning",
        status="degraded",
        action="reset the GPU when drained; contact NVIDIA support if it persists",
    ),
    62: XidRule(
        meaning="internal micro-controller halt",
        status="unhealthy",
        action="drain, then reset the GPU; contact NVIDIA support if it persists",
    ),
    63: XidRule(
        meaning="ECC page retirement / row remapping recorded",
        status="degraded",
        action="drain and reset the GPU so the pending remap takes effect",
        reading="memory",
    ),
    64: XidRule(
        meaning="ECC page retirement / row remapping failed",
        status="unhealthy",
        action="drain, reset the GPU; RMA if remapping fails again",
        reading="memory",
    ),
    74: XidRule(
        meaning="NVLink error",
        status="unhealthy",
        action="drain, reset the GPU and check NVLink/NVSwitch; RMA if it persists",
        reading="nvlink",
    ),
    79: XidRule(
        meaning="GPU has fallen off the bus",
        status="unhealthy",
        action="drain the node and reboot; RMA if it recurs",
    ),
    92: XidRule(
        meaning="high single-bit ECC error rate",
        status="degraded",
        action="watch the ECC counters; reset the GPU when drained, RMA if the rate stays high",
    ),
    94: XidRule(
        meaning="contained ECC error (only the affected application was stopped)",
        status="degraded",
        action="drain and reset the GPU when convenient",
        reading="memory",
    ),
    95: XidRule(
        meaning="uncontained ECC error (every application on the GPU is affected)",
        status="unhealthy",
        action="drain, then reset the GPU",
        reading="memory",
    ),
    119: XidRule(
        meaning="GSP RPC timeout",
        status="unhealthy",
        action="drain, reset the GPU or reboot; update driver/firmware if it recurs",
    ),
    120: XidRule(
        meaning="GSP error",
        status="unhealthy",
        action="drain, reset the GPU or reboot; update driver/firmware if it recurs",
    ),
}

UNKNOWN_RULE = XidRule(
    meaning="XID not in the agent's table",
    status="degraded",
    action="look the code up in NVIDIA's XID catalog",
)

_RANK = {"ok": 0, "degraded": 1, "unhealthy": 2}
# Occurrences kept per GPU and code: bounds memory under an XID storm. A threshold above
# this can never be reached, which no sensible threshold is.
MAX_REMEMBERED = 1024


def count_xid(codes: dict[int, XidCount], code: int, at: float) -> None:
    """One more ``code`` in a GPU's cumulative XID counts (what a GPU source reports)."""
    previous = codes.get(code)
    count = previous.count + 1 if previous else 1
    codes[code] = XidCount(code=code, count=count, last_at=at)


DEDUP_WINDOW = 60.0
"""Seconds within which NVML's event and the kernel log's line for the same GPU and code
are taken to be one XID."""


class XidDedup:
    """One XID seen by both NVML's events and the kernel log counts once.

    Each sighting not matched yet waits ``window`` seconds for the other source's; a
    sighting that finds one waiting from the other source is that same XID and is not
    counted again. A GPU only one source sees (kmsg unreadable in a container, NVML events
    unavailable) has every sighting counted.
    """

    def __init__(self, window: float = DEDUP_WINDOW) -> None:
        self.window = window
        self._waiting: dict[tuple[str, int, int], deque[float]] = {}

    def is_new(self, source: str, gpu: int, code: int, now: float) -> bool:
        """True when this sighting is an XID not counted yet (count it)."""
        for key in [key for key, times in self._waiting.items() if times[-1] < now - self.window]:
            del self._waiting[key]
        other = [key for key in self._waiting if key[1:] == (gpu, code) and key[0] != source]
        for key in other:
            times = self._waiting[key]
            while times and times[0] < now - self.window:
                times.popleft()
            if times:
                times.popleft()
                if not times:
                    del self._waiting[key]
                return False
        self._waiting.setdefault((source, gpu, code), deque(maxlen=MAX_REMEMBERED)).append(now)
        return True


def in_code_order(codes: dict[int, XidCount]) -> list[XidCount]:
    """A GPU's XID counts as a sample carries them, by code: the MAX_XIDS codes seen most
    recently, so a GPU throwing every code there is still fits the wire bound."""
    recent = sorted(codes.values(), key=lambda xid: xid.last_at)[-MAX_XIDS:]
    return sorted(recent, key=lambda xid: xid.code)


def parse_thresholds(specs: Iterable[str]) -> dict[int, tuple[int, float]]:
    """``["13=5/600"]`` -> ``{13: (5, 600.0)}``; a malformed spec raises ValueError."""
    thresholds: dict[int, tuple[int, float]] = {}
    for spec in specs:
        if not _SPEC.fullmatch(spec):
            raise ValueError(f"xid threshold {spec!r} is not CODE=COUNT/WINDOW_S")
        code, rest = spec.split("=")
        count, window = rest.split("/")
        thresholds[int(code)] = (max(1, int(count)), float(window))
    return thresholds


def rule_for(code: int, thresholds: dict[int, tuple[int, float]] | None = None) -> XidRule:
    """The table's rule for ``code``, with the operator's count/window override if any."""
    rule = XID_TABLE.get(code, UNKNOWN_RULE)
    if thresholds and code in thresholds:
        count, window = thresholds[code]
        rule = msgspec.structs.replace(rule, count=count, window_s=window)
    return rule


class XidTracker:
    """Turns the cumulative per-GPU XID counts of successive samples into timed occurrences.

    A count that grows by N adds N occurrences at the XID's ``last_at``; a count that drops
    (the source was cleared) forgets that GPU's history for the code.
    """

    def __init__(self, thresholds: dict[int, tuple[int, float]] | None = None) -> None:
        self.thresholds = thresholds or {}
        self._counts: dict[tuple[int, int], int] = {}
        self._seen: dict[tuple[int, int], deque[float]] = {}
        self._gpus: dict[int, Gpu] = {}

    def observe(self, gpus: list[Gpu]) -> None:
        self._gpus = {gpu.index: gpu for gpu in gpus}
        present: set[tuple[int, int]] = set()
        for gpu in gpus:
            for xid in gpu.xids:
                key = (gpu.index, xid.code)
                present.add(key)
                previous = self._counts.get(key, 0)
                if xid.count < previous:
                    self._seen.pop(key, None)
                    previous = 0
                times = self._seen.setdefault(key, deque(maxlen=MAX_REMEMBERED))
                times.extend([xid.last_at] * min(xid.count - previous, MAX_REMEMBERED))
                self._counts[key] = xid.count
        for key in set(self._counts) - present:
            del self._counts[key]
            self._seen.pop(key, None)

    def _reading(self, rule: XidRule, index: int) -> str:
        """ " (row remap: ...)" or " (NVLink: ...)" for codes tied to a reading."""
        gpu = self._gpus.get(index)
        if gpu is None or gpu.health is None or not rule.reading or gpu.lost:
            return ""
        health = gpu.health
        summary = memory_summary(health) if rule.reading == "memory" else nvlink_summary(health)
        return f" ({summary})"

    def check(self, now: float) -> HealthCheck:
        """The ``xid`` check at wall-clock time ``now``: the worst code over its threshold."""
        findings: list[tuple[int, str, str]] = []
        below: list[str] = []
        for (gpu, code), times in sorted(self._seen.items()):
            rule = rule_for(code, self.thresholds)
            while times and times[0] < now - rule.window_s:
                times.popleft()
            if not times:
                continue
            text = f"XID {code} x{len(times)} on GPU {gpu} in {rule.window_s:g}s: {rule.meaning}"
            text += self._reading(rule, gpu)
            if len(times) >= rule.count:
                findings.append((_RANK[rule.status], text, rule.action))
            else:
                below.append(f"{text} (below threshold {rule.count})")
        if not findings:
            reason = "; ".join(below) if below else "no XID errors in their windows"
            return HealthCheck(name="xid", status="ok", reason=reason[:MAX_TEXT])
        findings.sort(key=lambda finding: -finding[0])
        worst = findings[0]
        status: Finding = "unhealthy" if worst[0] == _RANK["unhealthy"] else "degraded"
        reason = "; ".join(text for _, text, _ in findings)
        return HealthCheck(name="xid", status=status, reason=reason[:MAX_TEXT], action=worst[2])
