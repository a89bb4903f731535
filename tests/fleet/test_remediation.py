"""The remediation policy against real servers: fake-GPU agents cordoned and returned by
the policy, an operator's cordon left alone, two aggregators sharing the breaker, dry run."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
from nats.aio.msg import Msg

from actors.fleet.remediation.actor import RemediationActor
from actors.fleet.remediation.config import PolicyConfig
from actors.runtime import kv
from actors.runtime.bus import NatsBus
from schemas import codec, signing
from schemas.events import Health, HealthCheck, Inject
from schemas.messages import Cordon, NodeRecord
from schemas.remediation import Hold, PolicyRecord
from schemas.subjects import BUCKET_NODES, BUCKET_POLICY, EVENT_INJECT, Subjects
from tests.support.commanding import Results, send
from tests.support.fleet import Fleet, Flickering, fed, heartbeat, wait_for, wait_record


def policy(tmp_path: Path, **settings: Any) -> tuple[PolicyConfig, signing.KeyPair]:
    """A policy acting at once (no dry run) with a key of its own."""
    key = signing.create_key_file(tmp_path / "policy.nk")
    values: dict[str, Any] = {
        "key_file": str(tmp_path / "policy.nk"),
        "dry_run": False,
        "classes": ["xid"],
        "recover_after": 1.0,
        "breaker_max": 5,
        "breaker_percent": 100.0,
    }
    return PolicyConfig(**{**values, **settings}), key


async def inject(fleet: Fleet, node: str, fault: str, value: float | None = None) -> None:
    event = Inject(ts=time.time(), node_id=node, fault=fault, value=value)  # type: ignore[arg-type]
    await fleet.publish_event(EVENT_INJECT, event, node)


async def test_policy_cordons_on_xid_79_and_returns_the_node(
    fleet: Fleet, bus: NatsBus, prefix: str, tmp_path: Path
) -> None:
    """XID 79 -> cordoned by the policy (the record says by its key) -> cleared and
    healthy for recover_after -> uncordoned by the policy; a node an operator cordoned
    (with the same XID) is never touched."""
    config, key = policy(tmp_path)
    operator = signing.KeyPair.generate()
    results = await Results().start(bus, prefix)
    await fleet.start_aggregator()
    trusted = [key.public_key, operator.public_key]
    for name in ("n1", "n2"):
        agent = await fleet.start_agent(fleet.config(name, trust_operators=trusted))
        assert agent.supervisor is not None and await agent.supervisor.wait_ready(10)
    await send(bus, prefix, operator, Cordon(), node="n2", reason="operator maintenance")
    await wait_record(bus, prefix, "n2", lambda r: r.state == "cordoned")
    actor = RemediationActor(config, bus, prefix)
    await actor.open()
    await fleet.follow(actor.feed)
    for name in ("n1", "n2"):
        await inject(fleet, name, "xid", 79)

    async def cordoned_by_policy() -> NodeRecord | None:
        await actor.round()
        # As written: the state and the heartbeat of one write (a live read may show a
        # heartbeat a moment before the record its owner writes at once).
        record = await wait_record(bus, prefix, "n1", lambda r: True, stored=True)
        beat = record.heartbeat
        return record if beat and beat.schedulability_by == key.public_key else None

    record = await wait_for(cordoned_by_policy)
    assert record.state == "cordoned"
    assert record.heartbeat is not None and "policy: xid" in record.heartbeat.schedulability_reason
    for name in ("n1", "n2"):
        await inject(fleet, name, "clear")

    async def uncordoned() -> bool:
        await actor.round()
        current = await wait_record(bus, prefix, "n1", lambda r: True)
        return current.state == "active"

    await wait_for(uncordoned)
    operators = await wait_record(bus, prefix, "n2", lambda r: True)
    assert operators.state == "cordoned" and operators.heartbeat is not None
    assert operators.heartbeat.schedulability_by == operator.public_key
    stored = await kv.read(
        await bus.kv(Subjects(prefix).bucket_name(BUCKET_POLICY)), "c1", PolicyRecord
    )
    assert stored is not None and stored.holds == {} and stored.history["n1"]
    kinds = [(alert.kind, alert.node_id) for alert in results.alerts]
    assert ("remediation", "n1") in kinds and ("remediation", "n2") not in kinds


def synthetic(name: str, sick: bool) -> NodeRecord:
    checks = [HealthCheck(name="xid", status="unhealthy", reason="XID 79")] if sick else []
    health = Health(
        ts=time.time(), status="unhealthy" if sick else "healthy", score=40, checks=checks
    )
    return NodeRecord(
        node_id=name,
        cluster="c1",
        state="active",
        last_seq=1,
        last_seen=time.time(),
        heartbeat=heartbeat(name, health=health),
    )


async def put_records(
    bus: NatsBus, prefix: str, records: list[NodeRecord], *actors: RemediationActor
) -> None:
    """``records`` written to fleet_nodes, and taken in by each of ``actors``' live feed."""
    bucket = await bus.kv(Subjects(prefix).bucket_name(BUCKET_NODES))
    for record in records:
        await bucket.put(record.node_id, codec.encode(record))
    for actor in actors:
        await fed(actor.feed, records)


