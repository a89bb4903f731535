"""The remediation policy's last mile: running one hook (a GPU reset, a reboot, a ticket)
on the aggregator for a node the policy holds.

A hook is a command given as a list (no shell), run with the aggregator's environment
plus the node's facts in ``FLEET_*`` variables and what the node claims in
``FLEET_CLAIMED_*`` (docs/remediation.md says which a hook may act on), in a process
group of its own, bounded by ``hook_timeout``: past it the whole group is killed and the
hook failed. What it printed (the last :data:`OUTPUT_TAIL` bytes) goes into the log and
the alert.

The facts are what the fleet recorded itself: the node's id and cluster, the key an
operator approved, and the identity recorded with that approval (its trust entry). A
node's heartbeats are its claims, and a stolen node key can claim any host name, any
GPU uuid and any text: those are passed apart, and every value is stripped of control
and format characters (NUL, ESC, newlines, bidi overrides).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import unicodedata
from dataclasses import dataclass

from actors.fleet import identity
from schemas import signing
from schemas.messages import NodeRecord, TrustEntry
from schemas.remediation import Hold

OUTPUT_TAIL = 2048
UNSAFE_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})
"""Unicode categories no hook variable keeps: controls (NUL, ESC, newlines), format
characters (bidi overrides, zero-width), lone surrogates, line and paragraph separators."""


@dataclass(frozen=True)
class HookResult:
    ok: bool
    detail: str
    """Exit status or why it failed, and the tail of its output."""


def clean(value: str) -> str:
    """``value`` without the characters of :data:`UNSAFE_CATEGORIES`."""
    if value.isascii() and value.isprintable():
        return value
    return "".join(ch for ch in value if unicodedata.category(ch) not in UNSAFE_CATEGORIES)


def environment(
    record: NodeRecord, hold: Hold, hook: str, entry: TrustEntry | None = None
) -> dict[str, str]:
    """The aggregator's environment with the node's facts (``FLEET_*``) and claims
    (``FLEET_CLAIMED_*``); ``entry`` is the node's trust entry (None: not read, or none),
    whose identity gives ``FLEET_HOSTNAME``, ``FLEET_GPUS``, ``FLEET_PROVIDER``, ... (empty
    without one). The failing check and GPUs are those the heartbeat named when the policy
    took the node out (the hold's ``check`` and ``gpus``), their UUIDs as the heartbeat
    claims them now."""
    enrolled = entry.identity if entry is not None else None
    claims = identity.claimed(record)
    key = entry.public_key if entry is not None else record.public_key
    beat = record.heartbeat
    uuids = {gpu.index: gpu.uuid for gpu in beat.sample.gpus} if beat and beat.sample else {}
    values = {
        "FLEET_HOOK": hook,
        "FLEET_NODE": record.node_id,
        "FLEET_CLUSTER": record.cluster,
        "FLEET_REASON_CLASS": hold.reason_class,
        "FLEET_PUBLIC_KEY": key,
        "FLEET_KEY_FINGERPRINT": signing.fingerprint(key) if key else "",
        "FLEET_HOSTNAME": enrolled.hostname if enrolled is not None else "",
        "FLEET_GPUS": ",".join(enrolled.gpus) if enrolled is not None else "",
        "FLEET_GPU_PRODUCT": enrolled.gpu_product if enrolled is not None else "",
        "FLEET_PROVIDER": enrolled.provider if enrolled is not None else "",
        "FLEET_REGION": enrolled.region if enrolled is not None else "",
        "FLEET_INSTANCE_TYPE": enrolled.instance_type if enrolled is not None else "",
        "FLEET_LABELS": json.dumps(record.labels, sort_keys=True),
        "FLEET_CLAIMED_HOSTNAME": claims.hostname if claims is not None else "",
        "FLEET_CLAIMED_GPUS": ",".join(claims.gpus) if claims is not None else "",
        "FLEET_CLAIMED_REASON": hold.reason,
        "FLEET_CLAIMED_CHECK": hold.check,
        "FLEET_CLAIMED_FAILING_GPU_INDICES": ",".join(str(index) for index in hold.gpus),
        "FLEET_CLAIMED_FAILING_GPU_UUIDS": ",".join(
            uuids[index] for index in hold.gpus if index in uuids
        ),
        "FLEET_CLAIMED_BOOT_ID": record.boot_id,
        # The older names of the last two, kept for hooks written before them.
        "FLEET_REASON": hold.reason,
        "FLEET_BOOT_ID": record.boot_id,
    }
    return {**os.environ, **{name: clean(value) for name, value in values.items()}}


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
    except (OSError, ValueError) as exc:  # ValueError: a NUL in an argument or variable
        reason = getattr(exc, "strerror", None) or exc
        return HookResult(False, f"cannot start {argv[0]}: {reason}")
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
