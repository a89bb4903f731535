"""Issue 30, item 4 (b) and 8: what a node claims about its own liveness (``stale_after``,
``Nats-TTL``) cannot exempt it from failure detection, and an old heartbeat sent again is
a ``replay``, not a clock problem. Plain nats-py clients publish with the node's key."""

from __future__ import annotations

import itertools
import os
import time
from functools import partial

from nats.aio.msg import Msg
from nats.js import JetStreamContext

from actors.fleet.aggregator.nats_ttl import ttl_within
from actors.fleet.metrics import AggregatorMetrics
from actors.fleet.storage.records import read_record
from actors.fleet.storage.registry import approve
from actors.runtime.bus import NatsBus
from schemas import codec, signing
from schemas.base import MAX_STALE_AFTER
from schemas.messages import Alert, NodeRecord
from schemas.subjects import Subjects
from tests.security.attack import attacker, count_is, counted, restarts
from tests.support.fleet import Fleet, heartbeat, new_aggregator, wait_for, wait_record

BOUND = 1.0
"""The aggregator's ``max_stale_after`` in these tests."""
GRACE = 0.5
"""Its ``full_sweep_interval``."""
SKEW = 30.0
"""The aggregator's ``max_skew`` in the replay test."""
LATE = 5.0
"""Seconds a full sweep may come late on a busy machine (4.7 s after the silence, not
the bound's 3.5, in a fresh-clone CI beside a nats-server at a whole core): far below
the day a node may claim, which is what the bound test tells apart."""


async def publish(
    js: JetStreamContext, prefix: str, key: signing.KeyPair, body: bytes, **headers: str
) -> None:
    signed = {**key.headers(body), "Nats-Msg-Id": os.urandom(8).hex(), **headers}
    await js.publish(Subjects(prefix).heartbeat("c1", "n1"), body, headers=signed)


async def scene(fleet: Fleet, bus: NatsBus, prefix: str) -> tuple[signing.KeyPair, list[Alert]]:
    """n1 approved, its key returned; an aggregator with a 1 s ``max_stale_after``
    and a full sweep every 0.5 s; the alerts raised."""
    alerts: list[Alert] = []

    async def on_alert(msg: Msg) -> None:
        alerts.append(codec.decode(msg.data, Alert, msg.subject))

    await bus.subscribe(Subjects(prefix).alerts(), on_alert)
    key = signing.KeyPair.generate()
    await approve(bus, Subjects(prefix), "n1", key.public_key)
    return key, alerts


