"""Issue 40: a stolen node key cannot make the remediation policy's hooks act on another
machine. The attacker holds only node n2's seed and signs heartbeats with it from a plain
nats-py client; n2 was enrolled (registered with its identity, approved by an operator)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path

from nats.js import JetStreamContext

from actors.fleet.remediation.actor import RemediationActor
from actors.fleet.storage import registry
from actors.fleet.views import history
from actors.runtime.bus import NatsBus
from schemas import codec, signing
from schemas.events import Health, HealthCheck
from schemas.messages import (
    Alert,
    Heartbeat,
    NodeIdentity,
    Registration,
    RegistrationReply,
    TrustEntry,
)
from schemas.subjects import Subjects
from tests.fleet.test_remediation import policy
from tests.fleet.test_remediation_hooks import sample_claiming
from tests.security.attack import attacker
from tests.support.fleet import Fleet, heartbeat, wait_for, wait_record

FLEETCTL = str(Path(sys.executable).parent / "fleetctl")
N1_GPU = "GPU-11111111-1111-1111-1111-111111111111"
N2_GPU = "GPU-22222222-2222-2222-2222-222222222222"
DUMP_ENV = (
    "import json, os, sys; "
    "open(sys.argv[1], 'w').write(json.dumps({k: v for k, v in os.environ.items() "
    "if k.startswith('FLEET_')}))"
)


async def fleetctl(fleet: Fleet, *args: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        FLEETCTL,
        *args,
        "--server",
        fleet.url,
        "--prefix",
        fleet.prefix,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        stdin=asyncio.subprocess.DEVNULL,
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def enrolled_n2(fleet: Fleet, bus: NatsBus) -> signing.KeyPair:
    """n2 registers with its identity (as ``node-agent register`` does) and an operator
    approves it with ``fleetctl approve n2 --yes``: its trust entry records the identity."""
    key = signing.KeyPair.generate()
    identity = NodeIdentity(
        hostname="node-2.example", gpus=[N2_GPU], gpu_product="H100", gpu_count=1
    )
    registration = Registration(
        node_id="n2", cluster="c1", public_key=key.public_key, ts=time.time(), identity=identity
    )
    body = codec.encode(registration)
    reply = await bus.request(Subjects(fleet.prefix).register(), body, 10, key.headers(body))
    assert codec.decode(reply.data, RegistrationReply).status == "pending"
    code, out, err = await fleetctl(fleet, "approve", "n2", "--yes")
    assert code == 0 and out == "approved n2\n", err
    assert "identity host node-2.example, 1 GPUs (H100)" in err
    entry = await registry.trust_entry(bus, Subjects(fleet.prefix), "n2")
    assert entry is not None and entry.identity == identity and entry.identity_by == "fleetctl"
    return key


async def forge(js: JetStreamContext, prefix: str, key: signing.KeyPair, beat: Heartbeat) -> None:
    """Publish ``beat`` as n2's stolen key can: signed with it, from anywhere."""
    body = codec.encode(beat)
    headers = {**key.headers(body), "Nats-Msg-Id": os.urandom(8).hex()}
    await js.publish(Subjects(prefix).heartbeat("c1", "n2"), body, headers=headers)


async def hardware_alerts(bus: NatsBus, prefix: str) -> list[Alert]:
    """n2's hardware_changed alerts as FLEET_ALERTS stores them."""
    alerts, _ = await history.node_history(bus, Subjects(prefix), "n2")
    return [
        entry.message
        for entry in alerts
        if isinstance(entry.message, Alert) and entry.message.kind == "hardware_changed"
    ]


