"""Workload processes: start one in a process group of its own, recognise it again after an
agent restart, stop the whole group, and keep its log bounded.

A workload outlives the agent that started it (its own session, its output in a file, not
a pipe to the agent), so an agent restart does not restart a model that took minutes to
load: the new agent finds it by pid and process start time (a pid alone may have been
reused). Its log is rotated by copy-and-truncate, which the child, writing with
``O_APPEND``, does not notice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import psutil

log = logging.getLogger(__name__)

GROUP_POLL = 0.25
"""Seconds between two looks at a stopping group."""
KILL_WAIT = 5.0
"""Seconds to wait for a SIGKILLed group to be gone."""
TAIL_CHARS = 600
"""Characters of a workload's log quoted in a failure result (a result's detail is 1024)."""

_children: dict[int, subprocess.Popen[bytes]] = {}
"""Processes this agent process started, by pid, so their exit is collected (no zombie)
and no Popen is dropped while its child runs; a process outlives the actor that started
it, so this is per process, not per actor."""


def free_port() -> int:
    """A loopback port nothing listens on right now (the kernel's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def port_in_use(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def spawn(argv: list[str], env: dict[str, str], log_path: Path) -> tuple[int, float]:
    """Start ``argv`` in a new session (its own process group) with ``env`` added to the
    agent's environment, output appended to ``log_path``; (pid, start time). Raises OSError
    when it cannot be started."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    full_env = {**os.environ, **env}
    with log_path.open("ab") as log:
        started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        log.write(f"--- {started} start: {argv}\n".encode())
        log.flush()
        child = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=full_env,
            start_new_session=True,
            close_fds=True,
        )
    _children[child.pid] = child
    return child.pid, started_at(child.pid)


def started_at(pid: int) -> float:
    """The process's start time as psutil reports it (0.0 when it is already gone)."""
    try:
        return float(psutil.Process(pid).create_time())
    except psutil.Error:
        return 0.0


def alive(pid: int, start: float) -> bool:
    """Whether ``pid`` is still the process started at ``start`` and not a zombie."""
    try:
        process = psutil.Process(pid)
        if abs(process.create_time() - start) > 0.05:
            return False
        return bool(process.status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False


def reap(pid: int) -> int | None:
    """Collect the exit status of our own child ``pid`` if it has ended (None while it runs
    or when another agent process started it)."""
    child = _children.get(pid)
    if child is None or child.poll() is None:
        return None
    del _children[pid]
    return child.returncode


def group_pids(pgid: int) -> list[int]:
    """Live processes of process group ``pgid`` (zombies excluded)."""
    pids = []
    for process in psutil.process_iter(["pid", "status"]):
        try:
            if os.getpgid(process.pid) == pgid and process.status() != psutil.STATUS_ZOMBIE:
                pids.append(process.pid)
        except (OSError, psutil.Error):
            continue
    return pids


async def end_group(pgid: int, grace: float) -> list[int]:
    """SIGTERM the group, SIGKILL it after ``grace`` seconds; the pids still alive."""
    if pgid <= 0:
        return []
    signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while group_pids(pgid) and time.monotonic() < deadline:
        reap(pgid)
        await asyncio.sleep(GROUP_POLL)
    left = group_pids(pgid)
    if left:
        log.warning("workload ignored SIGTERM; SIGKILL", extra={"pgid": pgid, "pids": left})
        signal_group(pgid, signal.SIGKILL)
        deadline = time.monotonic() + KILL_WAIT
        while left and time.monotonic() < deadline:
            reap(pgid)
            await asyncio.sleep(GROUP_POLL / 5)
            left = group_pids(pgid)
    return left


def signal_group(pgid: int, signum: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


def rotate(log_path: Path, max_bytes: int) -> None:
    """Keep ``log_path`` under ``max_bytes``: copy it to ``.1`` and truncate it in place."""
    try:
        if log_path.stat().st_size <= max_bytes:
            return
        old = log_path.with_name(log_path.name + ".1")
        with log_path.open("rb") as src, old.open("wb") as dst:
            dst.write(src.read(max_bytes * 2))
        with log_path.open("r+b") as handle:
            handle.truncate(0)
    except OSError:
        return


def tail(log_path: Path, chars: int = TAIL_CHARS) -> str:
    """The last ``chars`` characters of the log, as text ("" when there is none)."""
    try:
        with log_path.open("rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - chars * 4))
            text = handle.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return text[-chars:].strip()
