"""TTL markers: only one consistent with the record (no heartbeat for ``stale_after``) is
the server's; a client's forgery on a live node is counted and changes nothing."""

from __future__ import annotations

import os
from functools import partial

import nats.js.errors
import pytest
from nats.aio.msg import Msg

from actors.fleet.metrics import AggregatorMetrics
from actors.fleet.storage.records import read_record
from actors.fleet.storage.registry import approve
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
        # Counted as forged: judged, and so not taken as the server's (the two exclude
        # each other), so no stale alert can follow from them.
        assert not [alert for alert in alerts if alert.kind == "stale"]
        assert (await read_record(bus, subjects, "n1")).state == "active"

        # The node's last heartbeat now expires for real: the server's marker is honoured.
        body = codec.encode(heartbeat(seq=2))
        headers = {**key.headers(body), "Nats-Msg-Id": os.urandom(8).hex(), "Nats-TTL": "2"}
        await js.publish(subject, body, headers=headers)
        await wait_for(lambda: [alert for alert in alerts if alert.kind == "stale"])
    # The alert is raised first, then the record written: waited for, not read at once.
    await wait_record(bus, prefix, "n1", lambda record: record.state == "stale", stored=True)
    assert counted(metrics.registry, "fleet_messages_dropped", reason="forged_marker") == 2


async def test_a_rollup_header_is_refused_by_the_server_and_purges_nothing(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """Issue 30: with n1's stolen key, a heartbeat carrying ``Nats-Rollup: all`` (or
    ``sub``) once purged every node's heartbeat and pending TTL marker from FLEET_HB. Now
    the server refuses it to the publisher (FLEET_HB_IN takes no rollups, FLEET_HB has no
    subject to publish to): n2's heartbeat stays stored, and when n2 dies the server's own
    marker makes it stale."""
    subjects = Subjects(prefix)
    alerts: list[Alert] = []

    async def on_alert(msg: Msg) -> None:
        alerts.append(codec.decode(msg.data, Alert, msg.subject))

    await bus.subscribe(subjects.alerts(), on_alert)
    keys = {node: signing.KeyPair.generate() for node in ("n1", "n2")}
    for node, key in keys.items():
        await approve(bus, subjects, node, key.public_key)
    metrics = AggregatorMetrics()
    await fleet.start_supervisor(new_aggregator(bus, prefix, metrics))
    stream = subjects.stream_name(STREAM_HEARTBEATS)

    def body(node: str, seq: int) -> bytes:
        return codec.encode(heartbeat(node, seq=seq, stale_after=3.0))

    def signed(node: str, data: bytes, **headers: str) -> dict[str, str]:
        return {**keys[node].headers(data), "Nats-Msg-Id": os.urandom(8).hex(), **headers}

    async with attacker(fleet.url) as nc:
        js = nc.jetstream()
        n2 = body("n2", 1)
        await js.publish(subjects.heartbeat("c1", "n2"), n2, headers=signed("n2", n2, **TTL3))
        await wait_record(bus, prefix, "n2", lambda record: record.state == "active")
        for seq, rollup in ((1, "all"), (2, "sub")):
            n1 = body("n1", seq)
            with pytest.raises(nats.js.errors.APIError, match="rollup not permitted"):
                await js.publish(
                    subjects.heartbeat("c1", "n1"),
                    n1,
                    headers=signed("n1", n1, **{"Nats-Rollup": rollup}),
                )
        info = await js.stream_info(stream)
        assert info.state.messages == 1  # n2's heartbeat, not purged
        stored = await js.get_last_msg(stream, subjects.stored_heartbeat("c1", "n2", 8))
        assert stored.data == n2
    # n2 is now silent: the server's marker (not the full sweep) says so.
    record = await wait_record(bus, prefix, "n2", lambda record: record.state == "stale")
    assert record.state == "stale"
    stale = [alert for alert in alerts if alert.kind == "stale" and alert.node_id == "n2"]
    assert stale and "server marker: MaxAge" in stale[0].message
    assert counted(metrics.registry, "fleet_ttl_markers") == 1


TTL3 = {"Nats-TTL": "3"}
