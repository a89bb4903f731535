"""The remediation policy's last-mile hooks: run in order once the policy's cordon took
effect, with the node's facts in the environment, one aggregator at a time; a reboot
confirmed by a new boot id; a failing, hanging or unconfirmed one leaves the node
cordoned with needs_attention; the node is returned only after every hook succeeded."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
from nats.aio.msg import Msg

from actors.fleet import identity
from actors.fleet.remediation.actor import RemediationActor
from actors.fleet.remediation.config import PolicyConfig, load_policy
from actors.fleet.remediation.hooks import environment, run_hook
from actors.fleet.remediation.policy import decide
from actors.runtime import kv
from actors.runtime.bus import NatsBus
from schemas import signing
from schemas.events import Capacity, Gpu, Health, HealthCheck, Sample
from schemas.messages import NodeIdentity, NodeRecord, TrustEntry
from schemas.remediation import Hold, PolicyRecord
from schemas.subjects import BUCKET_POLICY, Subjects
from tests.fleet.test_remediation import policy, put_records
from tests.support.fleet import Fleet, heartbeat, wait_for

KEY = "U" + "P" * 55


def record(sick: bool, cordoned_by: str = "", boot: str = "b1", name: str = "n1") -> NodeRecord:
    checks = [HealthCheck(name="xid", status="unhealthy", reason="XID 79")] if sick else []
    health = Health(
        ts=time.time(), status="unhealthy" if sick else "healthy", score=40, checks=checks
    )
    beat = heartbeat(
        name,
        health=health,
        schedulability="cordoned" if cordoned_by else "schedulable",
        schedulability_by=cordoned_by,
    )
    return NodeRecord(
        node_id=name,
        cluster="c1",
        state="cordoned" if cordoned_by else "active",
        last_seq=1,
        last_seen=time.time(),
        boot_id=boot,
        heartbeat=beat,
    )


def config(**settings: Any) -> PolicyConfig:
    values: dict[str, Any] = {
        "key_file": "unused",
        "dry_run": False,
        "classes": ["xid"],
        "recover_after": 1.0,
        "breaker_max": 5,
        "breaker_percent": 100.0,
        "hooks": {"ticket": ["true"], "reboot": ["true"]},
        "hook_after": {"xid": ["ticket", "reboot"]},
        "reboot_hooks": ["reboot"],
        "reboot_confirm": 60.0,
    }
    return PolicyConfig(**{**values, **settings})


def held(**changes: Any) -> PolicyRecord:
    hold = Hold(reason_class="xid", reason="XID 79", action="cordon", command_id="c", since=1.0)
    return PolicyRecord(cluster="c1", holds={"n1": msgspec.structs.replace(hold, **changes)})


def test_hooks_wait_for_the_cordon_then_run_in_order() -> None:
    """No hook before the node's heartbeat shows the policy's cordon; then the first not
    done; a claimed one is left to its runner; none while the breaker is tripped."""
    cfg = config()
    waiting = decide(cfg, KEY, held(), [record(True)], 100.0, "x")
    assert waiting.hooks == []
    first = decide(cfg, KEY, held(), [record(True, KEY)], 100.0, "x")
    assert [(h.node, h.hook) for h in first.hooks] == [("n1", "ticket")]
    second = decide(cfg, KEY, held(hooks_done=["ticket"]), [record(True, KEY)], 100.0, "x")
    assert [h.hook for h in second.hooks] == ["reboot"]
    claimed = held(hook_running="ticket", hook_started=90.0)
    running = decide(cfg, KEY, claimed, [record(True, KEY)], 100.0, "x")
    assert running.hooks == []
    tripped = msgspec.structs.replace(held(), tripped_at=50.0)
    assert decide(cfg, KEY, tripped, [record(True, KEY)], 100.0, "x").hooks == []


def test_a_dead_runners_claim_is_taken_again() -> None:
    """A claim older than hook_timeout + interval (its aggregator died) is run again."""
    cfg = config(hook_timeout=10.0, interval=5.0)
    stale = held(hook_running="ticket", hook_started=80.0)
    assert [h.hook for h in decide(cfg, KEY, stale, [record(True, KEY)], 100.0, "x").hooks] == [
        "ticket"
    ]


def test_a_reboot_is_confirmed_by_a_new_boot_id_or_needs_attention() -> None:
    """A rebooting hold is done once the node beats with another boot id; without one
    within reboot_confirm it needs attention; the node is returned only after that."""
    cfg = config()
    rebooting = held(
        hooks_done=["ticket"], rebooting="reboot", reboot_from="b1", hook_started=100.0
    )
    same = decide(cfg, KEY, rebooting, [record(False, KEY, boot="b1")], 120.0, "x")
    assert same.orders == [] and same.record.holds["n1"].rebooting == "reboot"
    back = decide(cfg, KEY, rebooting, [record(False, KEY, boot="b2")], 120.0, "x")
    hold = back.record.holds["n1"]
    assert hold.hooks_done == ["ticket", "reboot"] and not hold.rebooting
    assert ("remediation", "n1", "reboot: rebooted (boot b1 -> b2)") in back.notes
    returned = decide(cfg, KEY, back.record, [record(False, KEY, boot="b2")], 122.0, "x")
    assert [(o.node, o.action) for o in returned.orders] == [("n1", "uncordon")]
    late = decide(cfg, KEY, rebooting, [record(False, KEY, boot="b1")], 200.0, "x")
    assert late.record.holds["n1"].needs_attention
    assert any(kind == "needs_attention" for kind, _, _ in late.notes)


def test_hooks_must_be_defined() -> None:
    """A hook named in hook_after or reboot_hooks but not in [hooks] is a config error."""
    with pytest.raises(ValueError, match="hooks reset are named but not in"):
        config(hook_after={"xid": ["reset"]})


async def test_hooks_run_with_the_nodes_facts_and_confirm_a_reboot(
    fleet: Fleet, bus: NatsBus, prefix: str, tmp_path: Path
) -> None:
    """Against a real server: the ticket hook runs once with the node's facts in FLEET_*,
    then the reboot hook; the node beating with a new boot id confirms it, and once healthy
    it is uncordoned. Two policy actors deciding together run each hook once."""
    out = tmp_path / "hooks.log"
    line = (
        f"echo $FLEET_HOOK $FLEET_NODE $FLEET_CLUSTER $FLEET_REASON_CLASS $FLEET_BOOT_ID >> {out}"
    )
    cfg, key = policy(
        tmp_path,
        hooks={"ticket": ["sh", "-c", line], "reboot": ["sh", "-c", line]},
        hook_after={"xid": ["ticket", "reboot"]},
        reboot_hooks=["reboot"],
    )
    subjects = Subjects(prefix)
    commands: list[str] = []

    async def on_command(msg: Msg) -> None:
        commands.append(msg.subject)

    await bus.subscribe(subjects.commands(), on_command)
    await bus.flush()
    first, second = RemediationActor(cfg, bus, prefix), RemediationActor(cfg, bus, prefix)
    await fleet.follow(first.feed, second.feed)
    await put_records(bus, prefix, [record(True)], first, second)
    await first.round()
    await wait_for(lambda: commands)
    await put_records(bus, prefix, [record(True, key.public_key)], first, second)
    bucket = await bus.kv(subjects.bucket_name(BUCKET_POLICY))

    async def hold() -> Hold:
        stored = await kv.read(bucket, "c1", PolicyRecord)
        assert stored is not None
        return stored.holds["n1"]

    async def rebooting() -> bool:
        await first.round()
        await second.round()
        return (await hold()).rebooting == "reboot"

    await wait_for(rebooting, interval=0.2)
    assert out.read_text().splitlines() == ["ticket n1 c1 xid b1", "reboot n1 c1 xid b1"]
    await put_records(bus, prefix, [record(False, key.public_key, boot="b2")], first, second)

    async def uncordoned() -> bool:
        await first.round()
        return len(commands) == 2

    await wait_for(uncordoned, interval=0.3)
    assert commands[1] == subjects.command("c1", "n1")
    stored = await kv.read(bucket, "c1", PolicyRecord)
    assert stored is not None and stored.holds == {}


@pytest.mark.parametrize(
    ("argv", "timeout", "why"),
    [
        (["sh", "-c", "echo no BMC answer; exit 3"], 30.0, "exit 3: no BMC answer"),
        ([sys.executable, "-c", "import time; time.sleep(60)"], 0.5, "still running after 0.5s"),
    ],
)
async def test_a_failing_or_hanging_hook_needs_attention(
    fleet: Fleet,
    bus: NatsBus,
    prefix: str,
    tmp_path: Path,
    argv: list[str],
    timeout: float,
    why: str,
) -> None:
    """A hook that exits non-zero, or outlives hook_timeout (its group killed), leaves the
    node cordoned with needs_attention and the reason; no uncordon follows."""
    cfg, key = policy(
        tmp_path, hooks={"reset": argv}, hook_after={"xid": ["reset"]}, hook_timeout=timeout
    )
    actor = RemediationActor(cfg, bus, prefix)
    await fleet.follow(actor.feed)
    await put_records(bus, prefix, [record(True)], actor)
    await actor.round()
    await put_records(bus, prefix, [record(False, key.public_key)], actor)
    bucket = await bus.kv(Subjects(prefix).bucket_name(BUCKET_POLICY))

    async def attention() -> Hold | None:
        await actor.round()
        stored = await kv.read(bucket, "c1", PolicyRecord)
        found = stored.holds.get("n1") if stored is not None else None
        return found if found is not None and found.needs_attention else None

    hold = await wait_for(attention, interval=0.3)
    assert why in hold.hook_error
    await actor.round()
    stored = await kv.read(bucket, "c1", PolicyRecord)
    assert stored is not None and "n1" in stored.holds


def test_the_documented_policy_file_loads(tmp_path: Path) -> None:
    """docs/remediation.md's policy file is one the loader takes, hooks included."""
    text = (Path(__file__).parents[2] / "docs" / "remediation.md").read_text()
    block = text.split("## The policy file", 1)[1].split("```toml\n", 1)[1].split("```", 1)[0]
    (tmp_path / "policy.toml").write_text(block)
    loaded = load_policy(tmp_path / "policy.toml")
    assert loaded.hook_after["xid"] == ["ticket", "gpu_reset"] and loaded.hook_timeout == 300
    assert loaded.reboot_hooks == ["reboot"] and loaded.dry_run


