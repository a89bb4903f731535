"""The aggregator refuses what must be refused, and JetStream tells it when a node dies."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

from nats.aio.msg import Msg

from actors.fleet.config import AggregatorConfig
from actors.fleet.storage.records import read_record, read_records
from actors.fleet.storage.registry import approve, revoke
from actors.runtime.bus import NatsBus
from schemas import codec, signing
from schemas.messages import Alert
from schemas.subjects import Subjects
from tests.support.fleet import Fleet, heartbeat, wait_for, wait_record


class AlertLog:
    """Collects every alert published under a prefix."""

    def __init__(self) -> None:
        self.alerts: list[Alert] = []

    async def on_alert(self, msg: Msg) -> None:
        self.alerts.append(codec.decode(msg.data, Alert, msg.subject))

    async def wait_count(self, count: int) -> None:
        await wait_for(lambda: len(self.alerts) >= count)

    def of(self, kind: str) -> list[Alert]:
        return [alert for alert in self.alerts if alert.kind == kind]


async def watch_alerts(bus: NatsBus, prefix: str) -> AlertLog:
    log = AlertLog()
    await bus.subscribe(Subjects(prefix).alerts(), log.on_alert)
    await bus.flush()
    return log


async def publish(
    bus: NatsBus,
    prefix: str,
    body: bytes,
    headers: dict[str, str],
    node: str = "n1",
    msg_id: str | None = None,
    ttl: int = 2,
) -> None:
    """Publish a heartbeat's ``body`` as node ``node`` would, with its ``Nats-TTL``
    (``ttl`` seconds: an agent sends its ``stale_after``, the test heartbeat's 2 s)."""
    headers = {**headers, "Nats-Msg-Id": msg_id or os.urandom(8).hex(), "Nats-TTL": str(ttl)}
    await bus.js.publish(Subjects(prefix).heartbeat("c1", node), body, headers=headers)


async def test_replayed_and_forged_heartbeats_change_nothing(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """Same body with a fresh Nats-Msg-Id -> replay; tampered body or foreign key ->
    bad_signature / unknown_node; the record keeps the last accepted seq."""
    alerts = await watch_alerts(bus, prefix)
    key, intruder = signing.KeyPair.generate(), signing.KeyPair.generate()
    await approve(bus, Subjects(prefix), "n1", key.public_key)
    # A window this short rate-limits nothing: every refusal below is its own alert.
    await fleet.start_aggregator(alert_window=0.001, alert_repeat=0.001)
    body = codec.encode(heartbeat(seq=5))
    await publish(bus, prefix, body, key.headers(body))
    await wait_record(bus, prefix, "n1", lambda r: r.last_seq == 5)

    # FLEET_HB keeps one message per node, so each refusal is awaited before the next.
    tampered = body.replace(b'"seq":5', b'"seq":9')
    forged = codec.encode(heartbeat(seq=10))
    attempts = [
        (body, key.headers(body)),  # replay: same body, fresh msg id
        (tampered, key.headers(body)),  # signature over other bytes
        (forged, intruder.headers(forged)),  # someone else's key
        (forged, {}),  # unsigned
    ]
    for count, (payload, headers) in enumerate(attempts, start=1):
        await publish(bus, prefix, payload, headers)
        await alerts.wait_count(count)
    assert len(alerts.of("replay")) == 1
    assert len(alerts.of("bad_signature")) == 2
    assert len(alerts.of("unknown_node")) == 1
    current = await read_record(bus, Subjects(prefix), "n1")
    assert current.last_seq == 5 and current.state == "active"


async def test_duplicate_msg_id_is_dropped_by_jetstream(bus: NatsBus, prefix: str) -> None:
    """A replay inside the duplicate window with the same Nats-Msg-Id never reaches the
    aggregator: the server acknowledges it as a duplicate."""
    key = signing.KeyPair.generate()
    body = codec.encode(heartbeat(seq=1))
    headers = {**key.headers(body), "Nats-Msg-Id": "n1:b1:1"}
    subject = Subjects(prefix).heartbeat("c1", "n1")
    first = await bus.js.publish(subject, body, headers=headers)
    second = await bus.js.publish(subject, body, headers=headers)
    assert not first.duplicate and second.duplicate


async def test_unapproved_node_and_wrong_subject_are_refused(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """A node nobody approved is unknown_node; a body naming another node than its
    subject is refused even with a valid signature; neither creates a record."""
    alerts = await watch_alerts(bus, prefix)
    key = signing.KeyPair.generate()
    await approve(bus, Subjects(prefix), "n2", key.public_key)
    await fleet.start_aggregator()
    body = codec.encode(heartbeat(node="n9"))
    moved = codec.encode(heartbeat(node="n1"))
    skewed = codec.encode(heartbeat(node="n2", ts=time.time() - 3600))
    attempts = [
        (body, key.headers(body), "n9"),
        (moved, key.headers(moved), "n2"),
        (skewed, key.headers(skewed), "n2"),
    ]
    for count, (payload, headers, node) in enumerate(attempts, start=1):
        await publish(bus, prefix, payload, headers, node=node)
        await alerts.wait_count(count)
    assert [a.node_id for a in alerts.of("unknown_node")] == ["n9"]
    assert "another node" in alerts.of("bad_signature")[0].message
    assert len(alerts.of("clock_skew")) == 1
    assert await read_records(bus, Subjects(prefix)) == []


async def test_restart_with_same_state_dir_is_accepted_at_once(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """Sequence numbers survive a restart, so the restarted node is not a replay."""
    alerts = await watch_alerts(bus, prefix)
    await fleet.start_aggregator()
    agent = await fleet.start_agent()
    first = await wait_record(bus, prefix, "n1", lambda r: r.last_seq >= 2)
    await agent.stop()
    agent = await fleet.start_agent()
    second = await wait_record(bus, prefix, "n1", lambda r: r.boot_id != first.boot_id)
    await agent.stop()
    assert second.last_seq > first.last_seq and second.state == "active"
    assert not alerts.of("replay")


def start_agent_process(fleet: Fleet) -> subprocess.Popen[bytes]:
    """``node-agent start`` as a child process, killed (if still alive) when the test ends."""
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "actors.cli.node_agent",
            "start",
            "--server",
            fleet.url,
            "--prefix",
            fleet.prefix,
            "--node-id",
            "n1",
            "--cluster",
            "c1",
            "--state-dir",
            str(fleet.state_dir),
            "--heartbeat-interval",
            "0.5",
            "--stale-after",
            "2",
            "--fake-gpus",
            "1",
            "--http-port",
            "0",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    fleet.stack.callback(process.wait)
    fleet.stack.callback(process.kill)
    return process


async def test_sigkilled_agent_yields_one_stale_alert_from_the_marker(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """SIGKILL an agent: the server's TTL delete marker becomes exactly one stale alert
    within stale_after + 2 s of the last heartbeat; the next beat raises recovered."""
    alerts = await watch_alerts(bus, prefix)
    key = signing.load_or_create_key_file(fleet.state_dir / "node.nk")
    await approve(bus, Subjects(prefix), "n1", key.public_key)
    # The default lease: the suite's 1.5 s was fenced by a loop stall on a loaded machine,
    # and the partition taken again after the last heartbeat's marker had replaced it.
    await fleet.start_aggregator(lease_ttl=AggregatorConfig().lease_ttl)
    process = start_agent_process(fleet)
    before = await wait_record(bus, prefix, "n1", lambda r: r.last_seq >= 2)
    process.send_signal(signal.SIGKILL)
    process.wait()
    killed_at = time.time()
    await wait_for(lambda: alerts.of("stale"))
    # The alert is published before the record is written (a crash between the two
    # raises it again, never loses it): the record follows within a write's time.
    last = await wait_record(bus, prefix, "n1", lambda r: r.stale_since is not None)
    assert last.state == "stale" and last.stale_since is not None
    # stale_after + 2 s, and a margin for a loaded machine (as in test_under_attack).
    silent = last.stale_since - last.last_seen
    assert silent <= 2.0 + 2.0 + 5.0, f"found stale {silent:.1f}s after its last heartbeat"
    took = time.time() - killed_at
    assert took <= 2.0 + 2.0 + 1.0 + 5.0, f"the record said stale {took:.1f}s after the kill"
    stale = alerts.of("stale")[0]
    assert "MaxAge" in stale.message and stale.details["last_seq"] == str(last.last_seq)
    # When the server stored its marker: after the last heartbeat, before the alert.
    assert last.last_seen < float(stale.details["marked_at"]) <= stale.ts + 0.01
    assert last.last_seq >= before.last_seq
    assert len(alerts.of("stale")) == 1

    start_agent_process(fleet)
    await wait_for(lambda: alerts.of("recovered"))
    # One stale alert all the while the node was down (the restart takes seconds).
    assert len(alerts.of("stale")) == 1
    # As with stale: the alert goes out first, the record follows within a write's time.
    back = await wait_record(bus, prefix, "n1", lambda r: r.state == "active")
    assert back.stale_since is None


async def test_sigtermed_agent_is_stopped_not_stale(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """SIGTERM an agent: its signed goodbye makes the node `stopped` with one `info`
    alert; when that heartbeat's TTL runs out the server's marker is taken and changes
    nothing (no stale, no offline); started again, the node is `recovered` and active."""
    alerts = await watch_alerts(bus, prefix)
    key = signing.load_or_create_key_file(fleet.state_dir / "node.nk")
    await approve(bus, Subjects(prefix), "n1", key.public_key)
    supervisor = await fleet.start_aggregator(offline_after=1.0, sweep_interval=0.2)
    metrics = supervisor.actors[0].metrics  # type: ignore[attr-defined]
    process = start_agent_process(fleet)
    await wait_record(bus, prefix, "n1", lambda r: r.last_seq >= 2)
    process.send_signal(signal.SIGTERM)
    # Waited for off the event loop: the aggregator under test shares it, and a blocking
    # wait through the agent's drain outlasts its 1.5 s leases.
    assert await asyncio.to_thread(process.wait, 20) == 0
    stopped = await wait_record(bus, prefix, "n1", lambda r: r.state == "stopped", 10.0)
    assert stopped.stopped_since is not None and stopped.heartbeat is not None
    assert stopped.heartbeat.stopping
    (alert,) = await wait_for(lambda: alerts.of("stopped"))
    assert alert.severity == "info" and "stopped on request" in alert.message
    # The goodbye's TTL (2 s) runs out; the marker is counted as the server's.
    await wait_for(lambda: metrics.registry.get_sample_value("fleet_ttl_markers_total"))
    await asyncio.sleep(1.5)  # past offline_after and several sweeps
    record = await read_record(bus, Subjects(prefix), "n1")
    assert (record.state, record.stale_since, record.offline_since) == ("stopped", None, None)
    assert not alerts.of("stale") and not alerts.of("offline")

    start_agent_process(fleet)
    (recovered,) = await wait_for(lambda: alerts.of("recovered"))
    assert recovered.message == "heartbeats resumed after stopped"
    back = await wait_record(bus, prefix, "n1", lambda r: r.state == "active", 5.0)
    assert back.stopped_since is None and len(alerts.of("stopped")) == 1


async def test_revoked_node_is_refused(fleet: Fleet, bus: NatsBus, prefix: str) -> None:
    """fleetctl revoke takes effect on the node's next heartbeats (the aggregator's trust
    watch delivers it), refused as `revoked` (issue 33), and the record stops advancing."""
    alerts = await watch_alerts(bus, prefix)
    # No rate limit: each refused heartbeat is an alert, so three alerts are three beats.
    await fleet.start_aggregator(alert_window=0.001, alert_repeat=0.001)
    await fleet.start_agent()
    await wait_record(bus, prefix, "n1", lambda r: r.state == "active")
    await revoke(bus, Subjects(prefix), "n1")
    await wait_for(lambda: alerts.of("revoked"))
    frozen = (await read_record(bus, Subjects(prefix), "n1")).last_seq
    await wait_for(lambda: len(alerts.of("revoked")) >= 3)
    assert (await read_record(bus, Subjects(prefix), "n1")).last_seq == frozen
