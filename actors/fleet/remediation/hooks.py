"""The remediation policy's last mile: running one hook (a GPU reset, a reboot, a ticket)
on the aggregator for a node the policy holds.

A hook is a command given as a list (no shell), run with the aggregator's environment
plus the node's facts in ``FLEET_*`` variables, in a process group of its own, bounded by
``hook_timeout``: past it the whole group is killed and the hook failed. What it printed
(the last :data:`OUTPUT_TAIL` bytes) goes into the log and the alert.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from dataclasses import dataclass

from schemas.messages import NodeRecord
from schemas.remediation import Hold

OUTPUT_TAIL = 2048


@dataclass(frozen=True)
class HookResult:
    ok: bool
    detail: str
    """Exit status or why it failed, and the tail of its output."""


def environment(record: NodeRecord, hold: Hold, hook: str) -> dict[str, str]:
    """The aggregator's environment with the node's facts a hook acts on."""
    beat = record.heartbeat
    sample = beat.sample if beat is not None else None
    gpus = ",".join(gpu.uuid for gpu in sample.gpus) if sample is not None else ""
    return {
        **os.environ,
        "FLEET_HOOK": hook,
        "FLEET_NODE": record.node_id,
        "FLEET_CLUSTER": record.cluster,
        "FLEET_REASON_CLASS": hold.reason_class,
        "FLEET_REASON": hold.reason,
        "FLEET_BOOT_ID": record.boot_id,
        "FLEET_PUBLIC_KEY": record.public_key,
        "FLEET_HOSTNAME": sample.hostname if sample is not None else "",
        "FLEET_GPUS": gpus,
        "FLEET_LABELS": json.dumps(record.labels, sort_keys=True),
    }


async def run_hook(argv: list[str], env: dict[str, str], timeout: float) -> HookResult:
    """Run one hook to its end or its timeout; never raises for the hook's own failure."""
    try:
        process = await asyncio.create_subprocess_exec(
            *argv,
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
        )
    except OSError as exc:
        return HookResult(False, f"cannot start {argv[0]}: {exc.strerror or exc}")
    try:
        async with asyncio.timeout(timeout):
            output, _ = await process.communicate()
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        await process.wait()
        return HookResult(False, f"still running after {timeout:g}s: killed")
    except asyncio.CancelledError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        raise
    tail = output[-OUTPUT_TAIL:].decode(errors="replace").strip()
    status = f"exit {process.returncode}" + (f": {tail}" if tail else "")
    return HookResult(process.returncode == 0, status)
