"""Human-readable renderings of the fleet for fleetctl: the node table and its summary, YAML,
alert and command-result lines; ``fleetctl describe``'s detail is in describe_view."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from actors.cli.render import columns
from actors.cli.render.columns import Column
from actors.fleet.live.reader import LiveRecord
from actors.fleet.views.history import Entry
from actors.runtime.spans import age, clock, span
from schemas import signing
from schemas.messages import Alert, CommandResult, NodeRecord

NODE_OUTPUTS = ("table", "wide", "json", "yaml")
PLAIN_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

COLUMNS = ("NODE", "CLUSTER", "STATE", "SCHED", "HEALTH", "GPUS", "LAST SEEN", "AGE", "VERSION")
WIDE_COLUMNS = (*COLUMNS, "SEQ", "REASON")
"""``-o wide`` adds the last accepted seq and why the node is in its state."""
REASON_WIDTH = 80
NOTES_SHOWN = 3
"""Nodes the footnote of not-live rows names (with why)."""
COLOURS = {"active": "32", "degraded": "33", "unhealthy": "31", "stale": "33", "offline": "31"}
"""ANSI colour of the STATE cell per state (green, yellow, red); others stay plain."""
UNKNOWN_NOW = frozenset({"stale", "offline", "stopped", "deregistered", "pending"})
"""States in which nothing the node reported holds now: its schedulability and health are
shown as unknown (``-``), not as what its last heartbeat said."""


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


def reason(record: NodeRecord, now: float) -> str:
    """Why the node is in its state, in a few words: what the aggregator saw (no heartbeat
    since), else what the node said (its schedulability reason, its failing health checks,
    a spot notice); ``-`` when nothing needs saying."""
    beat = record.heartbeat
    if record.deregistered and record.deregistered_by not in ("", "node"):
        by = record.deregistered_by[:8] + "..."
        return printable(f"forgotten by {by}: {record.deregistered_reason or 'no reason'}")
    if record.deregistered:
        return "deregistered itself"
    if record.state in ("offline", "stale"):
        silent = f"no heartbeat for {span(now - record.last_seen)}"
        return silent + (f" (refused: {printable(record.refused)})" if record.refused else "")
    if record.state == "stopped":
        return "agent stopped on request"
    if record.state == "pending":
        return (
            "registered, awaiting approval"
            if record.pending_since
            else "approved, no heartbeat yet"
        )
    parts = []
    if beat is not None and beat.schedulability_reason and record.schedulability != "schedulable":
        parts.append(beat.schedulability_reason)
    if beat is not None and beat.health is not None:
        parts += [f"{c.name}: {c.reason}" for c in beat.health.checks if c.status != "ok"]
    if beat is not None and beat.spot is not None and beat.spot.notice is not None:
        parts.append(f"spot {beat.spot.notice.kind} notice")
    text = printable("; ".join(parts)) or "-"
    return text if len(text) <= REASON_WIDTH else text[: REASON_WIDTH - 3] + "..."


def row(record: NodeRecord, now: float, wide: bool = False) -> tuple[str, ...]:
    known = record.state not in UNKNOWN_NOW
    health = "-"
    if record.health_status is not None and known:
        health = f"{record.health_status} {record.health_score}"
    cells = (
        record.node_id,
        record.cluster,
        record.state + (",maintenance" if in_maintenance(record) else ""),
        record.schedulability if known else "-",
        health,
        str(record.gpus_total),
        (age(now - record.last_seen) if record.last_seen else "never") + _not_live(record),
        span(now - record.created) if record.created is not None else "-",
        record.agent_version or "-",
    )
    if not wide:
        return cells
    return (*cells, str(record.last_seq), reason(record, now))


def in_maintenance(record: NodeRecord) -> str:
    """The maintenance window covering the node ("" when none, or not known)."""
    return record.maintenance if isinstance(record, LiveRecord) else ""


def _not_live(record: NodeRecord) -> str:
    """``*`` after LAST SEEN where the record's checkpoint is shown, not a live read."""
    return "*" if isinstance(record, LiveRecord) and not record.live else ""


def not_live_note(records: Sequence[NodeRecord]) -> str:
    """The footnote of the ``*`` marks (newline-terminated), or "" when there are none:
    how many, and why for the first few."""
    marked = [r for r in records if isinstance(r, LiveRecord) and not r.live]
    if not marked:
        return ""
    why = "; ".join(f"{r.node_id}: {r.live_note}" for r in marked[:NOTES_SHOWN])
    more = f"; and {len(marked) - NOTES_SHOWN} more" if len(marked) > NOTES_SHOWN else ""
    return (
        printable(
            f"* {len(marked)} node(s) show their last checkpoint, not a live heartbeat "
            f"({why}{more})"
        )
        + "\n"
    )


