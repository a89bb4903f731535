"""``fleetctl policy status|reset|clear`` and describe's remediation lines, as an operator
runs them against a real nats-server."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

from actors.cli.fleetctl import policy
from actors.fleet.config import AggregatorConfig
from actors.fleet.operator.policy_requests import PolicyRequestsActor
from actors.fleet.remediation.actor import policy_bucket
from actors.runtime import kv
from actors.runtime.bus import NatsBus
from actors.runtime.embedded import NatsServer
from schemas import codec, signing
from schemas.remediation import Hold, PolicyRecord
from schemas.subjects import Subjects
from tests.support.commanding import Results
from tests.support.fleet import Fleet, wait_for

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
        reason="XID 79 x1 on GPU 0",
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
        base=20,
    )


async def test_status_reset_and_clear(
    nats_server: NatsServer, bus: NatsBus, fleet: Fleet, prefix: str, tmp_path: Path
) -> None:
    """status shows the tripped breaker with its base, its would-be actions and each hold
    with why; reset and clear are signed requests an aggregator carries out: reset closes
    the breaker, clear forgets a needs-attention node, each raising a remediation alert
    naming the operator; the describe lines name the hold and the remediations."""
    operator = signing.create_key_file(tmp_path / "operator.nk")
    config = AggregatorConfig(prefix=prefix, trust_operators=[operator.public_key])
    await fleet.start_supervisor(PolicyRequestsActor(config, bus))
    results = await Results().start(bus, prefix)
    subjects = Subjects(prefix)
    bucket = await bus.js.create_key_value(policy_bucket(subjects))
    await bucket.put("c1", codec.encode(tripped_record()))
    code, out, err = await fleetctl(nats_server, prefix, "policy", "status")
    assert code == 0, err
    assert "Cluster c1: breaker TRIPPED" in out and "holds 2 of at most 2 (of 20 reporting" in out
    assert "would: cordon n3 (policy: xid: XID 79)" in out
    assert "needs attention" in out and "XID 79 x1 on GPU 0" in out
    key = ("--key-file", str(tmp_path / "operator.nk"))
    code, out, err = await fleetctl(nats_server, prefix, "policy", "reset", "--cluster", "c1", *key)
    assert code == 0 and "reset" in out, err
    code, out, err = await fleetctl(
        nats_server, prefix, "policy", "clear", "n2", "--cluster", "c1", *key
    )
    assert code == 0, err
    stored = await kv.read(bucket, "c1", PolicyRecord)
    assert stored is not None and stored.tripped_at is None and stored.would == []
    assert list(stored.holds) == ["n1"] and "n2" not in stored.history
    assert stored.updated_by == operator.public_key
    code, _, err = await fleetctl(
        nats_server, prefix, "policy", "clear", "n9", "--cluster", "c1", *key
    )
    assert code != 0 and "holds nothing of n9" in err and "Traceback" not in err
    lines = policy.node_lines([stored], "c1", "n1", NOW)
    assert lines[0].startswith("Remediation:     cordon by policy since")
    assert lines[1].startswith("Remediated:      1 times")
    done = await wait_for(lambda: len(results.alerts) >= 2 and results.alerts)
    by = signing.fingerprint(operator.public_key)
    assert sorted((a.kind, a.node_id, a.message) for a in done) == [
        ("remediation", "_cluster", f"breaker reset by operator {by}"),
        ("remediation", "n2", f"hold cleared by operator {by}"),
    ]


async def test_status_without_a_policy(nats_server: NatsServer, bus: NatsBus, prefix: str) -> None:
    """With no aggregator ever running the policy, status says so and exits 0."""
    code, out, err = await fleetctl(nats_server, prefix, "policy", "status")
    assert code == 0, err
    assert "holds nothing" in out
