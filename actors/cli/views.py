"""Human-readable renderings of the fleet for fleetctl (tables, one-record detail)."""

from __future__ import annotations

import re
import time
from typing import Any

import msgspec

from schemas.messages import NodeRecord

NODE_OUTPUTS = ("table", "wide", "json", "yaml")
PLAIN_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

COLUMNS = ("NODE", "CLUSTER", "STATE", "SCHED", "HEALTH", "GPUS", "LAST SEEN", "AGE", "VERSION")
WIDE_COLUMNS = (*COLUMNS, "SEQ", "REASON")
"""``-o wide`` adds the last accepted seq and why the node is in its state."""
REASON_WIDTH = 80
COLOURS = {"active": "32", "degraded": "33", "unhealthy": "31", "stale": "33", "offline": "31"}
"""ANSI colour of the STATE cell per state (green, yellow, red); others stay plain."""


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


def span(seconds: float) -> str:
    """A duration as kubectl's AGE writes it: ``42s``, ``17m``, ``5h``, ``3d``."""
    seconds = max(0.0, seconds)
    for unit, size, up_to in (("s", 1, 120), ("m", 60, 120), ("h", 3600, 48)):
        if seconds < size * up_to:
            return f"{seconds // size:.0f}{unit}"
    return f"{seconds // 86400:.0f}d"


def reason(record: NodeRecord, now: float) -> str:
    """Why the node is in its state, in a few words: what the aggregator saw (no heartbeat
    since), else what the node said (its schedulability reason, its failing health checks,
    a spot notice); ``-`` when nothing needs saying."""
    beat = record.heartbeat
    if record.deregistered:
        return "deregistered itself"
    if record.state in ("offline", "stale"):
        return f"no heartbeat for {age(now - record.last_seen).removesuffix(' ago')}"
    if record.state == "pending":
        return "registered, awaiting approval"
    parts = []
    if beat is not None and beat.schedulability_reason:
        parts.append(beat.schedulability_reason)
    if beat is not None and beat.health is not None:
        parts += [f"{c.name}: {c.reason}" for c in beat.health.checks if c.status != "ok"]
    if beat is not None and beat.spot is not None and beat.spot.notice is not None:
        parts.append(f"spot {beat.spot.notice.kind} notice")
    text = printable("; ".join(parts)) or "-"
    return text if len(text) <= REASON_WIDTH else text[: REASON_WIDTH - 3] + "..."


def row(record: NodeRecord, now: float, wide: bool = False) -> tuple[str, ...]:
    health = "-"
    if record.health_status is not None:
        health = f"{record.health_status} {record.health_score}"
    cells = (
        record.node_id,
        record.cluster,
        record.state,
        record.schedulability,
        health,
        str(record.gpus_total),
        age(now - record.last_seen) if record.last_seen else "never",
        span(now - record.created) if record.created is not None else "-",
        record.agent_version or "-",
    )
    if not wide:
        return cells
    return (*cells, str(record.last_seq), reason(record, now))


def table(
    records: list[NodeRecord], now: float | None = None, wide: bool = False, colour: bool = False
) -> str:
    """Aligned columns; with ``colour``, the STATE cell in ANSI colour (padding outside
    the escape codes, so the columns stay aligned)."""
    now = time.time() if now is None else now
    header = WIDE_COLUMNS if wide else COLUMNS
    rows = [header, *(tuple(map(printable, row(r, now, wide))) for r in records)]
    widths = [max(len(line[i]) for line in rows) for i in range(len(header))]
    lines = []
    for number, line in enumerate(rows):
        cells = [cell.ljust(width) for cell, width in zip(line, widths, strict=True)]
        code = COLOURS.get(line[2]) if colour and number > 0 else None
        if code is not None:
            cells[2] = f"\x1b[{code}m{line[2]}\x1b[0m" + " " * (widths[2] - len(line[2]))
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def summary(records: list[NodeRecord]) -> str:
    counts: dict[str, int] = {}
    for record in records:
        counts[record.state] = counts.get(record.state, 0) + 1
    parts = [f"{count} {state}" for state, count in sorted(counts.items())]
    return f"{len(records)} nodes" + (f": {', '.join(parts)}" if parts else "")


def change_key(record: NodeRecord) -> tuple[object, ...]:
    """What ``fleetctl nodes --watch`` prints again on: not the last-seen time or seq,
    which every heartbeat moves."""
    return (
        record.node_id,
        record.cluster,
        record.state,
        record.schedulability,
        record.health_status,
        record.health_score,
        record.gpus_total,
        record.agent_version,
    )


def nodes_output(records: list[NodeRecord], output: str, colour: bool = False) -> str:
    """``fleetctl nodes`` output, newline-terminated: a table with its summary line, or
    the records as a JSON array or a YAML list."""
    if output == "json":
        return msgspec.json.encode(records).decode() + "\n"
    if output == "yaml":
        return yaml(msgspec.to_builtins(records))
    wide = output == "wide"
    return table(records, wide=wide, colour=colour) + "\n" + summary(records) + "\n"


def yaml(value: Any) -> str:
    """``value`` (JSON-like builtins) as block YAML, without a YAML library: every string
    is a JSON string, which is a valid YAML double-quoted scalar, and every line passes
    :func:`printable`, whose escapes YAML reads the same way inside those quotes."""
    return "".join(printable(line) + "\n" for line in _yaml_lines(value, ""))


def _yaml_lines(value: Any, pad: str) -> list[str]:
    if isinstance(value, dict) and value:
        lines = []
        for key, item in value.items():
            name = key if PLAIN_KEY.fullmatch(key) else _scalar(key)
            if _is_block(item):
                lines += [f"{pad}{name}:", *_yaml_lines(item, pad + "  ")]
            else:
                lines.append(f"{pad}{name}: {_scalar(item)}")
        return lines
    if isinstance(value, list) and value:
        lines = []
        for item in value:
            if _is_block(item):
                inner = _yaml_lines(item, pad + "  ")
                lines += [f"{pad}- {inner[0].removeprefix(pad + '  ')}", *inner[1:]]
            else:
                lines.append(f"{pad}- {_scalar(item)}")
        return lines
    return [f"{pad}{_scalar(value)}"]


def _is_block(value: Any) -> bool:
    return isinstance(value, dict | list) and bool(value)


def _scalar(value: Any) -> str:
    if isinstance(value, dict):
        return "{}"
    if isinstance(value, list):
        return "[]"
    return msgspec.json.encode(value).decode()  # null, true, numbers, "strings"
