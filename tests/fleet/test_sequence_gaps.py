"""``sequence_gap`` says something about the node, never about its aggregator: a gap in
what the node published is alerted while its owner keeps up with the stream; a beat that
FLEET_HB replaced (it keeps one per node) before a lagging owner read it is not a gap.
Both against a real server, the beats published by a plain nats-py client."""

from __future__ import annotations

import asyncio
import time

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from actors.fleet.storage.registry import approve
from actors.runtime.batch_pull import Chain
from actors.runtime.bus import NatsBus
from actors.runtime.supervisor import Supervisor
from schemas import codec, signing
from schemas.subjects import Subjects
from tests.fleet.test_aggregator import watch_alerts
from tests.security.attack import attacker
from tests.support.fleet import Fleet, heartbeat, new_aggregator, supervised, wait_record

INTERVAL = 1.0


async def beat(
    nc: Client, prefix: str, key: signing.KeyPair, seq: int, previous_ts: float | None = None
) -> float:
    """Publish beat ``seq`` as the node would; its ts."""
    sent = heartbeat(seq=seq, interval=INTERVAL, stale_after=3 * INTERVAL, previous_ts=previous_ts)
    body = codec.encode(sent)
    js: JetStreamContext = nc.jetstream()
    headers = {**key.headers(body), "Nats-TTL": "3"}
    await js.publish(Subjects(prefix).heartbeat("c1", "n1"), body, headers=headers)
    return sent.ts


async def approved(bus: NatsBus, prefix: str) -> signing.KeyPair:
    key = signing.KeyPair.generate()
    await approve(bus, Subjects(prefix), "n1", key.public_key)
    return key


async def test_a_gap_in_what_the_node_sent_is_alerted(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """Beats 1 and 2, then 5 an interval later: the owner read the partition to its end
    in between, so beats 3 and 4 were never stored: one alert, from 2 to 5."""
    alerts = await watch_alerts(bus, prefix)
    key = await approved(bus, prefix)
    await fleet.start_aggregator()
    async with attacker(fleet.url) as nc:
        await beat(nc, prefix, key, 1)
        await wait_record(bus, prefix, "n1", lambda r: r.last_seq == 1)
        await beat(nc, prefix, key, 2)
        await wait_record(bus, prefix, "n1", lambda r: r.last_seq == 2)
        await asyncio.sleep(INTERVAL)
        await beat(nc, prefix, key, 5)
        await wait_record(bus, prefix, "n1", lambda r: r.last_seq == 5)
    await bus.flush()
    (gap,) = alerts.of("sequence_gap")
    assert (gap.details["from"], gap.details["to"]) == ("2", "5")


async def test_a_beat_replaced_before_a_lagging_owner_read_it_is_no_gap(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """The owner stalls on beat 2 (its handler held back) while the node sends 3, then 4
    an interval later: the stream replaces 3 with 4 before anyone read it. Let go, the
    owner judges 2 then 4 as the last message of its burst (nothing pending behind it),
    and says nothing: the node missed no beat."""
    alerts = await watch_alerts(bus, prefix)
    key = await approved(bus, prefix)
    aggregator = new_aggregator(bus, prefix)
    let_go, held = asyncio.Event(), asyncio.Event()
    let_go.set()
    handle_batch = aggregator.handle_batch

    async def held_back(messages: list[Msg]) -> list[Chain]:
        if not let_go.is_set():
            held.set()
            await let_go.wait()
        return await handle_batch(messages)

    aggregator.handle_batch = held_back  # type: ignore[method-assign]
    supervisor: Supervisor = await supervised([aggregator])
    fleet.stack.push_async_callback(supervisor.stop)
    async with attacker(fleet.url) as nc:
        await beat(nc, prefix, key, 1)
        await wait_record(bus, prefix, "n1", lambda r: r.last_seq == 1)
        let_go.clear()
        await beat(nc, prefix, key, 2)
        await asyncio.wait_for(held.wait(), 5)
        await beat(nc, prefix, key, 3)
        await asyncio.sleep(INTERVAL)
        await beat(nc, prefix, key, 4)
        let_go.set()
        await wait_record(bus, prefix, "n1", lambda r: r.last_seq == 4)
    await bus.flush()
    assert alerts.of("sequence_gap") == []


async def test_a_beat_sent_at_once_after_another_is_no_gap(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """The owner reads beat 2 and is held there; the node sends 3 and, a moment later, 4
    at once on a change (a cordon TTL running out): the stream replaces 3 before the
    owner reads it. The owner was caught up within half an interval before 4, but not
    within the 10 ms that 4's ``previous_ts`` says lay between them: no gap alerted."""
    alerts = await watch_alerts(bus, prefix)
    key = await approved(bus, prefix)
    aggregator = new_aggregator(bus, prefix)
    let_go, held = asyncio.Event(), asyncio.Event()
    let_go.set()
    handle_batch = aggregator.handle_batch

    async def held_back(messages: list[Msg]) -> list[Chain]:
        if not let_go.is_set():
            held.set()
            await let_go.wait()
        return await handle_batch(messages)

    aggregator.handle_batch = held_back  # type: ignore[method-assign]
    supervisor: Supervisor = await supervised([aggregator])
    fleet.stack.push_async_callback(supervisor.stop)
    async with attacker(fleet.url) as nc:
        await beat(nc, prefix, key, 1)
        await wait_record(bus, prefix, "n1", lambda r: r.last_seq == 1)
        let_go.clear()
        await beat(nc, prefix, key, 2)
        await asyncio.wait_for(held.wait(), 5)
        third = await beat(nc, prefix, key, 3)
        await asyncio.sleep(0.01)
        await beat(nc, prefix, key, 4, previous_ts=third)
        let_go.set()
        await wait_record(bus, prefix, "n1", lambda r: r.last_seq == 4)
    await bus.flush()
    assert alerts.of("sequence_gap") == []


async def test_a_gap_after_a_spacing_the_node_gave_is_alerted(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """Beats 1 and 2, then 4 an interval later saying its previous beat went half an
    interval before it: the owner read the stream to its end in that half, so beat 3
    was never stored: one alert, from 2 to 4."""
    alerts = await watch_alerts(bus, prefix)
    key = await approved(bus, prefix)
    await fleet.start_aggregator()
    async with attacker(fleet.url) as nc:
        await beat(nc, prefix, key, 1)
        await wait_record(bus, prefix, "n1", lambda r: r.last_seq == 1)
        await beat(nc, prefix, key, 2)
        await wait_record(bus, prefix, "n1", lambda r: r.last_seq == 2)
        await asyncio.sleep(INTERVAL)
        await beat(nc, prefix, key, 4, previous_ts=time.time() - INTERVAL / 2)
        await wait_record(bus, prefix, "n1", lambda r: r.last_seq == 4)
    await bus.flush()
    (gap,) = alerts.of("sequence_gap")
    assert (gap.details["from"], gap.details["to"]) == ("2", "4")