ENROLLED = NodeIdentity(hostname="node-2.example", gpus=["GPU-n2"], gpu_count=1)
EVIL = "$(touch /tmp/pwned) `id` \x1b[31mred\x00 \u202eevil\u2028end"


def sample_claiming(hostname: str, uuids: list[str]) -> Sample:
    """A sample whose host name and GPU uuids are what a node (or its stolen key) says."""
    capacity = Capacity(
        cpu_cores=1, cpu_percent=0.0, load_avg_1m=0.0, memory_total=1, memory_available=1,
        gpus_total=len(uuids), gpus_available=len(uuids), storage_total=1, storage_available=1,
    )  # fmt: skip
    gpus = [
        Gpu(index=i, uuid=u, name="H100", pci_bus_id=f"0:{i}", memory_total=1, memory_used=0)
        for i, u in enumerate(uuids)
    ]
    return Sample(ts=time.time(), capacity=capacity, gpus=gpus, hostname=hostname)


def claiming(
    hostname: str, uuids: list[str], reason: str = "XID 79", sick: bool = True
) -> NodeRecord:
    """``record(sick, KEY)`` (cordoned by the policy) whose heartbeat claims ``hostname``
    and GPUs ``uuids``, its xid check failing for ``reason``."""
    base = record(sick, KEY)
    assert base.heartbeat is not None and base.heartbeat.health is not None
    checks = [HealthCheck(name="xid", status="unhealthy", reason=reason)] if sick else []
    health = msgspec.structs.replace(base.heartbeat.health, checks=checks)
    beat = msgspec.structs.replace(
        base.heartbeat, sample=sample_claiming(hostname, uuids), health=health
    )
    return msgspec.structs.replace(base, heartbeat=beat)


