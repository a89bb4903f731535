"""NVIDIA's XID codes as data: what each means, how bad it is, what to do, and how many
occurrences within what window make it a finding.

The one table, read by the agent's ``xid`` check (actors/node/gpu/xid.py, which counts and
judges) and by the fleet's views (the dashboard's node page shows each XID's severity and
meaning). Meanings and actions follow NVIDIA's XID catalog
(docs.nvidia.com/deploy/xid-errors). Application-level codes (13, 31, 43, 45) are caused
by the workload, so one of them is not a node problem; only a burst is. Hardware codes are
findings at the first occurrence. A node's operator may change a code's count and window
(``xid_thresholds``), never its severity.
"""

from __future__ import annotations

from typing import Literal

import msgspec

Finding = Literal["degraded", "unhealthy"]

HOUR = 3600.0


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


def rule_of(code: int) -> XidRule:
    """The catalog's rule for ``code`` (UNKNOWN_RULE for a code not in it)."""
    return XID_TABLE.get(code, UNKNOWN_RULE)