async def test_two_aggregators_share_one_breaker(
    fleet: Fleet, bus: NatsBus, prefix: str, tmp_path: Path
) -> None:
    """Two policy actors deciding at once on 20 nodes (cap 2): the two sick nodes are
    cordoned once each, never more; a third sick node trips the breaker: no command, one
    breaker_tripped alert listing the would-be cordon, and the record and both actors'
    metrics say so."""
    config, _ = policy(tmp_path, breaker_max=2, grace=600.0)
    sent: list[str] = []
    alerts: list[str] = []

    async def on_command(msg: Msg) -> None:
        sent.append(msg.subject)

    async def on_alert(msg: Msg) -> None:
        alerts.append(msg.subject)

    subjects = Subjects(prefix)
    await bus.subscribe(subjects.commands(), on_command)
    await bus.subscribe(subjects.alerts(), on_alert)
    await bus.flush()
    first, second = RemediationActor(config, bus, prefix), RemediationActor(config, bus, prefix)
    await fleet.follow(first.feed, second.feed)
    records = [synthetic(f"n{index}", index in (1, 2)) for index in range(20)]
    await put_records(bus, prefix, records, first, second)
    for _ in range(3):
        await first.round()
        await second.round()
    await wait_for(lambda: len(sent) >= 2)
    assert sorted(sent) == [subjects.command("c1", "n1"), subjects.command("c1", "n2")]
    await put_records(bus, prefix, [synthetic("n3", True)], first, second)
    for _ in range(3):
        await first.round()
        await second.round()
    bucket = await bus.kv(subjects.bucket_name(BUCKET_POLICY))
    stored = await kv.read(bucket, "c1", PolicyRecord)
    assert stored is not None and stored.tripped_at is not None and stored.limit == 2
    assert sorted(stored.holds) == ["n1", "n2"]
    assert stored.would == ["cordon n3 (policy: xid: XID 79)"]
    await wait_for(lambda: any(".breaker_tripped." in subject for subject in alerts))
    assert sum(".breaker_tripped." in subject for subject in alerts) == 1
    assert len(sent) == 2
    # What Prometheus sees of it (deploy/prometheus/rules.yml: FleetPolicyBreakerTripped).
    for actor in (first, second):
        value = actor.metrics.registry.get_sample_value
        assert value("fleet_policy_breaker_tripped", {"cluster": "c1"}) == 1
        assert value("fleet_policy_held_nodes", {"cluster": "c1"}) == 2
        assert value("fleet_policy_hold_limit", {"cluster": "c1"}) == 2


async def test_dry_run_changes_nothing(
    fleet: Fleet, bus: NatsBus, prefix: str, tmp_path: Path
) -> None:
    """In a dry run the policy sends no command and holds nothing; it records the would-be
    action per node (what ``policy status`` shows) and says it once in a remediation
    alert, however many rounds run, without the class word twice."""
    config, _ = policy(tmp_path, dry_run=True)
    subjects = Subjects(prefix)
    sent: list[str] = []
    alerts: list[bytes] = []

    async def on_command(msg: Msg) -> None:
        sent.append(msg.subject)

    async def on_alert(msg: Msg) -> None:
        alerts.append(msg.data)

    await bus.subscribe(subjects.commands(), on_command)
    await bus.subscribe(subjects.alerts(), on_alert)
    await bus.flush()
    actor = RemediationActor(config, bus, prefix)
    await fleet.follow(actor.feed)
    await put_records(bus, prefix, [synthetic("n1", True), synthetic("n2", False)], actor)
    for _ in range(3):
        await actor.round()
    await wait_for(lambda: alerts)
    stored = await kv.read(await actor.open(), "c1", PolicyRecord)
    assert stored is not None and stored.holds == {} and stored.history == {}
    assert stored.dry == {"n1": "cordon: policy: xid: XID 79"}
    await bus.flush()
    messages = [msgspec.json.decode(alert)["message"] for alert in alerts]
    assert messages == ["dry run, would: cordon: policy: xid: XID 79"]
    assert sent == []


