"""Talking to Slurm from the node: its command-line tools run as asyncio subprocesses, each
bounded by a timeout, and their answers parsed.

Shared by the scheduler actor (which reads the node's state, jobs and services) and the
command executor (which drains and resumes the node in Slurm). ``SLURM_CONF`` is taken from
the environment like any Slurm tool takes it. Slurm 22.05's ``scontrol`` has no ``--json``
for ``show node`` (23.02 added it), so the one-line text form is parsed; it reads the same
on every version. Nothing here raises on a failing Slurm: every call answers
:class:`SlurmError` with a one-line reason, which callers turn into findings and results.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shutil
import signal
import time
from dataclasses import dataclass
from typing import Final

import psutil

from schemas.events import SchedulerServices

log = logging.getLogger(__name__)

MARKER: Final = "fleet:"
"""Every drain reason this agent gives Slurm starts with this: it tells ours from an admin's."""
CONTAINER_RUNTIMES: Final = ("apptainer", "singularity", "enroot", "podman", "docker")
"""Searched in this order; the first on PATH is reported."""
FAILED_STATES: Final = ("FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL")
HISTORY_WINDOW: Final = 86400
OUTPUT_LIMIT: Final = 1 << 20
"""Bytes of a tool's output kept; a node has no reason to print more than this."""
_REASON_TAIL = re.compile(r"\s*\[[^\]@]*@[^\]]*\]\s*$")
_VERSION = re.compile(r"\d+(?:\.\d+)+[\w.+~-]*")


class SlurmError(Exception):
    """A Slurm tool failed, timed out or is absent; the message is the reason in one line."""


@dataclass(frozen=True)
class NodeInfo:
    """What ``scontrol show node`` says of this node."""

    state: str
    """Lower case, as printed: ``idle``, ``mixed+drain``, ``down*+drain``..."""
    reason: str
    """The state's reason without Slurm's ``[user@time]`` tail."""
    cpus_total: int | None = None
    """``CPUTot``: the CPUs Slurm schedules on the node (None when not printed)."""
    cpus_allocated: int | None = None
    """``CPUAlloc``: those its jobs hold."""

    @property
    def drain(self) -> bool:
        return "drain" in self.state.split("+")

    @property
    def ours(self) -> bool:
        return self.drain and self.reason.startswith(MARKER)


def drain_reason(reason: str, command_id: str) -> str:
    """The reason our drains carry in Slurm: the marker, the operator's reason, the command."""
    text = reason.replace("\n", " ").strip() or "drained by the fleet"
    return f"{MARKER} {text} ({command_id})"