def table(
    records: Sequence[NodeRecord],
    now: float | None = None,
    wide: bool = False,
    colour: bool = False,
    extra: Sequence[Column] = (),
) -> str:
    """Aligned columns, ``extra`` ones (label columns) after the others; with ``colour``,
    the STATE cell in ANSI colour (padding outside the escape codes, so the columns stay
    aligned)."""
    now = time.time() if now is None else now
    header = (*(WIDE_COLUMNS if wide else COLUMNS), *(name for name, _ in extra))
    rows = [
        header,
        *(
            tuple(map(printable, (*row(r, now, wide), *(show(r) for _, show in extra))))
            for r in records
        ),
    ]
    widths = [max(len(line[i]) for line in rows) for i in range(len(header))]
    lines = []
    for number, line in enumerate(rows):
        cells = [cell.ljust(width) for cell, width in zip(line, widths, strict=True)]
        code = COLOURS.get(line[2].split(",")[0]) if colour and number > 0 else None
        if code is not None:
            cells[2] = f"\x1b[{code}m{line[2]}\x1b[0m" + " " * (widths[2] - len(line[2]))
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def nodes(count: int) -> str:
    """``1 node``, ``3 nodes``."""
    return f"{count} node" if count == 1 else f"{count} nodes"


def summary(records: Sequence[NodeRecord], of: int | None = None) -> str:
    """``3 nodes: 2 active, 1 stale``; ``3 of 299 nodes: ...`` when ``of`` (the nodes
    before a filter) is more than shown."""
    counts: dict[str, int] = {}
    for record in records:
        counts[record.state] = counts.get(record.state, 0) + 1
    parts = [f"{count} {state}" for state, count in sorted(counts.items())]
    total = (
        nodes(len(records))
        if of is None or of == len(records)
        else f"{len(records)} of {nodes(of)}"
    )
    return total + (f": {', '.join(parts)}" if parts else "")


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


def watch_table(
    records: list[NodeRecord],
    shown: dict[str, tuple[object, ...]] | None,
    now: float,
    wide: bool = False,
    colour: bool = False,
    extra: Sequence[Column] = (),
) -> str:
    """``fleetctl nodes --watch`` as kubectl's ``get -w``: a TIME column before the table's;
    with ``shown`` None (the first read) every row under the header, else only the rows
    whose :func:`change_key` differs from ``shown`` (new nodes included) and a ``(gone)``
    row for each node shown before and missing now; "" when nothing changed. Rows are
    aligned as the whole table is now."""
    lines = table(records, now, wide, colour, extra).split("\n")
    stamp = clock(now)
    if shown is None:
        rows = [f"{'TIME':<{len(stamp)}}  {lines[0]}"]
        rows += [f"{stamp}  {line}" for line in lines[1:]]
        return "".join(row + "\n" for row in rows)
    rows = [
        f"{stamp}  {line}"
        for record, line in zip(records, lines[1:], strict=True)
        if shown.get(record.node_id) != change_key(record)
    ]
    now_known = {record.node_id for record in records}
    rows += [f"{stamp}  {printable(node)}  (gone)" for node in shown if node not in now_known]
    return "".join(row + "\n" for row in rows)


PENDING_COLUMNS = (
    "NODE",
    "CLUSTER",
    "REGISTERED",
    "KEY",
    "HOST",
    "GPUS",
    "PROVIDER",
    "INSTANCE TYPE",
    "REGION",
)


def pending_row(record: NodeRecord, now: float) -> tuple[str, ...]:
    """One pending registration: its key's fingerprint (and how many other keys registered
    the name) and what it said of its machine (the first key's identity), all claims."""
    identity = record.registered_identity
    key = signing.fingerprint(record.public_key) if record.public_key else "-"
    if record.candidates:
        key += f" (+{len(record.candidates)} other keys)"
    gpus = "-"
    if identity is not None:
        gpus = (
            f"{identity.gpu_count} x {identity.gpu_product or '?'}" if identity.gpu_count else "0"
        )
        if identity.gpu_passthrough:
            gpus += f" ({identity.gpu_passthrough} passthrough)"
    registered = span(now - record.pending_since) + " ago" if record.pending_since else "approved"
    return (
        record.node_id,
        record.cluster,
        registered,
        key,
        (identity.hostname if identity is not None else "") or "-",
        gpus,
        (identity.provider if identity is not None else "") or "-",
        (identity.instance_type if identity is not None else "") or "-",
        (identity.region if identity is not None else "") or "-",
    )


