"""Reading a run's history from the outside once it is over: the streams (every stored
alert and command result), the processes' JSON logs (what each node ran, each crash,
each alert or result a process could not publish, when each aggregator judged each
partition), and the machine's load meanwhile."""

from __future__ import annotations

import asyncio
import calendar
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import nats.errors
from nats.js.api import RawStreamMsg

from actors.runtime.bus import NatsBus
from schemas import codec
from schemas.messages import Alert, CommandResult
from schemas.subjects import STREAM_ALERTS, STREAM_EVENTS
from tests.faults.history import (
    Execution,
    History,
    Holding,
    Load,
    LogLine,
    Result,
    StoredAlert,
)

READ_TIMEOUT = 5.0
NOT_PUBLISHED = (
    "alert not published",
    "alert not acknowledged; raised again until it is",
    "alert lost: not acknowledged in time",
    "alert lost: too many unacknowledged",
    "command result not published",
)
RESUMED = "heartbeats resumed"
"""An aggregator's log line: it reads one partition's heartbeats from here on."""
HOLDING_ENDED = ("partitions lost", "partitions released", "partitions stopped")
"""An aggregator's log lines: it no longer judges the partitions they name."""


async def read_stream(bus: NatsBus, stream: str) -> list[RawStreamMsg]:
    """Every message ``stream`` holds, by direct reads of each sequence (a few thousand at
    most in a run), tried again while the cluster settles."""
    for attempt in range(10):
        try:
            info = await bus.js.stream_info(stream)
            first, last = info.state.first_seq, info.state.last_seq
            found: list[RawStreamMsg] = []
            for start in range(first, last + 1, 64):
                batch = await asyncio.gather(
                    *(_get(bus, stream, seq) for seq in range(start, min(start + 64, last + 1)))
                )
                found += [msg for msg in batch if msg is not None]
            return found
        except (nats.errors.Error, TimeoutError):
            await asyncio.sleep(1.0 + attempt)
    raise RuntimeError(f"{stream} could not be read")


async def _get(bus: NatsBus, stream: str, seq: int) -> RawStreamMsg | None:
    try:
        return await bus.js.get_msg(stream, seq)
    except nats.js.errors.NotFoundError:
        return None


async def stored_alerts(bus: NatsBus) -> list[StoredAlert]:
    alerts = []
    for msg in await read_stream(bus, STREAM_ALERTS):
        alert = codec.decode(msg.data or b"", Alert, msg.subject or "")
        msg_id = (msg.headers or {}).get("Nats-Msg-Id", "")
        alerts.append(StoredAlert(msg_id, alert.kind, alert.node_id, alert.ts))
    return alerts


async def stored_results(bus: NatsBus) -> list[Result]:
    results = []
    for msg in await read_stream(bus, STREAM_EVENTS):
        result = codec.decode(msg.data or b"", CommandResult, msg.subject or "")
        results.append(Result(result.command_id, result.node_id, result.status, result.ts))
    return results


def log_lines(path: Path) -> Iterator[dict[str, object]]:
    """The JSON lines of a process's log (anything else, a server's text, is skipped)."""
    if not path.exists():
        return
    with path.open(errors="replace") as file:
        for line in file:
            if line.startswith("{"):
                try:
                    entry = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(entry, dict):
                    yield entry


def when(entry: dict[str, object]) -> float:
    """A log line's time (``2026-01-02T03:04:05.678Z``) in Unix seconds."""
    text = str(entry.get("time", ""))
    try:
        whole, _, fraction = text.rstrip("Z").partition(".")
        seconds = calendar.timegm(time.strptime(whole, "%Y-%m-%dT%H:%M:%S"))
        return seconds + float(f"0.{fraction or 0}")
    except ValueError:
        return 0.0


def executions(node: str, log: Path) -> list[Execution]:
    return [
        Execution(str(entry.get("id", "")), node, when(entry))
        for entry in log_lines(log)
        if entry.get("msg") == "command accepted"
    ]


def notable(source: str, log: Path) -> tuple[list[LogLine], list[LogLine]]:
    """(actor crashes, alerts or results not published) in one process's log."""
    crashes, lost = [], []
    for entry in log_lines(log):
        msg = str(entry.get("msg", ""))
        error = str(entry.get("error", ""))
        reason = str(entry.get("reason", "")) or (error.strip().splitlines() or [""])[-1]
        ref = str(entry.get("alert", "") or entry.get("id", ""))
        line = LogLine(source, when(entry), msg, reason, "Traceback" in error, ref)
        if msg == "actor crashed; restarting" or msg.startswith("actor stopped by"):
            crashes.append(line)
        elif msg in NOT_PUBLISHED:
            lost.append(line)
    return crashes, lost


