"""Versions of the programs a node's work depends on (nvidia-smi, slurmd, docker, podman),
from each one's ``--version``: run concurrently, each under a timeout, off the sample path,
and cached by the inventory between refreshes (a version changes with a package upgrade,
not between samples)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal

from schemas.base import MAX_DEPENDENCIES, MAX_NAME
from schemas.events import Dependency

log = logging.getLogger(__name__)

MAX_OUTPUT = 64 * 1024
"""Bytes of a program's output read for its version; the rest is never kept."""


async def version_of(program: str, timeout: float, search_path: str | None = None) -> str | None:
    """The first non-empty line ``program --version`` prints (stdout, else stderr), or None
    when the program is absent, fails, or does not answer within ``timeout``."""
    path = shutil.which(program, path=search_path)
    if path is None:
        return None
    try:
        process = await asyncio.create_subprocess_exec(
            path,
            "--version",
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
    except OSError as exc:
        log.debug("version not read", extra={"program": program, "reason": str(exc)})
        return None
    try:
        async with asyncio.timeout(timeout):
            stdout, stderr = await process.communicate()
    except asyncio.CancelledError:
        # The agent is stopping: leave nothing running behind it, and reap what was.
        _kill(process)
        await process.wait()
        raise
    except TimeoutError:
        _kill(process)
        await process.wait()
        log.warning("--version did not answer", extra={"program": program, "timeout": timeout})
        return None
    if process.returncode != 0:
        log.debug("--version failed", extra={"program": program, "status": process.returncode})
        return None
    for output in (stdout, stderr):
        for line in output[:MAX_OUTPUT].decode(errors="replace").splitlines():
            if line.strip():
                return " ".join(line.split())[:MAX_NAME]
    return None


def _kill(process: asyncio.subprocess.Process) -> None:
    """Kill the program's whole session: a wrapper's children would hold the pipes (and
    ``wait()``) open."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)


async def read_versions(
    programs: list[str], timeout: float, search_path: str | None = None
) -> list[Dependency]:
    """Every program of ``programs`` that answers ``--version``, in the given order."""
    wanted = programs[:MAX_DEPENDENCIES]
    answers = await asyncio.gather(
        *(version_of(program, timeout, search_path) for program in wanted)
    )
    return [
        Dependency(name=program.rsplit("/", 1)[-1][:MAX_NAME], version=answer)
        for program, answer in zip(wanted, answers, strict=True)
        if answer is not None
    ]