def test_hooks_are_withheld_while_the_claims_name_another_machine() -> None:
    """A held node claiming another host name or a GPU it was not enrolled with gets no
    hook and one hardware_changed note per claim (none in the next rounds), and is not
    returned unfixed when healthy again; once the enrolled identity names the claims (an
    operator confirmed them) the hook runs. A GPU gone is no other machine; without an
    enrolled identity hooks run as before."""
    cfg = config()
    enrolled = {"n1": ENROLLED}
    for host, gpus in (("node-1-bmc.example", ["GPU-n2"]), ("node-2.example", ["GPU-n1"])):
        other = claiming(host, gpus)
        first = decide(cfg, KEY, held(), [other], 100.0, "x", enrolled)
        assert first.hooks == [] and first.orders == []
        [(kind, node, message)] = first.notes
        assert (kind, node) == ("hardware_changed", "n1")
        assert "fleetctl approve --identity n1" in message
        assert first.record.holds["n1"].identity_withheld
        again = decide(cfg, KEY, first.record, [other], 200.0, "x", enrolled)
        assert again.hooks == [] and again.notes == [] and again.orders == []
        healthy = [claiming(host, gpus, sick=False)]
        later = decide(cfg, KEY, again.record, healthy, 9999.0, "x", enrolled)
        assert later.orders == [] and "n1" in later.record.holds
        confirmed = {"n1": identity.claimed(other)}
        after = decide(cfg, KEY, again.record, [other], 300.0, "x", confirmed)
        assert [h.hook for h in after.hooks] == ["ticket"]
        assert after.record.holds["n1"].identity_withheld == ""
    fewer = decide(cfg, KEY, held(), [claiming("node-2.example", [])], 100.0, "x", enrolled)
    assert [h.hook for h in fewer.hooks] == ["ticket"]
    unenrolled = decide(cfg, KEY, held(), [claiming("node-1-bmc.example", ["GPU-n1"])], 1.0, "x")
    assert [h.hook for h in unenrolled.hooks] == ["ticket"]


