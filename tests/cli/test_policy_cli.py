"""``fleetctl policy status|reset|clear`` and describe's remediation lines, as an operator
runs them against a real nats-server."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

from actors.cli.fleetctl import policy
from actors.fleet.remediation.actor import policy_bucket
from actors.runtime import kv
from actors.runtime.bus import NatsBus
from actors.runtime.embedded import NatsServer
from schemas import codec
from schemas.remediation import Hold, PolicyRecord
from schemas.subjects import Subjects

FLEETCTL = str(Path(sys.executable).parent / "fleetctl")
NOW = time.time()


async def fleetctl(server: NatsServer, prefix: str, *args: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        FLEETCTL,
        *args,
        "--server",
        server.url,
        "--prefix",
        prefix,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


def tripped_record() -> PolicyRecord:
    held = Hold(
        reason_class="xid",
        reason="xid: XID 79 x1 on GPU 0",
        action="cordon",
        command_id="c-0",
        since=NOW - 600,
    )
    sticky = Hold(
        reason_class="gpu",
        reason="gpu_memory: row remap failed",
        action="cordon",
        command_id="c-1",
        since=NOW - 60,
        needs_attention=True,
    )
    return PolicyRecord(
        cluster="c1",
        holds={"n1": held, "n2": sticky},
        history={"n1": [NOW - 600], "n2": [NOW - 900, NOW - 60]},
        tripped_at=NOW - 30,
        would=["cordon n3 (policy: xid: XID 79)"],
        limit=2,
    )


async def test_status_reset_and_clear(nats_server: NatsServer, bus: NatsBus, prefix: str) -> None:
    """status shows the tripped breaker, its would-be actions and each hold with why;
    reset closes the breaker; clear forgets a needs-attention node; the describe lines
    name the hold and the remediations."""
    subjects = Subjects(prefix)
    bucket = await bus.js.create_key_value(policy_bucket(subjects))
    await bucket.put("c1", codec.encode(tripped_record()))
    code, out, err = await fleetctl(nats_server, prefix, "policy", "status")
    assert code == 0, err
    assert "Cluster c1: breaker TRIPPED" in out and "holds 2 of at most 2" in out
    assert "would: cordon n3 (policy: xid: XID 79)" in out
    assert "needs attention" in out and "xid: XID 79 x1 on GPU 0" in out
    code, out, err = await fleetctl(nats_server, prefix, "policy", "reset", "--cluster", "c1")
    assert code == 0 and "reset" in out, err
    code, out, err = await fleetctl(nats_server, prefix, "policy", "clear", "n2", "--cluster", "c1")
    assert code == 0, err
    stored = await kv.read(bucket, "c1", PolicyRecord)
    assert stored is not None and stored.tripped_at is None and stored.would == []
    assert list(stored.holds) == ["n1"] and "n2" not in stored.history
    code, _, err = await fleetctl(nats_server, prefix, "policy", "clear", "n9", "--cluster", "c1")
    assert code != 0 and "holds nothing of n9" in err and "Traceback" not in err
    lines = policy.node_lines([stored], "c1", "n1", NOW)
    assert lines[0].startswith("Remediation:     cordon by policy since")
    assert lines[1].startswith("Remediated:      1 times")


async def test_status_without_a_policy(nats_server: NatsServer, bus: NatsBus, prefix: str) -> None:
    """With no aggregator ever running the policy, status says so and exits 0."""
    code, out, err = await fleetctl(nats_server, prefix, "policy", "status")
    assert code == 0, err
    assert "holds nothing" in out
