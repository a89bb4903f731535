"""The heartbeat's schedule does not wait on the stream: a beat whose acknowledgement never
comes (a stream without a leader) delays the next by a fraction of the interval at most.
A requested stop ends the beats: the goodbye is the last, and a stop is never lost."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from pathlib import Path
from typing import Any

import pytest
from nats.aio.msg import Msg

from actors.node.heartbeat.actor import ACK_WAIT_FRACTION, HeartbeatActor
from actors.node.heartbeat.sequence import SequenceStore
from actors.runtime.bus import NatsBus, publish_signed
from actors.runtime.supervisor import Supervisor
from schemas import codec
from schemas.events import Capacity, NodeState, Sample
from schemas.messages import Heartbeat
from schemas.settings import Settings, SettingsStatus
from schemas.subjects import Subjects
from tests.support.fleet import Fleet, agent_config, node_events, wait_for


async def told_its_first_facts(actor: HeartbeatActor) -> HeartbeatActor:
    """``actor`` given an inventory sample and the node's state, as the other actors tell
    it at start: its first beat does not wait FIRST_SAMPLE_WAIT for each."""
    capacity = Capacity(
        cpu_cores=8, cpu_percent=1, load_avg_1m=0.1, memory_total=1, memory_available=1,
        gpus_total=0, gpus_available=0, storage_total=1, storage_available=1,
    )  # fmt: skip
    await actor._on_event(Sample(ts=time.time(), capacity=capacity))
    await actor._on_event(NodeState(ts=time.time(), schedulability="schedulable"))
    return actor


async def test_unacknowledged_beats_keep_the_interval(
    fleet: Fleet, bus: NatsBus, tmp_path: Path
) -> None:
    """Every beat is taken by a subscriber that never answers (no stream stores it), so
    none is acknowledged: each waits ACK_WAIT_FRACTION of the interval, and the next is
    still due one interval after the last began (before, a beat waited 5 s for its
    acknowledgement, then a whole interval more)."""
    prefix = "unacked"  # no stream: the test's subscriber is all there is
    config = agent_config(fleet.url, prefix, tmp_path, heartbeat_interval=0.5)
    arrivals: list[float] = []

    async def swallow(msg: Msg) -> None:
        arrivals.append(time.monotonic())

    await bus.subscribe(Subjects(prefix).heartbeat("c1", "n1"), swallow)
    await bus.flush()
    actor = HeartbeatActor(config, fleet.bus, node_events(config), SequenceStore(tmp_path))
    assert actor.ack_wait == ACK_WAIT_FRACTION * 0.5
    await fleet.start_supervisor(await told_its_first_facts(actor))
    await wait_for(lambda: len(arrivals) >= 6)
    gaps = [later - earlier for earlier, later in itertools.pairwise(arrivals)]
    # One interval (jittered by 10 %) apart; the loaded machine's delays are bounded
    # well under the 5.5 s a beat took when it waited for its acknowledgement.
    assert max(gaps) < 2.0, gaps
    assert actor.metrics.heartbeat_failures._value.get() >= 5


async def test_the_ack_wait_follows_a_heartbeat_interval_the_fleet_sets(
    fleet: Fleet, tmp_path: Path
) -> None:
    """A heartbeat_interval taken live from the fleet's settings moves the acknowledgement
    wait with it (it was fixed at the interval the agent started with)."""
    config = agent_config(fleet.url, "retuned", tmp_path, heartbeat_interval=0.5)
    actor = HeartbeatActor(config, fleet.bus, node_events(config), SequenceStore(tmp_path))
    settings = Settings(
        ts=time.time(),
        status=SettingsStatus(),
        live={"heartbeat_interval": 2.0, "stale_after": 30.0},
    )
    await actor._on_event(settings)
    assert actor.config.heartbeat_interval == 2.0
    assert actor.ack_wait == ACK_WAIT_FRACTION * 2.0


async def test_the_goodbye_waits_for_a_beat_in_flight_and_is_the_last(
    fleet: Fleet, bus: NatsBus, tmp_path: Path
) -> None:
    """A goodbye asked while a beat waits for its acknowledgement is sent after it, never
    beside it (the stream keeps one beat a node: the later would replace the earlier
    unread, a false sequence_gap), its seq the next; after it the loop beats no more."""
    prefix = "goodbye"  # no stream: the test's subscriber acknowledges
    config = agent_config(fleet.url, prefix, tmp_path, heartbeat_interval=0.5)
    actor = HeartbeatActor(config, fleet.bus, node_events(config), SequenceStore(tmp_path))
    beats: list[Heartbeat] = []
    held: list[Msg] = []

    async def acknowledge(msg: Msg) -> None:
        beats.append(codec.decode(msg.data, Heartbeat, msg.subject))
        if len(beats) == 3:
            held.append(msg)  # the third beat waits for its acknowledgement
        else:
            await msg.respond(b'{"stream": "S", "seq": %d}' % len(beats))

    await bus.subscribe(Subjects(prefix).heartbeat("c1", "n1"), acknowledge)
    await bus.flush()
    await fleet.start_supervisor(await told_its_first_facts(actor))
    await wait_for(lambda: held)
    goodbye = asyncio.create_task(actor.goodbye())
    await fleet.bus.flush()  # what the actor published has reached the server...
    await bus.flush()  # ... and the server has handed it on
    assert [(beat.seq, beat.stopping) for beat in beats] == [(1, False), (2, False), (3, False)]
    await held[0].respond(b'{"stream": "S", "seq": 3}')
    await goodbye
    await wait_for(lambda: len(beats) == 4)
    assert (beats[3].seq, beats[3].stopping) == (4, True)
    assert await actor.beat() is None


async def test_the_goodbye_and_the_beat_it_waits_for_share_one_ack_wait(
    fleet: Fleet, bus: NatsBus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A goodbye behind a beat whose acknowledgement never comes waits for that beat's
    ack_wait (2 s here), then is sent waiting only what is left of it: a stop takes no
    longer than one ack_wait more, as before (systemd's TimeoutStopSec counts on it)."""
    prefix = "goodbye-budget"  # no stream: nothing acknowledges
    config = agent_config(fleet.url, prefix, tmp_path, heartbeat_interval=4.0, stale_after=10.0)
    actor = HeartbeatActor(config, fleet.bus, node_events(config), SequenceStore(tmp_path))
    assert actor.ack_wait == 2.0
    waits: list[float] = []

    async def publish_noting_the_wait(*args: Any, timeout: float, **kwargs: Any) -> Any:
        waits.append(timeout)
        return await publish_signed(*args, timeout=timeout, **kwargs)

    monkeypatch.setattr("actors.node.heartbeat.actor.publish_signed", publish_noting_the_wait)
    goodbyes: list[asyncio.Task[None]] = []

    async def say_goodbye_at_the_first(msg: Msg) -> None:
        if not goodbyes:  # the first beat waits for its acknowledgement: goodbye now
            goodbyes.append(asyncio.create_task(actor.goodbye()))

    await bus.subscribe(Subjects(prefix).heartbeat("c1", "n1"), say_goodbye_at_the_first)
    await bus.flush()
    await fleet.start_supervisor(await told_its_first_facts(actor))
    await wait_for(lambda: goodbyes)
    await goodbyes[0]
    first, goodbye = waits[:2]
    assert first == 2.0 and goodbye < 1.0, waits


async def test_a_stop_asked_as_the_ack_comes_is_not_lost(
    fleet: Fleet, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Python 3.11's wait_for (nats-py's requests) returns the result when its task is
    cancelled just as the answer came: the loop stops anyway, at once (before, it beat on
    after its agent stopped, each stop waiting its full timeout)."""
    config = agent_config(fleet.url, "lost-cancel", tmp_path, heartbeat_interval=0.5)
    actor = HeartbeatActor(config, fleet.bus, node_events(config), SequenceStore(tmp_path))
    in_flight = asyncio.Event()

    async def beat_swallowing_the_cancel() -> None:
        in_flight.set()
        try:
            await asyncio.Event().wait()  # a beat waiting for its acknowledgement
        except asyncio.CancelledError:
            return  # as wait_for does when the answer came with the cancel

    actor.beat = beat_swallowing_the_cancel  # type: ignore[method-assign]
    supervisor = Supervisor([await told_its_first_facts(actor)])
    supervisor.start()
    await wait_for(in_flight.is_set)
    caplog.set_level(logging.WARNING, logger="actors.runtime.supervisor")
    await supervisor.stop(timeout=30)
    assert "actor did not stop in time" not in caplog.text
    assert supervisor.status["heartbeat"].phase == "stopped"
