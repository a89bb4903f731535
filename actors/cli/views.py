"""Human-readable renderings of the fleet for fleetctl (tables, one-record detail)."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Sequence
from typing import Any

import msgspec

from actors.fleet.history import Entry
from actors.fleet.live import LiveRecord
from schemas.events import Engine, Health, HostFacts, Latency, Sample, Scheduler, SpotStatus
from schemas.messages import Alert, CommandResult, NodeRecord, WorkloadSummary

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


def age(seconds: float) -> str:
    """How long ago, in :func:`span`'s units: ``42s ago``, ``17m ago``, ``3d ago``."""
    if seconds < 0:
        return "now"
    return f"{span(seconds)} ago"


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
        record.state + (",maintenance" if _in_maintenance(record) else ""),
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


def _in_maintenance(record: NodeRecord) -> str:
    """The maintenance window covering the node ("" when none, or not known)."""
    return record.maintenance if isinstance(record, LiveRecord) else ""


def _not_live(record: NodeRecord) -> str:
    """``*`` after LAST SEEN where the record's checkpoint is shown, not a live read."""
    return "*" if isinstance(record, LiveRecord) and not record.live else ""


def not_live_note(records: list[NodeRecord]) -> str:
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
        code = COLOURS.get(line[2].split(",")[0]) if colour and number > 0 else None
        if code is not None:
            cells[2] = f"\x1b[{code}m{line[2]}\x1b[0m" + " " * (widths[2] - len(line[2]))
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def nodes(count: int) -> str:
    """``1 node``, ``3 nodes``."""
    return f"{count} node" if count == 1 else f"{count} nodes"


def summary(records: list[NodeRecord], of: int | None = None) -> str:
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