async def run(args: list[str], timeout: float) -> str:
    """Run a Slurm tool (no shell) and return its stdout; SlurmError with its stderr's last
    line when it fails, is missing or outlives ``timeout`` (then it is killed)."""
    if shutil.which(args[0]) is None:
        raise SlurmError(f"{args[0]} not found on PATH")
    try:
        process = await asyncio.create_subprocess_exec(
            *args,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
    except OSError as exc:
        raise SlurmError(f"{args[0]}: {exc.strerror or exc}") from None
    try:
        async with asyncio.timeout(timeout):
            stdout, stderr = await process.communicate()
    except TimeoutError:
        _kill(process.pid)
        await process.wait()
        raise SlurmError(f"{args[0]} gave no answer within {timeout:g}s") from None
    except asyncio.CancelledError:
        # Killed and reaped before the cancellation goes on, so no pipe or child is left
        # behind by an actor stopped mid-call; a killed tool exits at once.
        _kill(process.pid)
        await asyncio.shield(process.wait())
        raise
    if process.returncode != 0:
        lines = stderr[:OUTPUT_LIMIT].decode(errors="replace").strip().splitlines()
        last = lines[-1] if lines else f"exit status {process.returncode}"
        raise SlurmError(f"{args[0]}: {last[:300]}")
    return stdout[:OUTPUT_LIMIT].decode(errors="replace")


def _kill(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def parse_node(text: str) -> NodeInfo:
    """The state and reason in ``scontrol show node NAME --oneliner`` (Reason comes last
    and may hold spaces; other values are single tokens, but OS= may hold spaces too)."""
    state = re.search(r"(?:^|\s)State=(\S+)", text)
    if state is None:
        raise SlurmError(f"scontrol printed no State: {text.strip()[:200]!r}")
    reason = ""
    found = re.search(r"(?:^|\s)Reason=(.*)$", text.strip(), re.S)
    if found is not None:
        reason = _REASON_TAIL.sub("", found.group(1).splitlines()[0]).strip()
        if reason == "(null)":
            reason = ""
    return NodeInfo(
        state=state.group(1).lower(),
        reason=reason,
        cpus_total=_count(text, "CPUTot"),
        cpus_allocated=_count(text, "CPUAlloc"),
    )


def _count(text: str, field: str) -> int | None:
    """The whole number ``field=N`` of a ``--oneliner`` line; None when absent."""
    found = re.search(rf"(?:^|\s){field}=(\d{{1,9}})(?:\s|$)", text)
    return int(found.group(1)) if found is not None else None


async def node_info(name: str, timeout: float) -> NodeInfo:
    text = await run(["scontrol", "show", "node", name, "--oneliner"], timeout)
    if not text.strip():
        raise SlurmError(f"Slurm knows no node {name}")
    return parse_node(text)


async def running_jobs(name: str, timeout: float) -> int:
    """Jobs running (or completing) on node ``name``."""
    text = await run(["squeue", "--noheader", "-w", name, "-t", "R,CG", "-o", "%i"], timeout)
    return len(text.split())


async def pending_jobs(partitions: list[str], timeout: float) -> int:
    """Jobs pending in the node's partitions (pending jobs have no node yet)."""
    if not partitions:
        return 0
    args = ["squeue", "--noheader", "-t", "PD", "-p", ",".join(partitions), "-o", "%i"]
    return len((await run(args, timeout)).split())


async def partitions(name: str, timeout: float) -> list[str]:
    text = await run(["sinfo", "--noheader", "-N", "-n", name, "-o", "%R"], timeout)
    return sorted({line.strip() for line in text.splitlines() if line.strip()})


async def history(name: str, timeout: float) -> tuple[int | None, int | None, str]:
    """(completed, failed, reason) for jobs that ended on ``name`` in the last 24 h; the
    counts are None with the reason when accounting cannot say (e.g. it is disabled)."""
    start = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() - HISTORY_WINDOW))
    args = ["sacct", "--noheader", "-X", "-P", "-a", "-N", name, "-S", start, "-o", "State"]
    args += ["-s", "CD,F,TO,NF,OOM,BF"]
    try:
        text = await run(args, timeout)
    except SlurmError as exc:
        return None, None, f"no job accounting: {exc}"
    states = [line.split()[0] for line in text.splitlines() if line.strip()]
    completed = sum(1 for state in states if state == "COMPLETED")
    failed = sum(1 for state in states if state in FAILED_STATES)
    return completed, failed, ""


async def update_node(name: str, timeout: float, state: str, reason: str = "") -> None:
    """``scontrol update nodename=NAME state=STATE [reason=REASON]``."""
    args = ["scontrol", "update", f"nodename={name}", f"state={state}"]
    if reason:
        args.append(f"reason={reason}")
    await run(args, timeout)


def _processes() -> set[str]:
    names: set[str] = set()
    for process in psutil.process_iter(["name"]):
        name = process.info.get("name")
        if isinstance(name, str):
            names.add(name)
    return names


async def _version(args: list[str], timeout: float) -> str:
    """The first version-looking word a ``--version`` prints ("" if none or it fails)."""
    try:
        text = await run(args, timeout)
    except SlurmError:
        return ""
    found = _VERSION.search(text)
    return found.group(0)[:64] if found else ""


async def services(timeout: float) -> SchedulerServices:
    """slurmd and munged running (a process check) and their versions, and the first
    container runtime on PATH with its version."""
    running = await asyncio.to_thread(_processes)
    runtime = next((name for name in CONTAINER_RUNTIMES if shutil.which(name)), "")
    slurmd, munge, runtime_version = await asyncio.gather(
        _version(["slurmd", "-V"], timeout),
        _version(["munged", "-V"], timeout),
        _version([runtime, "--version"], timeout) if runtime else _none(),
    )
    return SchedulerServices(
        slurmd_running="slurmd" in running,
        slurmd_version=slurmd,
        munge_running="munged" in running,
        munge_version=munge,
        container_runtime=runtime,
        container_runtime_version=runtime_version,
    )


async def _none() -> str:
    return ""
