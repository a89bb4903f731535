"""A TTL marker lost while FLEET_HB changed leader (actors/fleet/aggregator/lost_markers.py):
after an election, a node whose marker fell due near it and never came is stale at once
if FLEET_HB_IN no longer holds its heartbeat; not without an election, nor while the
intake holds one. The lost marker is played by heartbeats without ``Nats-TTL`` (FLEET_HB never
marks them), the last of which the test removes from the intake, as its TTL would;
the election by JetStream's advisory, published as the server does."""

from __future__ import annotations

import json
import time

import msgspec

from actors.fleet.aggregator.lost_markers import MARKER_GRACE, WINDOW, LeaderChanges
from actors.fleet.aggregator.sweeps import LEADER_ELECTED, LOST_MARKER
from actors.fleet.storage.records import read_record
from actors.runtime.bus import NatsBus
from schemas.messages import NodeRecord
from schemas.subjects import STREAM_HEARTBEAT_INTAKE, STREAM_HEARTBEATS, Subjects
from tests.fleet.test_aggregator import watch_alerts
from tests.fleet.test_silence import STALE_AFTER, two_nodes
from tests.support.fleet import Fleet, heartbeat, wait_for, wait_record

T0 = 1_800_000_000.0


def record(node: str, last_seen: float, stale_after: float, **changes: object) -> NodeRecord:
    """A live record of ``node`` whose last heartbeat (``stale_after``) was stored at
    ``last_seen``, with ``changes``."""
    live = NodeRecord(
        node_id=node,
        cluster="c1",
        state="active",
        last_seq=1,
        last_seen=last_seen,
        heartbeat=heartbeat(node, stale_after=stale_after),
    )
    return msgspec.structs.replace(live, **changes)


def test_a_marker_due_near_an_election_and_not_come_is_lost() -> None:
    changes = LeaderChanges()
    node = record("n1", last_seen=T0, stale_after=5.0)
    assert not changes.lost(node, T0 + 10, bound=600), "no election heard"
    changes.elected(T0 + 2)
    assert not changes.lost(node, T0 + 5 + MARKER_GRACE / 2, bound=600), "not due yet"
    assert changes.lost(node, T0 + 5 + MARKER_GRACE, bound=600)
    far = record("n2", last_seen=T0 + 2 + WINDOW + 1, stale_after=5.0)
    assert not changes.lost(far, T0 + 60, bound=600), "due well after the election"
    capped = record("n3", last_seen=T0, stale_after=500.0)
    assert changes.lost(capped, T0 + 7, bound=5.0), "stale_after capped by the bound"


def test_only_live_nodes_can_have_lost_a_marker() -> None:
    changes = LeaderChanges()
    changes.elected(T0 + 5)
    now = T0 + 10
    for gone in (
        record("n1", last_seen=T0, stale_after=5.0, stale_since=T0 + 5),
        record("n1", last_seen=T0, stale_after=5.0, stopped_since=T0),
        record("n1", last_seen=T0, stale_after=5.0, deregistered=True),
    ):
        assert not changes.lost(gone, now, bound=600)


def test_the_sweeps_look_only_while_an_election_is_recent() -> None:
    changes = LeaderChanges()
    assert not changes.looking(T0, slack=5.0)
    changes.elected(T0)
    assert changes.looking(T0 + WINDOW + MARKER_GRACE + 5.0, slack=5.0)
    assert not changes.looking(T0 + WINDOW + MARKER_GRACE + 5.1, slack=5.0)
    for n in range(40):
        changes.elected(T0 + 100 + n)
    assert len(changes.elected_at) <= 16, "elections remembered are bounded"


async def forget_in_intake(bus: NatsBus, prefix: str, node: str) -> None:
    """What the intake's TTL does to the node's last heartbeat."""
    subjects = Subjects(prefix)
    intake = subjects.stream_name(STREAM_HEARTBEAT_INTAKE)
    await bus.js.purge_stream(intake, subject=subjects.heartbeat("c1", node))


async def elect(bus: NatsBus, prefix: str) -> None:
    """JetStream's advisory of a new leader of FLEET_HB, as the server sends it."""
    stream = Subjects(prefix).stream_name(STREAM_HEARTBEATS)
    advisory = {
        "type": "io.nats.jetstream.advisory.v1.stream_leader_elected",
        "stream": stream,
        "leader": "n2",
    }
    await bus.publish(f"{LEADER_ELECTED}.{stream}", json.dumps(advisory).encode())
    await bus.flush()


async def test_a_marker_lost_in_a_leader_change_makes_its_node_stale_at_once(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    alerts = await watch_alerts(bus, prefix)
    aggregator, _ = await two_nodes(fleet, bus, prefix, keeps_beating="n1", without_ttl="n2")
    last = (await read_record(bus, Subjects(prefix), "n2")).last_seen
    await forget_in_intake(bus, prefix, "n2")
    await elect(bus, prefix)
    await wait_for(lambda: aggregator.sweeps.leader_changes.elected_at)
    stale = await wait_record(bus, prefix, "n2", lambda r: r.state == "stale")
    assert stale.stale_since is not None
    assert stale.stale_since >= last + STALE_AFTER, "stale before its stale_after ran out"
    await alerts.wait_count(1)
    [alert] = alerts.of("stale")
    assert alert.node_id == "n2" and LOST_MARKER in alert.message
    assert (await read_record(bus, Subjects(prefix), "n1")).state == "active"


async def test_a_missing_marker_is_not_taken_as_lost_without_an_election_or_while_the_intake_holds_the_beat(  # noqa: E501
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """n2's marker never comes and nothing is heard of an election: n2 stays active past
    its due time (the full sweep's net is for that); an election heard, with n2's beat
    still in the intake, changes nothing either."""
    aggregator, _ = await two_nodes(fleet, bus, prefix, keeps_beating="n1", without_ttl="n2")
    last = (await read_record(bus, Subjects(prefix), "n2")).last_seen
    sweeps = aggregator.sweeps
    passed = sweeps.sweeps_done
    await wait_for(lambda: time.time() > last + STALE_AFTER + MARKER_GRACE)
    await wait_for(lambda: sweeps.sweeps_done >= passed + 3)
    assert (await read_record(bus, Subjects(prefix), "n2")).state == "active"
    await elect(bus, prefix)
    await wait_for(lambda: sweeps.leader_changes.elected_at)
    passed = sweeps.sweeps_done
    await wait_for(lambda: sweeps.sweeps_done >= passed + 3)
    assert (await read_record(bus, Subjects(prefix), "n2")).state == "active"