async def test_breaker_trips_with_three_failing_at_once(
    fleet: Fleet, bus: NatsBus, prefix: str, tmp_path: Path
) -> None:
    """3 of 20 nodes failing at once with 10 % (2 nodes) as the cap, two policy actors
    running: no command at all, one breaker_tripped alert listing the three cordons."""
    config, _ = policy(tmp_path, breaker_percent=10.0, breaker_max=20)
    sent: list[str] = []
    alerts: list[bytes] = []

    async def on_command(msg: Msg) -> None:
        sent.append(msg.subject)

    async def on_alert(msg: Msg) -> None:
        alerts.append(msg.data)

    subjects = Subjects(prefix)
    await bus.subscribe(subjects.commands(), on_command)
    await bus.subscribe(subjects.alerts(), on_alert)
    await bus.flush()
    first, second = RemediationActor(config, bus, prefix), RemediationActor(config, bus, prefix)
    await fleet.follow(first.feed, second.feed)
    records = [synthetic(f"n{index}", index in (4, 5, 6)) for index in range(20)]
    await put_records(bus, prefix, records, first, second)
    for _ in range(2):
        await first.round()
        await second.round()
    await wait_for(lambda: alerts)
    tripped = [msgspec.json.decode(alert) for alert in alerts]
    assert [alert["kind"] for alert in tripped] == ["breaker_tripped"]
    assert tripped[0]["details"]["would"].count("cordon n") == 3
    stored = await kv.read(await first.open(), "c1", PolicyRecord)
    assert stored is not None and stored.holds == {} and stored.limit == 2
    assert sent == []


async def test_sticky_after_n_remediations(
    fleet: Fleet, bus: NatsBus, prefix: str, tmp_path: Path
) -> None:
    """A node remediated for the third time within the window is not uncordoned when it
    recovers: it stays held with needs_attention, one alert says so, and no uncordon goes
    out."""
    config, key = policy(tmp_path, max_remediations=3, recover_after=0.001)
    subjects = Subjects(prefix)
    sent: list[str] = []
    alerts: list[bytes] = []

    async def on_command(msg: Msg) -> None:
        sent.append(msg.subject)

    async def on_alert(msg: Msg) -> None:
        alerts.append(msg.data)

    await bus.subscribe(subjects.commands(), on_command)
    await bus.subscribe(subjects.alerts(), on_alert)
    await bus.flush()
    actor = RemediationActor(config, bus, prefix)
    await fleet.follow(actor.feed)
    earlier = PolicyRecord(cluster="c1", history={"n1": [time.time() - 600, time.time() - 300]})
    await (await actor.open()).put("c1", codec.encode(earlier))
    await put_records(
        bus, prefix, [synthetic(f"n{index}", index == 1) for index in range(4)], actor
    )
    await actor.round()
    await wait_for(lambda: sent)
    mine = synthetic("n1", False)
    assert mine.heartbeat is not None
    beat = msgspec.structs.replace(
        mine.heartbeat, schedulability="cordoned", schedulability_by=key.public_key
    )
    await put_records(
        bus, prefix, [msgspec.structs.replace(mine, state="cordoned", heartbeat=beat)], actor
    )
    stored: PolicyRecord | None = None

    async def held_for_attention() -> bool:
        # Rounds until the node has been healthy for recover_after (on a fast machine
        # three rounds in a row took less than its millisecond).
        nonlocal stored
        await actor.round()
        stored = await kv.read(await actor.open(), "c1", PolicyRecord)
        return stored is not None and stored.holds["n1"].needs_attention

    await wait_for(held_for_attention)
    assert stored is not None and stored.holds["n1"].needs_attention
    assert len(stored.history["n1"]) == 3
    await wait_for(lambda: any(b'"needs_attention"' in alert for alert in alerts))
    assert sent == [subjects.command("c1", "n1")]


async def test_a_round_whose_feed_loses_nodes_midway_keeps_every_hold(
    fleet: Fleet, bus: NatsBus, prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The feed turns incomplete while a round reads the policy's record (partitions let
    go mid-round): the held node, missing for that moment, keeps its hold (it was dropped
    as if forgotten, under lease churn on a loaded machine)."""
    subjects = Subjects(prefix)
    held = NodeRecord(node_id="x1", cluster="c1", state="cordoned", last_seq=1, last_seen=1.0)
    nodes = await bus.kv(subjects.bucket_name(BUCKET_NODES))
    await nodes.put("x1", codec.encode(held))
    feed = Flickering(bus, subjects)
    await fleet.follow(feed)
    await fed(feed, [held])
    config, _ = policy(tmp_path)
    actor = RemediationActor(config, bus, prefix, feed=feed)
    bucket = await actor.open()
    hold = Hold(
        reason_class="xid", reason="XID 79", action="cordon", command_id="c-1", since=time.time()
    )
    await bucket.put("c1", codec.encode(PolicyRecord(cluster="c1", holds={"x1": hold})))
    real = kv.read_with_revision

    async def losing(*args: Any) -> Any:
        found = await real(*args)
        feed.lost = True
        return found

    monkeypatch.setattr(kv, "read_with_revision", losing)
    await actor.round()
    current, _ = await real(bucket, "c1", PolicyRecord)
    assert current is not None and current.holds == {"x1": hold}
