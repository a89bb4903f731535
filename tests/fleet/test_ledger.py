"""An owner never writes a node's record back to an older heartbeat: one that finds the
record judged further by another owner (its write came late, after a pause or a cut past
its lease) drops its view instead, unless its view went stale and the stored record's
heartbeat ran out too: then the stored record goes stale (actors/fleet/aggregator/writes.py)."""

from __future__ import annotations

import msgspec

from actors.fleet.aggregator.actor import AggregatorActor
from actors.fleet.storage.records import read_record
from actors.fleet.storage.registry import approve
from actors.runtime import kv
from actors.runtime.bus import NatsBus
from schemas import codec, signing
from schemas.messages import NodeRecord
from schemas.subjects import BUCKET_NODES, Subjects
from tests.fleet.test_aggregator import watch_alerts
from tests.fleet.test_silence import beat
from tests.support.fleet import Fleet, wait_for, wait_record


async def test_a_record_judged_further_elsewhere_is_not_written_back(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """Another owner's write of a later heartbeat lands after this owner's last: this
    owner's next write finds it, writes nothing, and drops the node from its table."""
    subjects = Subjects(prefix)
    key = signing.KeyPair.generate()
    await approve(bus, subjects, "n1", key.public_key)
    supervisor = await fleet.start_aggregator()
    aggregator = supervisor.actors[0]
    assert isinstance(aggregator, AggregatorActor)
    for seq in (1, 2, 3):
        await beat(bus, prefix, key, "n1", seq)
    await wait_record(bus, prefix, "n1", lambda r: r.last_seq == 3)
    nodes = await bus.kv(subjects.bucket_name(BUCKET_NODES))
    current, _ = await kv.read_with_revision(nodes, "n1", NodeRecord)
    assert current is not None
    # Judged from a beat whose stale_after has not run out when this owner's view of
    # seq 4 goes stale (its TTL marker): the stored record stays as it is.
    assert current.heartbeat is not None
    lasting = msgspec.structs.replace(current.heartbeat, stale_after=3600.0)
    further = msgspec.structs.replace(
        current, last_seq=40, last_stream_seq=current.last_stream_seq + 1000, heartbeat=lasting
    )
    await nodes.put("n1", codec.encode(further))
    await beat(bus, prefix, key, "n1", 4)  # judged here from an older view: seq 3 -> 4
    await wait_for(lambda: "n1" not in aggregator.ledger.nodes)
    assert (await read_record(bus, subjects, "n1")).last_seq == 40


async def test_a_stale_verdict_on_an_older_view_makes_the_stored_record_stale(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """The owner's view is older than the store (a late write of an earlier tenure, a
    replica behind: here a later record put under it) when the node's TTL marker comes:
    its stale alert is raised on that view, and its write, finding the record judged
    further, writes the stored record stale instead of dropping the verdict, so the
    node's return raises `recovered` (the fault round's g1, issue 48)."""
    alerts = await watch_alerts(bus, prefix)
    subjects = Subjects(prefix)
    key = signing.KeyPair.generate()
    await approve(bus, subjects, "n1", key.public_key)
    supervisor = await fleet.start_aggregator(sweep_interval=0.2)
    aggregator = supervisor.actors[0]
    assert isinstance(aggregator, AggregatorActor)

    def judged() -> int:
        state = aggregator.ledger.nodes.get("n1")
        return state.record.last_seq if state is not None else 0

    for seq in (1, 2, 3):
        await beat(bus, prefix, key, "n1", seq)
    await wait_record(bus, prefix, "n1", lambda r: r.last_seq >= 1, stored=True)
    await wait_for(lambda: judged() == 3)
    nodes = await bus.kv(subjects.bucket_name(BUCKET_NODES))
    current, _ = await kv.read_with_revision(nodes, "n1", NodeRecord)
    assert current is not None
    # Judged further elsewhere from beats stored no later than seq 3: their TTL runs out
    # with the one the marker ends.
    further = msgspec.structs.replace(
        current, last_seq=18, last_stream_seq=current.last_stream_seq + 1000
    )
    await nodes.put("n1", codec.encode(further))
    stale = await wait_record(bus, prefix, "n1", lambda r: r.state == "stale", stored=True)
    assert stale.last_seq == 18 and stale.stale_since is not None
    assert [alert.details.get("last_seq") for alert in alerts.of("stale")] == ["3"]
    await beat(bus, prefix, key, "n1", 19)
    await wait_record(bus, prefix, "n1", lambda r: r.last_seq == 19, stored=True)
    await wait_for(lambda: len(alerts.of("recovered")) == 1)
