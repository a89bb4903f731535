"""A silence of the whole heartbeat stream (no leader for a few seconds) is not a stale
storm: TTL markers that come after one are held until heartbeats flow again, and only a
node that stays silent then is stale (actors/fleet/aggregator/silence.py)."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from typing import Any

import msgspec

from actors.fleet.aggregator.actor import AggregatorActor
from actors.fleet.aggregator.silence import Held, HeldMarkers, StreamPulse, grace
from actors.fleet.live.reader import read_node
from actors.fleet.storage.records import read_record
from actors.fleet.storage.registry import approve
from actors.runtime.bus import NatsBus
from schemas import codec, signing
from schemas.messages import NodeRecord
from schemas.subjects import Subjects
from tests.fleet.test_aggregator import watch_alerts
from tests.support.fleet import Fleet, heartbeat, wait_for, wait_record


def test_the_pulse_tells_a_silent_stream_from_a_busy_one() -> None:
    """A stream that stored a heartbeat every second is not silent; one that stored none
    for half the span, in one stretch, is; the first second stored after a time is
    where it resumed."""
    pulse = StreamPulse()
    for second in range(100, 110):
        pulse.stored(second + 0.3)
    assert not pulse.silent(110.0, 5.0)
    assert pulse.resumed(109.5) is None
    for second in range(113, 115):
        pulse.stored(second + 0.1)
    assert pulse.silent(113.0, 5.0)  # 110, 111, 112: nothing stored
    assert not pulse.silent(113.0, 8.0)  # 3 s of 8 is not half
    assert pulse.resumed(110.2) == 113.0


def marker(marked_at: float, silent_since: float) -> Held:
    """A marker of a node with stale_after 5 s and 1 s beats, held after a silence."""
    return Held(marked_at, "MaxAge", 5.0, 1.0, stream_seq=9, silent_since=silent_since)


def test_held_markers_wait_for_the_stream_then_the_grace() -> None:
    """A held node is stale once the stream has stored heartbeats again for the grace
    without one of its own, or, held alone, after another stale_after of silence; a
    heartbeat of it releases it."""
    pulse, held = StreamPulse(), HeldMarkers(bound=60.0)
    held.hold("n1", marker(100.0, 96.0))
    held.hold("n2", marker(100.0, 96.0))
    assert held.due(pulse, 104.9) == []
    pulse.stored(102.5)
    held.release("n2")
    assert grace(1.0, 5.0) == 2.5
    assert held.due(pulse, 104.4) == []
    assert [node for node, _ in held.due(pulse, 104.6)] == ["n1"]
    assert held.held == {}
    held.hold("n3", marker(200.0, 196.0))
    assert [node for node, _ in held.due(pulse, 205.0)] == ["n3"]  # silent ever since


def test_many_held_markers_wait_for_the_outage_bound() -> None:
    """Two nodes held through a silence with no end yet are the bus's: stale only once
    the silence has lasted bus_outage_max, not after their stale_after; held through a
    silence longer than it, they are stale as soon as the stream resumes."""
    pulse, held = StreamPulse(), HeldMarkers(bound=30.0)
    pulse.stored(95.5)
    assert pulse.silent_since(100.0, 30.0) == 96.0
    assert pulse.silent_since(200.0, 30.0) == 170.0  # silent longer than it looks back
    held.hold("n1", marker(100.0, 96.0))
    held.hold("n2", marker(101.0, 96.0))
    assert held.due(pulse, 125.9) == []
    assert [node for node, _ in held.due(pulse, 126.0)] == ["n1", "n2"]
    held.hold("n3", marker(130.0, 96.0))
    pulse.stored(131.5)  # resumed 35 s after the silence began: longer than the bound
    assert [node for node, _ in held.due(pulse, 131.6)] == ["n3"]


def test_a_marker_is_held_on_for_the_outage_bound_after_it() -> None:
    """A marker due may be held on (the intake says its node beats, or cannot tell) for
    bus_outage_max after the marker, however little the aggregator knows of the silence:
    one just restarted has an empty pulse, so its silence began ``bound`` before the
    marker as far as it can tell (a fault round's restarted owner held nothing so)."""
    pulse, held = StreamPulse(), HeldMarkers(bound=60.0)
    fresh = marker(100.0, pulse.silent_since(100.0, 60.0))
    assert fresh.silent_since == 40.0
    assert held.may_hold(fresh, 101.0)
    assert held.may_hold(fresh, 159.9)
    assert not held.may_hold(fresh, 160.0)


STALE_AFTER = 4.0
"""The beats' stale_after. The tests that need both nodes' markers held at once need them
to come within this of each other: a marker held alone is stale one stale_after later,
and on a starved machine two markers due together have come 2 s apart."""


async def beat(
    bus: NatsBus,
    prefix: str,
    key: signing.KeyPair,
    node: str,
    seq: int,
    stale_after: float = STALE_AFTER,
    ttl: bool = True,
) -> None:
    """One signed heartbeat of ``node``, stored with its TTL (``ttl``) as an agent's is,
    or without (the server never marks it)."""
    body = codec.encode(heartbeat(node=node, seq=seq, stale_after=stale_after))
    headers = {**key.headers(body), "Nats-Msg-Id": os.urandom(8).hex()}
    if ttl:
        headers["Nats-TTL"] = f"{stale_after:g}"
    await bus.js.publish(Subjects(prefix).heartbeat("c1", node), body, headers=headers)


async def two_nodes(
    fleet: Fleet,
    bus: NatsBus,
    prefix: str,
    keeps_beating: str = "",
    without_ttl: str = "",
    **settings: Any,
) -> tuple[AggregatorActor, dict[str, signing.KeyPair]]:
    """Nodes n1 and n2 approved and beating (stale_after 4 s), and the aggregator (with
    ``settings``). Both stop after their third beat, but ``keeps_beating``, which beats on
    at its pace until the test ends (from before the records are waited for: however
    long that takes on a loaded machine, the stream is never silent and that node never
    stale). ``without_ttl``'s beats are stored without a TTL: no marker follows them."""
    keys = {node: signing.KeyPair.generate() for node in ("n1", "n2")}
    for node, key in keys.items():
        await approve(bus, Subjects(prefix), node, key.public_key)
    supervisor = await fleet.start_aggregator(sweep_interval=0.2, **settings)
    aggregator = supervisor.actors[0]
    assert isinstance(aggregator, AggregatorActor)
    for seq in range(1, 4):
        for node, key in keys.items():
            await beat(bus, prefix, key, node, seq, ttl=node != without_ttl)
        await asyncio.sleep(0.5)  # the nodes' own pace
    if keeps_beating:
        beating = asyncio.create_task(beats(bus, prefix, keys[keeps_beating], keeps_beating))
        fleet.stack.callback(beating.cancel)
    for node in keys:
        await wait_record(bus, prefix, node, beaten(3, on=node == keeps_beating))
    return aggregator, keys


def beaten(seq: int, on: bool) -> Callable[[NodeRecord], bool]:
    """An active record whose last beat is ``seq`` (or later, for a node that beats ``on``)."""

    def check(record: NodeRecord) -> bool:
        last = record.last_seq >= seq if on else record.last_seq == seq
        return record.state == "active" and last

    return check


async def beats(bus: NatsBus, prefix: str, key: signing.KeyPair, node: str) -> None:
    """``node`` beating at its pace from its fourth beat on."""
    for seq in range(4, 1000):
        await beat(bus, prefix, key, node, seq)
        await asyncio.sleep(0.5)


async def test_a_silence_of_the_whole_stream_is_not_a_stale_storm(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """Both nodes' markers fire during a silence of the stream; they are held, and
    both nodes beating again releases them: no stale alert, both records active."""
    alerts = await watch_alerts(bus, prefix)
    aggregator, keys = await two_nodes(fleet, bus, prefix)
    await wait_for(lambda: set(aggregator.ledger.held.held) == {"n1", "n2"})
    for seq in range(4, 8):
        for node, key in keys.items():
            await beat(bus, prefix, key, node, seq)
        await asyncio.sleep(0.5)
    await wait_for(lambda: not aggregator.ledger.held.held)
    for node in keys:
        record = await wait_record(bus, prefix, node, lambda r: r.last_seq >= 7)
        assert record.state == "active" and record.stale_since is None
    assert alerts.of("stale") == []
    assert alerts.of("recovered") == []


async def test_a_node_silent_after_the_stream_resumed_is_stale_once(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """After the silence only n1 beats again: n2 is stale, once, once the grace after the
    stream resumed has passed; n1 never is."""
    alerts = await watch_alerts(bus, prefix)
    aggregator, keys = await two_nodes(fleet, bus, prefix)
    await wait_for(lambda: set(aggregator.ledger.held.held) == {"n1", "n2"})

    async def n1_beats() -> None:
        for seq in range(4, 100):
            await beat(bus, prefix, keys["n1"], "n1", seq)
            await asyncio.sleep(0.5)

    beating = asyncio.create_task(n1_beats())
    try:
        await wait_record(bus, prefix, "n2", lambda r: r.state == "stale")
        await alerts.wait_count(1)
        assert [alert.node_id for alert in alerts.of("stale")] == ["n2"]
        assert (await read_record(bus, Subjects(prefix), "n1")).state == "active"
    finally:
        beating.cancel()


async def test_a_node_dying_while_others_beat_is_stale_at_once(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """n2 stops while n1 keeps beating: the stream was never silent, so n2's marker makes
    it stale at once, nothing held."""
    alerts = await watch_alerts(bus, prefix)
    aggregator, _ = await two_nodes(fleet, bus, prefix, keeps_beating="n1")
    await alerts.wait_count(1)
    assert [alert.node_id for alert in alerts.of("stale")] == ["n2"]
    assert aggregator.ledger.held.held == {}


async def test_a_node_beating_into_the_intake_is_alive_though_fleet_hb_is_behind(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """FLEET_HB_IN holding a heartbeat of the node newer than its last accepted one,
    signed by its key, says the node beats (FLEET_HB fell behind its source); the one
    accepted last, or one signed by another key, says it does not; one older than the
    last accepted says the intake lost heartbeats (a server restarted empty leads it):
    it cannot tell."""
    aggregator, keys = await two_nodes(fleet, bus, prefix)
    # The owner's record as of seq 3, whatever it accepts meanwhile.
    record = msgspec.structs.replace(aggregator.ledger.nodes["n1"].record, last_seq=3)
    key = keys["n1"].public_key
    assert await aggregator.ownership.beating_upstream(record, key) is False
    ahead = msgspec.structs.replace(record, last_seq=9)
    assert await aggregator.ownership.beating_upstream(ahead, key) is None
    await beat(bus, prefix, keys["n1"], "n1", 4)
    assert await aggregator.ownership.beating_upstream(record, key) is True
    await beat(bus, prefix, signing.KeyPair.generate(), "n1", 5)
    assert await aggregator.ownership.beating_upstream(record, key) is False


async def test_an_intake_that_cannot_tell_holds_a_marker_only_within_the_outage_bound(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """Both markers held through a silence; n1 beats again, n2 does not, and FLEET_HB_IN
    never tells (no leader, or one that lost heartbeats): n2's marker is held on for
    bus_outage_max after it, then n2 is stale: an intake that never answers does not
    keep a dead node alive."""
    aggregator, keys = await two_nodes(fleet, bus, prefix, bus_outage_max=8.0)
    await wait_for(lambda: set(aggregator.ledger.held.held) == {"n1", "n2"})
    marked_at = aggregator.ledger.held.held["n2"].marked_at
    asked: list[float] = []

    async def cannot_tell(record: NodeRecord, key: str) -> bool | None:
        asked.append(time.time())
        return None

    aggregator.ownership.beating_upstream = cannot_tell  # type: ignore[method-assign]
    beating = asyncio.create_task(beats(bus, prefix, keys["n1"], "n1"))
    try:
        record = await wait_record(bus, prefix, "n2", lambda r: r.state == "stale")
    finally:
        beating.cancel()
    assert asked, "the marker was never held on the intake's answer"
    assert record.stale_since is not None
    assert record.stale_since >= marked_at + 8.0, (record.stale_since, marked_at)
    assert (await read_record(bus, Subjects(prefix), "n1")).state == "active"


async def test_a_replay_refused_before_a_silence_does_not_make_its_node_stale(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """An old heartbeat of n1 (seq 2) stored after its newer ones is refused as a replay
    just before the whole stream goes silent (seed 11's frozen server): the refused sweep
    waits for the stream as a held marker does, so n1, beating again after the silence,
    is never stale, and the live read shows its newest heartbeat, not the refused one."""
    alerts = await watch_alerts(bus, prefix)
    key = signing.KeyPair.generate()
    await approve(bus, Subjects(prefix), "n1", key.public_key)
    supervisor = await fleet.start_aggregator(sweep_interval=0.2)
    aggregator = supervisor.actors[0]
    assert isinstance(aggregator, AggregatorActor)
    sweeps, swept = aggregator.sweeps, []
    sweep_refused = sweeps.sweep_refused

    async def counted() -> None:
        await sweep_refused()
        swept.append(time.time())

    sweeps.sweep_refused = counted  # type: ignore[method-assign]
    for seq in (1, 2, 3):
        await beat(bus, prefix, key, "n1", seq, stale_after=4.0)
    await wait_record(bus, prefix, "n1", lambda r: r.state == "active" and r.last_seq == 3)
    await beat(bus, prefix, key, "n1", 2, stale_after=4.0)  # the replay
    await wait_for(lambda: alerts.of("replay"))
    n1 = aggregator.ledger.nodes["n1"].record
    assert n1.last_seq == 3 and n1.heartbeat is not None
    assert "n1" in aggregator.ledger.refusals.refused
    silent_at = n1.last_seen + n1.heartbeat.stale_after
    await wait_for(lambda: any(at > silent_at + 0.5 for at in swept))
    assert aggregator.ledger.nodes["n1"].record.stale_since is None
    for seq in range(4, 7):
        await beat(bus, prefix, key, "n1", seq, stale_after=4.0)
    record = await wait_record(bus, prefix, "n1", lambda r: r.last_seq == 6)
    assert record.state == "active" and record.stale_since is None
    assert alerts.of("stale") == []
    live = await read_node(bus, Subjects(prefix), "n1")
    assert live.live and live.last_seq == 6, live.live_note


async def test_a_node_refused_for_a_replay_but_beating_upstream_is_not_stale(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """A node refused for a replay whose newer heartbeat (signed by its key) FLEET_HB_IN
    holds beats on, its owner's consumer behind: the refused sweep leaves it; with nothing
    newer upstream (replays of a dead node), or refused for another reason (its key
    revoked: its newer beats are refused too), it is stale."""
    aggregator, keys = await two_nodes(fleet, bus, prefix)
    ledger = aggregator.ledger

    async def n2_beats() -> None:  # the stream is not silent: no bus's silence to wait out
        for seq in range(4, 100):
            await beat(bus, prefix, keys["n2"], "n2", seq)
            await asyncio.sleep(0.5)

    beating = asyncio.create_task(n2_beats())
    try:
        await beat(bus, prefix, keys["n1"], "n1", 4)
        await wait_for(lambda: ledger.nodes["n1"].record.last_seq == 4)
        await wait_for(lambda: not ledger.pulse.silent(time.time(), STALE_AFTER))
        # The owner's record as if seq 4 were still on its way, and a replay refused since.
        behind = msgspec.structs.replace(
            ledger.nodes["n1"].record, last_seq=3, last_seen=time.time() - 10, refused="replay"
        )
        ledger.nodes["n1"].record = behind
        ledger.refusals.on_refused("n1")
        await aggregator.sweeps.sweep_refused()
        assert ledger.nodes["n1"].record.stale_since is None
        assert "n1" in ledger.refusals.refused
        for refused in (
            msgspec.structs.replace(behind, last_seq=4),  # a replay, nothing newer upstream
            msgspec.structs.replace(behind, refused="revoked"),
        ):
            ledger.nodes["n1"].record = refused
            ledger.refusals.on_refused("n1")
            await aggregator.sweeps.sweep_refused()
            assert ledger.nodes["n1"].record.stale_since is not None
    finally:
        beating.cancel()
