"""An owner never writes a node's record back to an older heartbeat: one that finds the
record judged further by another owner (its write came late, after a pause or a cut past
its lease) drops its view instead (actors/fleet/aggregator/writes.py)."""

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
    further = msgspec.structs.replace(
        current, last_seq=40, last_stream_seq=current.last_stream_seq + 1000
    )
    await nodes.put("n1", codec.encode(further))
    await beat(bus, prefix, key, "n1", 4)  # judged here from an older view: seq 3 -> 4
    await wait_for(lambda: "n1" not in aggregator.ledger.nodes)
    assert (await read_record(bus, subjects, "n1")).last_seq == 40