def test_hooks_get_the_enrolled_identity_and_the_claims_apart_and_clean() -> None:
    """FLEET_HOSTNAME, FLEET_GPUS and the cloud facts (FLEET_PROVIDER, FLEET_REGION,
    FLEET_INSTANCE_TYPE) are the enrolled identity, FLEET_PUBLIC_KEY and its
    fingerprint the approved key; what the node says is in FLEET_CLAIMED_* (and the older
    FLEET_REASON, FLEET_BOOT_ID); no value keeps a control or format character (NUL, ESC,
    bidi override, line separator); without an enrolled identity the facts are empty."""
    key = signing.KeyPair.generate().public_key
    cloud = msgspec.structs.replace(
        ENROLLED, provider="aws", region="us-east-1", instance_type="p5.48xlarge"
    )
    entry = TrustEntry(node_id="n1", public_key=key, approved_at=1.0, identity=cloud)
    node = claiming("node-1-bmc.example\x1b", ["GPU-n1"], reason=EVIL)
    hold = Hold(reason_class="xid", reason=EVIL, action="cordon", command_id="c", since=1.0)
    env = environment(node, hold, "bmc", entry)
    assert (env["FLEET_HOSTNAME"], env["FLEET_GPUS"]) == ("node-2.example", "GPU-n2")
    assert (env["FLEET_PROVIDER"], env["FLEET_REGION"], env["FLEET_INSTANCE_TYPE"]) == (
        "aws",
        "us-east-1",
        "p5.48xlarge",
    )
    assert env["FLEET_PUBLIC_KEY"] == key
    assert env["FLEET_KEY_FINGERPRINT"] == signing.fingerprint(key)
    assert env["FLEET_CLAIMED_HOSTNAME"] == "node-1-bmc.example"
    assert env["FLEET_CLAIMED_GPUS"] == "GPU-n1"
    clean_reason = "$(touch /tmp/pwned) `id` [31mred evilend"
    assert env["FLEET_CLAIMED_REASON"] == env["FLEET_REASON"] == clean_reason
    assert env["FLEET_CLAIMED_BOOT_ID"] == env["FLEET_BOOT_ID"] == "b1"
    ours = {name: value for name, value in env.items() if name.startswith("FLEET_")}
    assert all(value.isprintable() for value in ours.values()), ours
    bare = environment(node, hold, "bmc", None)
    assert bare["FLEET_HOSTNAME"] == bare["FLEET_GPUS"] == bare["FLEET_PROVIDER"] == ""
    assert bare["FLEET_CLAIMED_HOSTNAME"] == "node-1-bmc.example"


def test_hooks_get_the_failing_check_and_gpus_as_the_nodes_claims() -> None:
    """A hold keeps the check and GPU indices its heartbeat named; the hook gets them as
    claims (FLEET_CLAIMED_CHECK, FLEET_CLAIMED_FAILING_GPU_INDICES and _UUIDS: the
    failing GPU only, not every GPU), beside the enrolled GPUs (FLEET_GPUS)."""
    sick = claiming("node-2.example", ["GPU-a", "GPU-b"], reason="XID 79 x1 on GPU 1")
    assert sick.heartbeat is not None and sick.heartbeat.health is not None
    check = HealthCheck(name="xid", status="unhealthy", reason="XID 79 x1 on GPU 1", gpus=[1])
    health = msgspec.structs.replace(sick.heartbeat.health, checks=[check])
    beat = msgspec.structs.replace(
        sick.heartbeat, health=health, schedulability="schedulable", schedulability_by=""
    )
    sick = msgspec.structs.replace(sick, heartbeat=beat, state="unhealthy")
    plan = decide(config(), KEY, PolicyRecord(cluster="c1"), [sick], 100.0, "x")
    hold = plan.record.holds["n1"]
    assert (hold.check, hold.gpus, hold.reason) == ("xid", [1], "XID 79 x1 on GPU 1")
    enrolled = NodeIdentity(hostname="node-2.example", gpus=["GPU-a", "GPU-b"], gpu_count=2)
    node_key = signing.KeyPair.generate().public_key
    entry = TrustEntry(node_id="n1", public_key=node_key, approved_at=1.0, identity=enrolled)
    env = environment(sick, hold, "gpu_reset", entry)
    assert env["FLEET_CLAIMED_CHECK"] == "xid"
    assert env["FLEET_CLAIMED_FAILING_GPU_INDICES"] == "1"
    assert env["FLEET_CLAIMED_FAILING_GPU_UUIDS"] == "GPU-b"
    assert env["FLEET_GPUS"] == "GPU-a,GPU-b"


async def test_a_nul_in_a_hooks_environment_fails_the_hook_without_raising() -> None:
    """A NUL the environment cannot carry makes the hook a failure with the reason (the
    node needs attention), not an exception out of the policy's hook task."""
    result = await run_hook(["true"], {"FLEET_REASON": "a\x00b"}, 5.0)
    assert not result.ok and result.detail.startswith("cannot start true:")