def holdings(source: str, log: Path) -> list[Holding]:
    """When the aggregator ``source`` judged each partition, from its log: from the
    partition's first ``heartbeats resumed`` to the first line of :data:`HOLDING_ENDED`
    naming it (a consumer opened again meanwhile does not end it)."""
    since: dict[int, float] = {}
    found: list[Holding] = []
    for entry in log_lines(log):
        msg = entry.get("msg")
        if msg == RESUMED:
            partition = entry.get("partition")
            if isinstance(partition, int):
                since.setdefault(partition, when(entry))
        elif msg in HOLDING_ENDED:
            named = entry.get("partitions")
            for partition in named if isinstance(named, list) else []:
                if partition in since:
                    found.append(Holding(source, partition, since.pop(partition), when(entry)))
    found += [Holding(source, partition, at) for partition, at in since.items()]
    return found


class LoadMeter:
    """Samples the machine once a second: CPU busy and steal from /proc/stat, the load
    average, and how late this process's own one-second timer fires."""

    def __init__(self) -> None:
        self.first = self._cpu()
        self.load_max = 0.0
        self.lags: list[float] = []

    @staticmethod
    def _cpu() -> list[int]:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
        return [int(value) for value in fields]

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            before = loop.time()
            await asyncio.sleep(1.0)
            self.lags.append(max(0.0, loop.time() - before - 1.0))
            self.load_max = max(self.load_max, os.getloadavg()[0])

    def figures(self) -> Load:
        last = self._cpu()
        delta = [b - a for a, b in zip(self.first, last, strict=True)]
        total = sum(delta) or 1
        idle = delta[3] + delta[4]  # idle, iowait
        steal = delta[7] if len(delta) > 7 else 0
        lags = sorted(self.lags) or [0.0]
        return Load(
            cores=os.cpu_count() or 0,
            busy_percent=round(100.0 * (total - idle) / total, 1),
            steal_percent=round(100.0 * steal / total, 1),
            load_max=round(self.load_max, 2),
            lag_p99=round(lags[int(0.99 * (len(lags) - 1))], 3),
            lag_max=round(lags[-1], 3),
        )


SERVER_NOTES = ("leader", "[ERR]", "[WRN]")


def timeline(history: History, logs: dict[str, Path]) -> list[str]:
    """One line per event, in time order, seconds from the run's start: each fault and
    heal, each stored lifecycle alert, and every warning or error the processes logged
    (the servers' leader changes, warnings and errors too): what a violation's cause is
    read from."""
    events: list[tuple[float, str, str]] = []
    for fault in history.faults:
        note = f" ({fault.note})" if fault.note else ""
        events.append((fault.started, "nemesis", f"FAULT {fault.kind} {fault.target}{note}"))
        converged = "never" if fault.converged is None else f"{fault.converged:.1f}s"
        events.append(
            (fault.healed, "nemesis", f"HEALED {fault.kind} {fault.target}, converged {converged}")
        )
    for alert in history.alerts:
        events.append((alert.ts, "alerts", f"ALERT {alert.kind} {alert.node} {alert.msg_id}"))
    for source, path in logs.items():
        for entry in log_lines(path):
            if entry.get("level") in ("warning", "error"):
                fields = {
                    k: v
                    for k, v in entry.items()
                    if k not in ("time", "level", "logger", "msg", "error", "node")
                }
                events.append((when(entry), source, f"{entry.get('msg')} {fields}"[:300]))
        if source.startswith("n") and path.exists():
            for line in path.read_text(errors="replace").splitlines():
                if any(note in line for note in SERVER_NOTES):
                    at = server_time(line)
                    if at:
                        events.append((at, source, line.split("] ", 2)[-1][:200]))
    return [
        f"{at - history.started:+8.2f} {source:<7} {text}" for at, source, text in sorted(events)
    ]


def server_time(line: str) -> float:
    """A nats-server log line's time (``[pid] 2026/01/02 03:04:05.678901 [INF] ...``)."""
    try:
        stamp = " ".join(line.split(" ")[1:3])
        whole, _, fraction = stamp.partition(".")
        return calendar.timegm(time.strptime(whole, "%Y/%m/%d %H:%M:%S")) + float(f"0.{fraction}")
    except (ValueError, IndexError):
        return 0.0
