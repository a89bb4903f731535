"""Human-readable renderings of the fleet for fleetctl (tables, one-record detail)."""

from __future__ import annotations

import time

from schemas.messages import NodeRecord

COLUMNS = ("NODE", "CLUSTER", "STATE", "SCHED", "HEALTH", "GPUS", "SEQ", "LAST SEEN")


def printable(text: str) -> str:
    """``text`` with every non-printable character (ESC, other control characters, line
    breaks, bidi overrides) written as a Python escape such as ``\\x1b``: a message is
    written by whoever could publish it, and must not be able to drive the terminal."""
    if text.isprintable():
        return text
    return "".join(char if char.isprintable() else _escape(char) for char in text)


def _escape(char: str) -> str:
    code = ord(char)
    if code < 0x100:
        return f"\\x{code:02x}"
    if code < 0x10000:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def age(seconds: float) -> str:
    if seconds < 0:
        return "now"
    if seconds < 90:
        return f"{seconds:.0f}s ago"
    if seconds < 5400:
        return f"{seconds / 60:.0f}m ago"
    return f"{seconds / 3600:.1f}h ago"


def row(record: NodeRecord, now: float) -> tuple[str, ...]:
    health = "-"
    if record.health_status is not None:
        health = f"{record.health_status} {record.health_score}"
    return (
        record.node_id,
        record.cluster,
        record.state,
        record.schedulability,
        health,
        str(record.gpus_total),
        str(record.last_seq),
        age(now - record.last_seen) if record.last_seen else "never",
    )


def table(records: list[NodeRecord], now: float | None = None) -> str:
    now = time.time() if now is None else now
    rows = [COLUMNS, *(row(record, now) for record in records)]
    widths = [max(len(line[i]) for line in rows) for i in range(len(COLUMNS))]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True))
        for line in rows
    ]
    return "\n".join(line.rstrip() for line in lines)


def summary(records: list[NodeRecord]) -> str:
    counts: dict[str, int] = {}
    for record in records:
        counts[record.state] = counts.get(record.state, 0) + 1
    parts = [f"{count} {state}" for state, count in sorted(counts.items())]
    return f"{len(records)} nodes" + (f": {', '.join(parts)}" if parts else "")
