"""Issue 9 against a real nats-server: refused nodes go stale and learn it, refusal
alerts are one then summaries, a deregistered node beating is refused until re-admitted,
a re-imaged node is accepted at once under its new key, a GPU change is an alert."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from actors.fleet.metrics import AggregatorMetrics
from actors.fleet.storage.records import read_record
from actors.fleet.storage.registry import approve, readmit, revoke
from actors.runtime.bus import NatsBus
from schemas import codec, signing
from schemas.messages import Alert
from schemas.subjects import Subjects
from tests.fleet.test_aggregator import publish, watch_alerts
from tests.fleet.test_lifecycle_rules import gpus
from tests.support.fleet import Fleet, heartbeat, new_aggregator, wait_for, wait_record

REFUSED = "fleet_heartbeats_refused_total"


def summaries(alerts: list[Alert]) -> list[Alert]:
    return [alert for alert in alerts if "suppressed" in alert.details]


async def test_a_refused_node_goes_stale_learns_it_and_gets_one_alert_then_summaries(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """An agent that keeps beating with a revoked key is stale within stale_after + 2 s of
    its last accepted beat; revoked (issue 33: not unknown_node) is raised once, then as
    summaries with a count; the agent reads the refusal from its record and says so."""
    alerts = await watch_alerts(bus, prefix)
    await fleet.start_aggregator(sweep_interval=0.2, alert_repeat=1.0, refused_note_every=0.5)
    agent = await fleet.start_agent()
    await wait_record(bus, prefix, "n1", lambda r: r.state == "active")
    await revoke(bus, Subjects(prefix), "n1")
    stale = await wait_record(bus, prefix, "n1", lambda r: r.state == "stale")
    assert stale.stale_since is not None
    assert stale.stale_since - stale.last_seen <= 2.0 + 2.0  # stale_after + 2 s
    assert stale.refused == "revoked"
    await wait_for(lambda: alerts.of("stale"))

    await wait_for(lambda: summaries(alerts.of("revoked")))
    refusals = alerts.of("revoked")
    firsts = [alert for alert in refusals if "suppressed" not in alert.details]
    assert len(firsts) == 1 and refusals[0] is firsts[0]
    assert int(summaries(refusals)[0].details["suppressed"]) >= 1

    assert agent.standing is not None
    await wait_for(lambda: agent.standing is not None and agent.standing.refused)
    assert agent.standing.message() == "heartbeats refused by the aggregator: revoked"


async def test_a_deregistered_node_beating_is_refused_once_per_boot_until_readmitted(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """After a deregistering beat, beats of a new boot are refused with one
    deregistered_node_beating alert per boot; after readmit they are accepted."""
    alerts = await watch_alerts(bus, prefix)
    metrics = AggregatorMetrics()
    await fleet.start_supervisor(new_aggregator(bus, prefix, metrics))
    key = signing.KeyPair.generate()
    await approve(bus, Subjects(prefix), "n1", key.public_key)

    def refused() -> float:
        value = metrics.registry.get_sample_value(REFUSED, {"kind": "deregistered_node_beating"})
        return value or 0.0

    async def send(seq: int, boot: str, deregistering: bool = False) -> None:
        body = codec.encode(heartbeat(seq=seq, boot_id=boot, deregistering=deregistering))
        await publish(bus, prefix, body, key.headers(body))

    await send(1, "b1")
    await wait_record(bus, prefix, "n1", lambda r: r.last_seq == 1)
    await send(2, "b1", deregistering=True)
    await wait_record(bus, prefix, "n1", lambda r: r.state == "deregistered")
    for count, (seq, boot) in enumerate([(3, "b2"), (4, "b2"), (5, "b3")], start=1):
        await send(seq, boot)
        await wait_for(lambda count=count: refused() == count)  # type: ignore[misc]
    beating = alerts.of("deregistered_node_beating")
    await wait_for(lambda: len(alerts.of("deregistered_node_beating")) >= 2)
    beating = alerts.of("deregistered_node_beating")
    assert sorted(alert.details["boot_id"] for alert in beating) == ["b2", "b3"]
    record = await read_record(bus, Subjects(prefix), "n1")
    assert record.state == "deregistered" and record.last_seq == 2

    assert await readmit(bus, Subjects(prefix), "n1")
    await send(6, "b3")
    accepted = await wait_record(bus, prefix, "n1", lambda r: r.last_seq == 6)
    assert accepted.state == "active" and not accepted.deregistered and accepted.refused == ""


async def test_a_reimaged_node_is_accepted_at_once_under_its_new_key(
    fleet: Fleet, bus: NatsBus, prefix: str, state_dir: Path
) -> None:
    """Agent runs; its last accepted seq is far ahead; its state dir is wiped (new key,
    seq from 1); once the new key is approved its first beats are accepted, and a replay
    signed by the old key is refused by signature."""
    alerts = await watch_alerts(bus, prefix)
    await fleet.start_aggregator()
    config = fleet.config()
    agent = await fleet.start_agent(config)
    await wait_record(bus, prefix, "n1", lambda r: r.state == "active")
    await agent.stop()
    old = signing.load_key_file(config.key_path)
    ahead = codec.encode(heartbeat(seq=5_000, boot_id="old"))
    # The old agent's last beat, far ahead of where a fresh state dir starts.
    await bus.js.publish(Subjects(prefix).heartbeat("c1", "n1"), ahead, headers=old.headers(ahead))
    await wait_record(bus, prefix, "n1", lambda r: r.last_seq == 5_000)

    shutil.rmtree(config.state_dir)
    started = time.monotonic()
    await fleet.start_agent(config)  # a new key, approved, then the agent starts
    new = signing.load_key_file(config.key_path)
    assert new.public_key != old.public_key
    # Accepted, and active once its health says so: a fresh agent's first sample on a
    # busy machine may call it degraded for a beat, which is not this test's subject.
    record = await wait_record(
        bus, prefix, "n1", lambda r: r.public_key == new.public_key and r.state == "active"
    )
    assert record.last_seq < 5_000
    assert time.monotonic() - started < 15  # a sanity bound: a refusal would last forever
    assert not alerts.of("replay")

    replay = codec.encode(heartbeat(seq=6_000, boot_id="old"))
    await publish(bus, prefix, replay, old.headers(replay))
    await wait_for(lambda: alerts.of("unknown_node"))
    current = await read_record(bus, Subjects(prefix), "n1")
    assert current.last_seq < 5_000 and current.public_key == new.public_key


async def test_a_gpu_swap_raises_hardware_changed(fleet: Fleet, bus: NatsBus, prefix: str) -> None:
    """A heartbeat whose GPU set differs from the record's raises hardware_changed with
    the before/after lists; the record keeps the new fingerprint."""
    alerts = await watch_alerts(bus, prefix)
    await fleet.start_aggregator()
    key = signing.KeyPair.generate()
    await approve(bus, Subjects(prefix), "n1", key.public_key)
    for seq, sample in [(1, gpus("GPU-a", "GPU-b")), (2, gpus("GPU-a", "GPU-c"))]:
        body = codec.encode(heartbeat(seq=seq, sample=sample))
        await publish(bus, prefix, body, key.headers(body))
        await wait_record(bus, prefix, "n1", lambda r, seq=seq: r.last_seq == seq)  # type: ignore[misc]
    await wait_for(lambda: alerts.of("hardware_changed"))
    (alert,) = alerts.of("hardware_changed")
    assert alert.details["before"] == "GPU-a,GPU-b" and alert.details["after"] == "GPU-a,GPU-c"
    record = await read_record(bus, Subjects(prefix), "n1")
    assert record.gpu_fingerprint == ["GPU-a", "GPU-c"]