async def test_a_silent_node_claiming_a_day_is_stale_within_the_aggregators_bound(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """n1 claims ``stale_after`` of a day (the schema's most) and its heartbeat carries no
    Nats-TTL (the stream keeps it: no marker ever comes), then goes silent as if
    SIGKILLed: the full sweep marks it stale within twice the aggregator's
    ``max_stale_after`` plus the sweep, not a day."""
    key, alerts = await scene(fleet, bus, prefix)
    supervisor = await fleet.start_supervisor(
        new_aggregator(
            bus,
            prefix,
            max_stale_after=BOUND,
            sweep_interval=0.2,
            full_sweep_interval=GRACE,
        )
    )
    async with attacker(fleet.url) as nc:
        body = codec.encode(heartbeat(seq=1, stale_after=MAX_STALE_AFTER))
        await publish(nc.jetstream(), prefix, key, body)
        active = await wait_record(bus, prefix, "n1", lambda r: r.state == "active")
    stale = await wait_record(bus, prefix, "n1", lambda r: r.state == "stale")
    assert stale.stale_since is not None
    # Detected once silent for 2 x 1 s + 0.5 s, at the next full sweep (0.5 s + a sweep):
    # never before (a live node called stale), and not a sweep much later.
    silent = stale.stale_since - active.last_seen
    assert 2 * BOUND + GRACE < silent < 2 * BOUND + 3 * GRACE + LATE
    assert [alert.kind for alert in alerts if alert.node_id == "n1"] == ["stale"]
    assert restarts(supervisor) == {"aggregator": 0}


async def test_nats_ttl_never_and_a_huge_stale_after_are_refused(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """Issue 30's heartbeat (``stale_after`` 1e308, ``Nats-TTL: never``) and each half of
    it are refused (the record keeps its last accepted heartbeat); a node whose every
    heartbeat since is refused so is marked stale once the last accepted one is older than
    the lesser of its ``stale_after`` and the aggregator's bound."""
    key, alerts = await scene(fleet, bus, prefix)
    metrics = AggregatorMetrics()
    await fleet.start_supervisor(
        new_aggregator(bus, prefix, metrics, max_stale_after=BOUND, sweep_interval=0.2)
    )
    async with attacker(fleet.url) as nc:
        js = nc.jetstream()
        await publish(js, prefix, key, codec.encode(heartbeat(seq=1, stale_after=60.0)))
        await wait_record(bus, prefix, "n1", lambda r: r.state == "active")
        huge = codec.encode(heartbeat(seq=2, stale_after=60.0)).replace(b"60.0", b"1e308")
        assert b"1e308" in huge
        for seq, body, ttl in (
            (2, huge, "never"),
            (3, codec.encode(heartbeat(seq=3, stale_after=60.0)), "never"),
            (4, codec.encode(heartbeat(seq=4, stale_after=60.0)), "25h"),
            (5, huge.replace(b'"seq":2', b'"seq":5'), "30"),
        ):
            await publish(js, prefix, key, body, **{"Nats-TTL": ttl})
            await wait_for(
                partial(
                    count_is,
                    metrics.registry,
                    "fleet_heartbeats_refused",
                    seq - 1,
                    kind="bad_signature",
                )
            )
        # The node goes on beating, every beat refused, until it is stale. Had it fallen
        # silent, its silence would be the whole stream's (it is the fleet's only node),
        # which may be the bus's own and makes no refused node stale: on a loaded
        # machine the four beats above could all come before its bound had passed.
        later = itertools.count(6)

        async def stale_while_refused() -> NodeRecord | None:
            body = huge.replace(b'"seq":2', b'"seq":%d' % next(later))
            await publish(js, prefix, key, body, **{"Nats-TTL": "30"})
            record = await read_record(bus, Subjects(prefix), "n1")
            return record if record.state == "stale" else None

        record = await wait_for(stale_while_refused, interval=0.2)
    assert record.last_seq == 1 and record.heartbeat is not None
    assert record.heartbeat.stale_after == 60.0
    assert "stale" in [alert.kind for alert in alerts if alert.node_id == "n1"]


def test_nats_ttl_values_as_nats_server_reads_them() -> None:
    """Whole seconds and Go durations within the bound pass; ``never``, longer ones and
    what the server would not read as a duration do not; no header passes."""
    for value in ("30", "86400", "30s", "1m30s", "1.5h", "500ms", None):
        assert ttl_within(value, MAX_STALE_AFTER), value
    for value in ("never", "86401", "25h", "1m30x", "", "-1", "1e9", "24h1s"):
        assert not ttl_within(value, MAX_STALE_AFTER), value


async def test_a_late_replay_is_refused_as_replay_not_clock_skew(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """A node's captured heartbeat sent again after the skew bound has passed is refused
    as ``replay`` (its seq is not above the last accepted), not ``clock_skew``; a newer
    seq with a bad clock is still ``clock_skew``."""
    key, _ = await scene(fleet, bus, prefix)
    metrics = AggregatorMetrics()
    # 30 s: a busy machine may take seconds from the publish to the judging of seq 2,
    # which must be in time; the captured beats are four times further off.
    await fleet.start_supervisor(new_aggregator(bus, prefix, metrics, max_skew=SKEW))
    captured = codec.encode(heartbeat(seq=1, ts=time.time() - 4 * SKEW))
    async with attacker(fleet.url) as nc:
        js = nc.jetstream()
        await publish(js, prefix, key, codec.encode(heartbeat(seq=2)))
        await wait_record(bus, prefix, "n1", lambda r: r.last_seq == 2)
        await publish(js, prefix, key, captured)
        await wait_for(
            lambda: counted(metrics.registry, "fleet_heartbeats_refused", kind="replay") == 1
        )
        await publish(js, prefix, key, codec.encode(heartbeat(seq=3, ts=time.time() - 4 * SKEW)))
        await wait_for(
            lambda: counted(metrics.registry, "fleet_heartbeats_refused", kind="clock_skew") == 1
        )
    assert counted(metrics.registry, "fleet_heartbeats_refused", kind="replay") == 1
