"""TTL markers: only one consistent with the record (no heartbeat for ``stale_after``) is
the server's; a client's forgery on a live node is counted and changes nothing."""

from __future__ import annotations

import asyncio
import os
from functools import partial

from nats.aio.msg import Msg
from nats.js import JetStreamContext

from actors.fleet.metrics import AggregatorMetrics
from actors.fleet.registry import approve, read_record
from actors.runtime.bus import NatsBus
from schemas import codec, signing
from schemas.messages import Alert
from schemas.subjects import STREAM_HEARTBEATS, Subjects
from tests.security.attack import attacker, counted
from tests.support.fleet import Fleet, heartbeat, new_aggregator, wait_for, wait_record


def forged_counted(metrics: AggregatorMetrics, count: int) -> bool:
    return counted(metrics.registry, "fleet_messages_dropped", reason="forged_marker") == count


async def test_forged_marker_is_ignored_and_a_real_one_is_not(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    subjects = Subjects(prefix)
    alerts: list[Alert] = []

    async def on_alert(msg: Msg) -> None:
        alerts.append(codec.decode(msg.data, Alert, msg.subject))

    await bus.subscribe(subjects.alerts(), on_alert)
    key = signing.KeyPair.generate()
    await approve(bus, subjects, "n1", key.public_key)
    metrics = AggregatorMetrics()
    await fleet.start_supervisor(new_aggregator(bus, prefix, metrics))
    subject = subjects.heartbeat("c1", "n1")
    async with attacker(fleet.url) as nc:
        js = nc.jetstream()
        body = codec.encode(heartbeat(seq=1))  # stale_after 2 s
        headers = {**key.headers(body), "Nats-Msg-Id": os.urandom(8).hex(), "Nats-TTL": "2"}
        await js.publish(subject, body, headers=headers)
        await wait_record(bus, prefix, "n1", lambda record: record.state == "active")
        for count, forged in enumerate((b"", b"x"), start=1):  # bare, and with a body
            await js.publish(subject, forged, headers={"Nats-Marker-Reason": "MaxAge"})
            # One message per subject: each is read before the next replaces it.
            await wait_for(partial(forged_counted, metrics, count))
        await asyncio.sleep(0.3)
        assert not [alert for alert in alerts if alert.kind == "stale"]
        assert (await read_record(bus, subjects, "n1")).state == "active"

        # The node's last heartbeat now expires for real: the server's marker is honoured.
        body = codec.encode(heartbeat(seq=2))
        headers = {**key.headers(body), "Nats-Msg-Id": os.urandom(8).hex(), "Nats-TTL": "2"}
        await js.publish(subject, body, headers=headers)
        await wait_for(lambda: [alert for alert in alerts if alert.kind == "stale"], timeout=10)
    assert (await read_record(bus, subjects, "n1")).state == "stale"
    assert counted(metrics.registry, "fleet_messages_dropped", reason="forged_marker") == 2


async def test_a_rollup_purging_every_marker_does_not_hide_a_dead_node(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """With n1's stolen key, a heartbeat carrying ``Nats-Rollup: all`` purges FLEET_HB,
    the pending TTL marker of n2 (which just died) with it: the server cannot refuse
    rollups on a stream with delete markers. The rollup is refused and alerted on, and
    the full sweep still finds n2 silent and marks it stale."""
    subjects = Subjects(prefix)
    alerts: list[Alert] = []

    async def on_alert(msg: Msg) -> None:
        alerts.append(codec.decode(msg.data, Alert, msg.subject))

    await bus.subscribe(subjects.alerts(), on_alert)
    keys = {node: signing.KeyPair.generate() for node in ("n1", "n2")}
    for node, key in keys.items():
        await approve(bus, subjects, node, key.public_key)
    metrics = AggregatorMetrics()
    aggregator = new_aggregator(bus, prefix, metrics, sweep_interval=0.2, full_sweep_interval=0.5)
    await fleet.start_supervisor(aggregator)

    async def beat(nc_js: JetStreamContext, node: str, seq: int, **headers: str) -> None:
        body = codec.encode(heartbeat(node, seq=seq, stale_after=2.0))
        signed = {**keys[node].headers(body), "Nats-Msg-Id": os.urandom(8).hex(), **headers}
        await nc_js.publish(subjects.heartbeat("c1", node), body, headers=signed)

    async with attacker(fleet.url) as nc:
        js = nc.jetstream()
        await beat(js, "n2", 1, **{"Nats-TTL": "2"})  # n2's last words
        await wait_record(bus, prefix, "n2", lambda record: record.state == "active")
        await beat(js, "n1", 1, **{"Nats-Rollup": "all"})
        info = await js.stream_info(subjects.stream_name(STREAM_HEARTBEATS))
        assert info.state.messages == 1  # n2's heartbeat is gone, and its marker with it
    await wait_for(
        lambda: counted(metrics.registry, "fleet_heartbeats_refused", kind="bad_signature")
    )
    record = await wait_record(
        bus, prefix, "n2", lambda record: record.state == "stale", timeout=15
    )
    assert record.state == "stale"
    stale = [alert for alert in alerts if alert.kind == "stale" and alert.node_id == "n2"]
    assert stale and "no server marker" in stale[0].message