async def test_a_forged_identity_runs_no_hook_until_an_operator_confirms_it(
    fleet: Fleet, bus: NatsBus, prefix: str, tmp_path: Path
) -> None:
    """n2's stolen key forges heartbeats claiming host node-1-bmc.example, node-1's GPU, an
    unhealthy boot check and a reason full of $(...), backticks, ESC and NUL. The policy
    cordons n2 (the node the key is) but runs no hook, and raises one hardware_changed
    alert over many rounds. After ``fleetctl approve --identity n2`` the hook runs, its
    FLEET_* facts the enrolled identity and key, its FLEET_CLAIMED_* the claims without
    control characters; nothing ran the reason's shell."""
    pwned = tmp_path / "pwned"
    reason = f"$(touch {pwned}) `touch {pwned}` \x1b[2J\x00 GPU fell off"
    dump = tmp_path / "env.json"
    config, policy_key = policy(
        tmp_path,
        classes=["gpu"],
        hooks={"bmc": [sys.executable, "-c", DUMP_ENV, str(dump)]},
        hook_after={"gpu": ["bmc"]},
    )
    await fleet.start_aggregator()
    key = await enrolled_n2(fleet, bus)
    actor = RemediationActor(config, bus, prefix)
    await actor.open()
    await fleet.follow(actor.feed)
    boot = HealthCheck(name="boot", status="unhealthy", reason=reason)
    health = Health(ts=time.time(), status="unhealthy", score=0, checks=[boot])
    claims = sample_claiming("node-1-bmc.example", [N1_GPU])
    async with attacker(fleet.url) as nc:
        js = nc.jetstream()
        await forge(js, prefix, key, heartbeat("n2", 1, sample=claims, health=health))
        await wait_record(bus, prefix, "n2", lambda r: r.state == "unhealthy")
        await actor.round()  # the policy cordons n2 and holds it
        cordoned = heartbeat(
            "n2",
            2,
            sample=claims,
            health=health,
            schedulability="cordoned",
            schedulability_by=policy_key.public_key,
        )
        await forge(js, prefix, key, cordoned)
        await wait_record(bus, prefix, "n2", lambda r: r.state == "cordoned")

        async def alerted() -> list[Alert]:
            await actor.round()
            return await hardware_alerts(bus, prefix)

        [alert] = await wait_for(alerted, interval=0.2)
        for _ in range(5):
            await actor.round()
        assert len(await hardware_alerts(bus, prefix)) == 1
        assert "node-1-bmc.example (enrolled: node-2.example)" in alert.message
        assert f"GPU {N1_GPU} (not enrolled)" in alert.message
        assert not dump.exists() and not actor.hook_tasks
        code, out, err = await fleetctl(fleet, "approve", "--identity", "n2", "--yes")
        assert code == 0, err
        assert out.startswith("identity of n2 recorded: host node-1-bmc.example, 1 GPUs")

        async def hooked() -> bool:
            await actor.round()
            return dump.exists() and not actor.hook_tasks

        await wait_for(hooked, interval=0.2)
    env = json.loads(dump.read_text())
    entry = await registry.trust_entry(bus, Subjects(prefix), "n2")
    assert isinstance(entry, TrustEntry) and entry.identity is not None
    assert env["FLEET_NODE"] == "n2" and env["FLEET_CLUSTER"] == "c1"
    assert env["FLEET_HOSTNAME"] == entry.identity.hostname == "node-1-bmc.example"
    assert env["FLEET_GPUS"] == ",".join(entry.identity.gpus) == N1_GPU
    assert env["FLEET_PUBLIC_KEY"] == key.public_key
    assert env["FLEET_KEY_FINGERPRINT"] == signing.fingerprint(key.public_key)
    assert env["FLEET_CLAIMED_HOSTNAME"] == "node-1-bmc.example"
    assert env["FLEET_CLAIMED_GPUS"] == N1_GPU
    expected = f"boot: $(touch {pwned}) `touch {pwned}` [2J GPU fell off"
    assert env["FLEET_CLAIMED_REASON"] == expected
    assert all(value.isprintable() for value in env.values()), env
    assert not pwned.exists()
    assert len(await hardware_alerts(bus, prefix)) == 1
