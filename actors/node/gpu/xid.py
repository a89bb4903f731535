"""How GPU sources count XIDs, and the tracker for the ``xid`` check.

What each code means and how bad it is lives in :mod:`schemas.xid_catalog`. Every code has
a count/window threshold: an XID is a finding only when it was seen at least ``count``
times within ``window_s`` seconds on one GPU. Operators override the thresholds per code
with ``xid_thresholds = ["13=5/600"]`` (CODE=COUNT/WINDOW_S).
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterable

import msgspec

from actors.node.gpu.thresholds import memory_summary, nvlink_summary
from schemas.base import MAX_GPUS, MAX_TEXT, MAX_XIDS
from schemas.events import Gpu, HealthCheck, XidCount
from schemas.xid_catalog import Finding, XidRule, rule_of

XID_THRESHOLD_PATTERN = r"^\d+=\d+/\d+(\.\d+)?$"
"""An override of ``xid_thresholds``: CODE=COUNT/WINDOW_S, e.g. 13=5/600."""
_SPEC = re.compile(XID_THRESHOLD_PATTERN)

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
    rule = rule_of(code)
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
        findings: list[tuple[int, str, str, int]] = []
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
                findings.append((_RANK[rule.status], text, rule.action, gpu))
            else:
                below.append(f"{text} (below threshold {rule.count})")
        if not findings:
            reason = "; ".join(below) if below else "no XID errors in their windows"
            return HealthCheck(name="xid", status="ok", reason=reason[:MAX_TEXT])
        findings.sort(key=lambda finding: -finding[0])
        worst = findings[0]
        status: Finding = "unhealthy" if worst[0] == _RANK["unhealthy"] else "degraded"
        reason = "; ".join(text for _, text, _, _ in findings)
        at_fault = sorted({gpu for _, _, _, gpu in findings})[:MAX_GPUS]
        return HealthCheck(
            name="xid", status=status, reason=reason[:MAX_TEXT], action=worst[2], gpus=at_fault
        )
