"""Operator hooks: shell commands run around cordon / drain / uncordon (e.g. tell a load
balancer first). A hook is bounded by ``hooks_timeout``: one that hangs is killed, with its
whole process group, so a stuck script never stops a drain before a spot deadline.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal

import msgspec

log = logging.getLogger(__name__)


class HookOutcome(msgspec.Struct, frozen=True, kw_only=True):
    hook: str
    ok: bool
    detail: str


async def run_hook(
    hook: str, command: str, env: dict[str, str], timeout: float
) -> HookOutcome | None:
    """Run ``command`` (None when no hook is configured) and say how it went."""
    if not command:
        return None
    process = await asyncio.create_subprocess_shell(
        command,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, **env},
        # Its own process group, so a timeout kills the shell's children too.
        start_new_session=True,
    )
    try:
        async with asyncio.timeout(timeout):
            _, stderr = await process.communicate()
    except TimeoutError:
        _kill_group(process.pid)
        await process.wait()
        log.warning("hook killed at its timeout", extra={"hook": hook, "timeout_s": timeout})
        return HookOutcome(hook=hook, ok=False, detail=f"hook {hook} killed after {timeout:g}s")
    except asyncio.CancelledError:
        _kill_group(process.pid)
        raise
    if process.returncode == 0:
        return HookOutcome(hook=hook, ok=True, detail=f"hook {hook} ok")
    last_line = stderr.decode(errors="replace").strip().splitlines()[-1:] or [""]
    log.warning(
        "hook failed", extra={"hook": hook, "rc": process.returncode, "stderr": last_line[0]}
    )
    return HookOutcome(
        hook=hook,
        ok=False,
        detail=f"hook {hook} exited {process.returncode}: {last_line[0][:200]}".rstrip(": "),
    )


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