def pending_table(records: list[NodeRecord], now: float | None = None) -> str:
    """``fleetctl nodes --state pending``: each registration's key and the machine it
    says it is (newline-terminated, with a line on what to compare before approving)."""
    now = time.time() if now is None else now
    rows = [PENDING_COLUMNS, *(pending_row(record, now) for record in records)]
    return (
        "\n".join(grid(rows, indent=""))
        + "\n"
        + summary(records)
        + "; what each says of its machine is its claim: compare it (and the key, "
        "'node-agent key show' there) before 'fleetctl approve NODE'\n"
    )


def nodes_output(
    records: list[NodeRecord],
    output: str,
    colour: bool = False,
    of: int | None = None,
    extra: Sequence[Column] = (),
) -> str:
    """``fleetctl nodes`` output, newline-terminated: a table with its summary line (of
    ``of`` nodes before filtering) and ``extra`` columns, the records as a JSON array or a
    YAML list, or ``custom-columns=NAME:.path,...``."""
    if output == "json":
        return msgspec.json.encode(records).decode() + "\n"
    if output == "yaml":
        return yaml(msgspec.to_builtins(records))
    if output.startswith(columns.CUSTOM_PREFIX):
        grid_lines = columns.grid_text(records, columns.custom_columns(output)).splitlines()
        return "".join(printable(line) + "\n" for line in grid_lines)
    wide = output == "wide"
    return (
        table(records, wide=wide, colour=colour, extra=extra)
        + "\n"
        + summary(records, of)
        + "\n"
        + not_live_note(records)
    )


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


# --- events and watch (the fleet's history) ---


def grid(rows: Sequence[tuple[str, ...]], indent: str = "  ") -> list[str]:
    """Rows (the first the header) as aligned columns, every cell made printable."""
    cells = [tuple(printable(cell) for cell in line) for line in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(cells[0]))]
    return [
        (indent + "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True))).rstrip()
        for line in cells
    ]


def event_fields(entry: Entry) -> tuple[str, str, str, str]:
    """(severity, node, kind, message) of a stored alert or command result."""
    message = entry.message
    node = entry.subject.rsplit(".", 1)[-1]
    if isinstance(message, Alert):
        return message.severity, message.node_id, message.kind, message.message
    if isinstance(message, CommandResult):
        severity = "warning" if message.status in ("rejected", "failed") else "info"
        text = f"command {message.command_id or '?'} {message.status}"
        if message.detail:
            text += f": {message.detail}"
        return severity, message.node_id, "result", text
    return "?", node, "unreadable", entry.body.decode(errors="replace")


def event_line(entry: Entry) -> str:
    """One line per alert or command result: time, severity, node, kind, message."""
    severity, node, kind, message = event_fields(entry)
    return printable(f"{clock(entry.ts)} {severity:<8} {node} {kind}: {message}")


def event_json(entry: Entry) -> str:
    """One JSON object per line for machines; ASCII only, so nothing can drive a terminal."""
    body: object = (
        msgspec.to_builtins(entry.message)
        if entry.message is not None
        else entry.body.decode(errors="replace")
    )
    return json.dumps(
        {"stored": clock(entry.ts), "subject": entry.subject, "message": body}, ensure_ascii=True
    )


SUMMARY_ABOVE = 50
"""``fleetctl nodes`` prints a summary instead of a table above this many nodes (a
screenful), unless ``--all`` or ``--limit`` asks for rows."""


def fleet_summary(records: Sequence[NodeRecord], hint: str | None = None) -> str:
    """Nodes counted by cluster and state: one row per cluster, one column per state
    present, a total row; newline-terminated, with the way to list rows (``hint``, else
    ``fleetctl nodes``' flags)."""
    counts: dict[str, dict[str, int]] = {}
    for record in records:
        row = counts.setdefault(record.cluster, {})
        row[record.state] = row.get(record.state, 0) + 1
    return count_summary(counts, hint)


def count_summary(counts: Mapping[str, Mapping[str, int]], hint: str | None = None) -> str:
    """:func:`fleet_summary` of nodes already counted by cluster and state (the state
    index's counts)."""
    states = sorted({state for row in counts.values() for state, number in row.items() if number})
    header = ["CLUSTER", *(state.upper() for state in states), "TOTAL"]
    rows = [
        [cluster, *(str(row.get(state, 0)) for state in states), str(sum(row.values()))]
        for cluster, row in sorted(counts.items())
    ]
    totals = [sum(row.get(state, 0) for row in counts.values()) for state in states]
    total = sum(totals)
    rows.append(["all", *(str(number) for number in totals), str(total)])
    widths = [max(len(line[i]) for line in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True))
        for line in [header, *rows]
    ]
    hint = f"{nodes(total)}, summarised; " + (
        hint or "list them with --all or --limit N, narrow with --state or --cluster"
    )
    return "\n".join(printable(line.rstrip()) for line in lines) + "\n" + hint + "\n"