def nodes_output(
    records: list[NodeRecord], output: str, colour: bool = False, of: int | None = None
) -> str:
    """``fleetctl nodes`` output, newline-terminated: a table with its summary line (of
    ``of`` nodes before filtering), or the records as a JSON array or a YAML list."""
    if output == "json":
        return msgspec.json.encode(records).decode() + "\n"
    if output == "yaml":
        return yaml(msgspec.to_builtins(records))
    wide = output == "wide"
    return (
        table(records, wide=wide, colour=colour)
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


# --- describe, events and watch (one node's detail and the fleet's history) ---

RECENT = 10
"""How many alerts and command results ``fleetctl describe`` shows."""


def clock(ts: float) -> str:
    """A time as ``2026-11-21T11:52:03Z`` (UTC, so lines from several hosts compare)."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


def grid(rows: Sequence[tuple[str, ...]], indent: str = "  ") -> list[str]:
    """Rows (the first the header) as aligned columns, every cell made printable."""
    cells = [tuple(printable(cell) for cell in line) for line in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(cells[0]))]
    return [
        (indent + "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True))).rstrip()
        for line in cells
    ]


def _opt(value: float | int | None, unit: str = "", fmt: str = "{:g}") -> str:
    return "-" if value is None else fmt.format(value) + unit


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


def describe(
    record: NodeRecord,
    alerts: list[Entry],
    results: list[Entry],
    now: float,
    remediation: list[str] | None = None,
) -> str:
    """``fleetctl describe``: the record and why it is in its state, read top to bottom;
    ``remediation``: what the remediation policy holds of the node and did to it."""
    beat = record.heartbeat
    lines = [
        f"Node:            {record.node_id}",
        f"Cluster:         {record.cluster}",
        f"State:           {record.state}{_why(record)}",
        f"Last seen:       {age(now - record.last_seen) if record.last_seen else 'never'}"
        f" (seq {record.last_seq}, agent {record.agent_version or '-'})",
    ]
    if isinstance(record, LiveRecord) and beat is not None:
        lines.append(f"Heartbeat:       {_liveness(record, now)}")
    lines.append(f"Schedulability:  {_schedulability(record, results)}")
    if _in_maintenance(record):
        lines.append(
            f"Maintenance:     window {_in_maintenance(record)}: alerts recorded, not forwarded "
            "(fleetctl maintenance list)"
        )
    lines += remediation or []
    lines.append(f"Labels:          {labels_text(record.labels)}")
    lines += _lifecycle(record)
    if beat is None:
        lines.append("No heartbeat accepted yet.")
        lines += _recent(alerts, results)
        return "\n".join(printable(line) for line in lines)
    if beat.sample is not None and beat.sample.hostname:
        lines.insert(2, f"Hostname:        {beat.sample.hostname}")
    if record.state in UNKNOWN_NOW:
        lines.append(f"Reported:        what follows is from its last heartbeat, {clock(beat.ts)}")
    lines += _health(beat.health, record.state)
    lines += _gpus(beat.sample)
    lines += _host(beat.sample.host if beat.sample is not None else None)
    lines += _engines(beat.engine)
    lines += _workloads(beat.workloads)
    lines += _latency(beat.latency)
    lines.append(f"Spot:            {_spot(beat.spot)}")
    if beat.scheduler is not None:
        lines += _slurm(beat.scheduler)
    lines += _recent(alerts, results)
    # printable() is idempotent, so escaping the already escaped tables again is harmless.
    return "\n".join(printable(line) for line in lines)


def _workloads(workloads: list[WorkloadSummary]) -> list[str]:
    """The node's workloads as its heartbeat lists them (``fleetctl workloads`` has the
    fleet's, placed replicas included)."""
    if not workloads:
        return ["Workloads:       none"]
    rows = [("NAME", "STATE", "ENGINE", "MODEL", "GPUS", "PORT", "RESTARTS", "")]
    rows += [
        (
            w.name,
            w.state + (f" ({w.reason})" if w.reason else ""),
            w.engine,
            w.model or "-",
            ",".join(map(str, w.gpus)) or "-",
            str(w.port),
            str(w.restarts),
            "placed" if w.placed else "",
        )
        for w in workloads
    ]
    return ["Workloads:", *grid(rows)]


def _liveness(record: LiveRecord, now: float) -> str:
    """Whether describe shows the node's latest accepted heartbeat, read just now."""
    if record.live:
        return "the latest accepted, read live from FLEET_HB"
    return (
        f"NOT LIVE ({record.live_note}): the record's checkpoint is shown, "
        f"{age(now - record.last_seen) if record.last_seen else 'never'}"
    )


def labels_text(labels: dict[str, str]) -> str:
    """Labels as ``key=value`` words, sorted; ``none`` when there are none."""
    return " ".join(f"{key}={value}" for key, value in sorted(labels.items())) or "none"


def _lifecycle(record: NodeRecord) -> list[str]:
    """Who deregistered the node and why, and whether its heartbeats are being refused."""
    lines = []
    if record.deregistered:
        when = clock(record.deregistered_at) if record.deregistered_at else "?"
        lines.append(
            f"Deregistered:    by {record.deregistered_by or 'node'} at {when}"
            + (f": {record.deregistered_reason}" if record.deregistered_reason else "")
        )
    if record.refused:
        lines.append(f"Refused:         its heartbeats are refused ({record.refused})")
    return lines


def _why(record: NodeRecord) -> str:
    """What the record itself says about a state that no heartbeat explains."""
    if record.offline_since:
        return f" (offline since {clock(record.offline_since)})"
    if record.stale_since:
        last = clock(record.last_seen) if record.last_seen else "never"
        return f" (no heartbeat since {last}; stale since {clock(record.stale_since)})"
    if record.stopped_since:
        return f" (stopped on request at {clock(record.stopped_since)})"
    if record.pending_since:
        return f" (awaiting approval since {clock(record.pending_since)})"
    return ""


NODE_ACTIONS = ("spot:", "shutdown")
"""Command ids a node gives what it does by itself (a spot notice, its own shutdown)."""


def _schedulability(record: NodeRecord, results: list[Entry]) -> str:
    """The schedulability, its reason, who made it so (the heartbeat's
    ``schedulability_by``) and what set it. Completed results report the schedulability
    the node had when they ended; the one credited is the first of the latest run of such
    results that all report this schedulability (later ones, a stop on a cordoned node
    say, found it so). A schedulability the node changed by itself without a result (the
    last completed result reports another) is credited to nobody, and what the node did
    on its own (spot notices, its shutdown) to the node. Unknown (``-``) while no
    heartbeat says what it is now, with what it last said."""
    beat = record.heartbeat
    text = record.schedulability
    if beat is not None and beat.schedulability_reason:
        text += f" (reason: {beat.schedulability_reason})"
    if beat is not None and beat.schedulability_by:
        text += f", by {beat.schedulability_by}"
    text += _credited(record, results)
    if record.state in UNKNOWN_NOW:
        return f"- (unknown while {record.state}; last reported {text})"
    return text


def _credited(record: NodeRecord, results: list[Entry]) -> str:
    """``, set by ...`` from the completed results (see :func:`_schedulability`)."""
    done = [
        entry.message
        for entry in results
        if isinstance(entry.message, CommandResult)
        and entry.message.status == "done"
        and entry.message.schedulability is not None
    ]
    if not done or done[-1].schedulability != record.schedulability:
        return ""
    setter = done[-1]
    for result in reversed(done[:-1]):
        if result.schedulability != setter.schedulability:
            break
        setter = result
    return f", set by {_setter(setter.command_id)} at {clock(setter.ts)}"


def _setter(command_id: str) -> str:
    if command_id.startswith(NODE_ACTIONS):
        return f"the node itself ({command_id})"
    return f"command {command_id}"


def _health(health: Health | None, state: str) -> list[str]:
    if health is None:
        return ["Health:          not reported"]
    lines = [f"Health:          {health.status}, score {health.score}/100"]
    if state in UNKNOWN_NOW:
        lines = [
            f"Health:          - (unknown while {state}; last reported {health.status}, "
            f"score {health.score}/100)"
        ]
    if health.checks:
        lines.append("Checks:")
        lines += grid(
            [("CHECK", "STATUS", "REASON", "ACTION")]
            + [(c.name, c.status, c.reason, c.action or "-") for c in health.checks]
        )
    if health.components:
        lines.append("Components:")
        lines += grid(
            [("COMPONENT", "POINTS", "REASON")]
            + [(c.name, f"{c.points}/{c.max_points}", c.reason) for c in health.components]
        )
    return lines


def _gpus(sample: Sample | None) -> list[str]:
    if sample is not None and sample.gpu_error and not sample.gpus:
        return [f"GPUs:            none ({sample.gpu_source} fails: {sample.gpu_error})"]
    if sample is None or not sample.gpus:
        return ["GPUs:            none"]
    rows: list[tuple[str, ...]] = [
        ("GPU", "NAME", "MEMORY", "TEMP", "POWER", "UTIL", "ECC (CORR/UNCORR)", "XIDS", "LOST")
    ]
    for gpu in sample.gpus:
        xids = ",".join(f"{x.code}x{x.count}" for x in gpu.xids) or "-"
        rows.append(
            (
                str(gpu.index),
                gpu.name,
                f"{gpu.memory_used / 2**30:.1f}/{gpu.memory_total / 2**30:.1f} GiB"
                + (
                    f" +{gpu.health.memory_reserved / 2**30:.1f} rsvd"
                    if gpu.health is not None and gpu.health.memory_reserved
                    else ""
                ),
                _opt(gpu.temperature_c, "C", "{:.0f}"),
                _opt(gpu.power_w, "W", "{:.0f}"),
                _opt(gpu.utilization_pct, "%", "{:.0f}"),
                f"{_opt(gpu.ecc_corrected)}/{_opt(gpu.ecc_uncorrected)}",
                xids,
                "LOST" if gpu.lost else "-",
            )
        )
    return [f"GPUs:            {len(sample.gpus)} ({sample.gpu_source})", *grid(rows)]


def _host(host: HostFacts | None) -> list[str]:
    """Host facts in one line, dependency versions in another (older agents send none)."""
    if host is None:
        return []
    gpu = _opt(host.gpu_utilization_pct, "%", "{:.0f}")
    lines = [
        f"Host:            up {span(host.uptime_s)}, memory {host.memory_used_pct:.0f}% used, "
        f"GPU util {gpu} (mean), {host.storage_path or '-'} {host.storage_used_pct:.0f}% used, "
        f"CPU {host.cpu_model or '-'}"
    ]
    if host.dependencies:
        versions = "; ".join(dep.version for dep in host.dependencies)
        lines.append(f"Versions:        {versions}")
    return lines


def _engines(engine: Engine | None) -> list[str]:
    if engine is None or not engine.engines:
        return ["Engines:         none"]
    rows: list[tuple[str, ...]] = [("ENGINE", "URL", "HEALTHY", "IN-FLIGHT", "WAITING", "REASON")]
    rows += [
        (
            e.kind,
            e.url,
            "yes" if e.healthy else "no",
            _opt(e.in_flight),
            _opt(e.waiting),
            e.reason or "-",
        )
        for e in engine.engines
    ]
    return ["Engines:", *grid(rows)]


def _slurm(scheduler: Scheduler) -> list[str]:
    """The node as ``scontrol show node`` and ``squeue`` see it, and its HPC services."""
    if not scheduler.reachable:
        return [f"Slurm:           {scheduler.node_name}: not answering ({scheduler.reason})"]
    reason = f" (reason: {scheduler.state_reason})" if scheduler.state_reason else ""
    jobs, services = scheduler.jobs, scheduler.services
    history = f"{_opt(jobs.completed_24h)} completed, {_opt(jobs.failed_24h)} failed in 24 h" + (
        f" ({jobs.history_reason})" if jobs.history_reason else ""
    )
    runtime = services.container_runtime or "no container runtime"
    if services.container_runtime_version:
        runtime += f" {services.container_runtime_version}"
    return [
        f"Slurm:           {scheduler.node_name} {scheduler.slurm_state}{reason}",
        f"  jobs:          {_opt(jobs.running_count)} running, {_opt(jobs.pending_count)} "
        f"pending; {history}",
        f"  services:      slurmd {'running' if services.slurmd_running else 'NOT running'}"
        f" {services.slurmd_version}, munged "
        f"{'running' if services.munge_running else 'NOT running'}, {runtime}",
    ]


def _latency(latency: Latency | None) -> list[str]:
    if latency is None:
        return ["Latency:         not reported"]
    lines = [
        f"Latency:         nats {_ms(latency.gateway_rtt_us)}, "
        f"peers avg {_ms(latency.avg_peer_rtt_us)}, loss {latency.loss_pct:g}%"
    ]
    if latency.peers:
        lines += grid(
            [("PEER", "RTT", "LOSS")]
            + [(p.target_node_id, _ms(p.rtt_us), f"{p.loss_pct:g}%") for p in latency.peers]
        )
    return lines


def _ms(microseconds: float | None) -> str:
    """A round trip in milliseconds, as ``node-agent status`` writes it."""
    return "-" if microseconds is None else f"{microseconds / 1000:.2f}ms"


def _spot(spot: SpotStatus | None) -> str:
    if spot is None or spot.provider == "none":
        return "not watched"
    notice = spot.notice
    if notice is None:
        return f"{spot.provider}, no notice"
    deadline = f", deadline {clock(notice.deadline)}" if notice.deadline else ""
    return f"{spot.provider}: {notice.kind} notice{deadline} {notice.detail}".rstrip()


def _recent(alerts: list[Entry], results: list[Entry]) -> list[str]:
    lines = [f"Recent alerts ({len(alerts)}):"]
    lines += [f"  {event_line(entry)}" for entry in alerts] or ["  none"]
    lines.append(f"Recent command results ({len(results)}):")
    lines += [f"  {event_line(entry)}" for entry in results] or ["  none"]
    return lines


SUMMARY_ABOVE = 50
"""``fleetctl nodes`` prints a summary instead of a table above this many nodes (a
screenful), unless ``--all`` or ``--limit`` asks for rows."""


def fleet_summary(records: list[NodeRecord], hint: str | None = None) -> str:
    """Nodes counted by cluster and state: one row per cluster, one column per state
    present, a total row; newline-terminated, with the way to list rows (``hint``, else
    ``fleetctl nodes``' flags)."""
    states = sorted({record.state for record in records})
    counts: dict[str, dict[str, int]] = {}
    for record in records:
        row = counts.setdefault(record.cluster, {})
        row[record.state] = row.get(record.state, 0) + 1
    header = ["CLUSTER", *(state.upper() for state in states), "TOTAL"]
    rows = [
        [cluster, *(str(row.get(state, 0)) for state in states), str(sum(row.values()))]
        for cluster, row in sorted(counts.items())
    ]
    totals = [sum(row.get(state, 0) for row in counts.values()) for state in states]
    rows.append(["all", *(str(total) for total in totals), str(len(records))])
    widths = [max(len(line[i]) for line in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True))
        for line in [header, *rows]
    ]
    hint = f"{nodes(len(records))}, summarised; " + (
        hint or "list them with --all or --limit N, narrow with --state or --cluster"
    )
    return "\n".join(printable(line.rstrip()) for line in lines) + "\n" + hint + "\n"
