"""The heartbeat's schedule does not wait on the stream: a beat whose acknowledgement never
comes (a stream without a leader) delays the next by a fraction of the interval at most."""

from __future__ import annotations

import itertools
import time
from pathlib import Path

from nats.aio.msg import Msg

from actors.node.heartbeat.actor import ACK_WAIT_FRACTION, HeartbeatActor
from actors.node.heartbeat.sequence import SequenceStore
from actors.runtime.bus import NatsBus
from schemas.settings import Settings, SettingsStatus
from schemas.subjects import Subjects
from tests.support.fleet import Fleet, agent_config, node_events, wait_for


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
    await fleet.start_supervisor(actor)
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
