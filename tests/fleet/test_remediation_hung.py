"""Issue 41: a hung host as a remediation case of its own. A node silent past the default
``hung_after`` (its record stale for 700 s, written as the aggregator would) is cordoned
in its queue, its ``hung`` hook (a BMC power cycle) runs once, on the aggregator, and it
is uncordoned only after it beats again with a new boot id."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import msgspec
from nats.aio.msg import Msg

from actors.fleet.remediation.actor import RemediationActor
from actors.runtime import kv
from actors.runtime.bus import NatsBus
from schemas import codec
from schemas.messages import Command, Cordon, NodeRecord, Uncordon
from schemas.remediation import PolicyRecord
from schemas.subjects import BUCKET_POLICY, Subjects
from tests.fleet.test_remediation import policy, put_records, synthetic
from tests.support.fleet import Fleet, wait_for

CYCLE = "import sys; open(sys.argv[1], 'a').write('cycled\\n')"


def silent(boot: str = "b1") -> NodeRecord:
    """n1's record as the aggregator leaves it after 700 s without a heartbeat (it was
    healthy and schedulable when it last beat, and said no goodbye)."""
    record = synthetic("n1", False)
    seen = time.time() - 700
    return msgspec.structs.replace(
        record, state="stale", last_seen=seen, stale_since=seen + 2, boot_id=boot
    )


def back(boot: str, cordoned_by: str) -> NodeRecord:
    """n1 beating again, healthy, with ``boot`` and the policy's queued cordon shown."""
    record = synthetic("n1", False)
    assert record.heartbeat is not None
    beat = msgspec.structs.replace(
        record.heartbeat,
        boot_id=boot,
        schedulability="cordoned",
        schedulability_by=cordoned_by,
    )
    return msgspec.structs.replace(record, state="cordoned", boot_id=boot, heartbeat=beat)


async def test_a_hung_node_is_power_cycled_once_and_returned_after_a_new_boot_id(
    fleet: Fleet, bus: NatsBus, prefix: str, tmp_path: Path
) -> None:
    """Silent past hung_after (default): one cordon queued, the hung hook runs once
    however many rounds pass; back with its old boot id it stays cordoned; with a new one
    it is uncordoned (recover_after set short: not what this is about)."""
    cycled = tmp_path / "cycled"
    config, key = policy(
        tmp_path,
        classes=["hung"],
        hooks={"bmc": [sys.executable, "-c", CYCLE, str(cycled)]},
        hook_after={"hung": ["bmc"]},
        reboot_hooks=["bmc"],
        recover_after=1.0,
    )
    assert config.hung_after == 600.0
    commands: list[Command] = []

    async def on_command(msg: Msg) -> None:
        commands.append(codec.decode(msg.data, Command, msg.subject))

    await bus.subscribe(Subjects(prefix).commands(), on_command)
    await bus.flush()
    healthy = [synthetic(f"h{index}", False) for index in range(9)]
    actor = RemediationActor(config, bus, prefix)
    await fleet.follow(actor.feed)
    await put_records(bus, prefix, [silent(), *healthy], actor)
    bucket = await actor.open()

    async def hold_state() -> PolicyRecord | None:
        await actor.round()
        current = await kv.read(bucket, "c1", PolicyRecord)
        return current if current is not None and "n1" in current.holds else None

    current = await wait_for(hold_state)
    assert current.holds["n1"].reason_class == "hung"

    async def rebooting() -> bool:
        await actor.round()
        now = await kv.read(bucket, "c1", PolicyRecord)
        return now is not None and now.holds["n1"].rebooting == "bmc"

    await wait_for(rebooting, timeout=30)
    for _ in range(3):
        await actor.round()
    assert cycled.read_text() == "cycled\n"
    await put_records(bus, prefix, [back("b1", key.public_key)], actor)
    for _ in range(3):
        await actor.round()
    await bus.flush()
    assert [type(c.action) for c in commands] == [Cordon]
    await put_records(bus, prefix, [back("b2", key.public_key)], actor)

    async def uncordoned() -> bool:
        await actor.round()
        await bus.flush()
        return any(isinstance(c.action, Uncordon) for c in commands)

    await wait_for(uncordoned, timeout=30)
    assert [type(c.action) for c in commands] == [Cordon, Uncordon]
    assert cycled.read_text() == "cycled\n"
    stored = await kv.read(
        await bus.kv(Subjects(prefix).bucket_name(BUCKET_POLICY)), "c1", PolicyRecord
    )
    assert stored is not None and stored.holds == {}
