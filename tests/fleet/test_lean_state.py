"""The aggregator's lean in-memory state: one record built per heartbeat, slim records
with the heartbeat's bytes beside them, and the fleet API's encoded records."""

from __future__ import annotations

import gc
import sys
import uuid

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from actors.cli.simulate.publisher import SimOptions, template
from actors.fleet import packing, record_state
from actors.fleet.aggregator import alert_rules, hot_state, judge, record_rules
from actors.fleet.live.feed import EncodedRecords, RecordSummary
from actors.fleet.shared_values import SharedByKey, SharedValues
from schemas import codec
from schemas.events import Health, Interruption, SpotStatus
from schemas.messages import Heartbeat, NodeRecord
from schemas.settings import SettingsStatus
from tests.fleet.test_lifecycle_rules import gpus
from tests.support.fleet import agent_shaped, heartbeat

SIM_BEAT = codec.decode(
    template("n1", SimOptions(nodes=1, rate=1.0, duration=1.0), "b1")
    .replace(b"987654321987654", b"7")
    .replace(b"1111111111.0625", b"1700000000.5"),
    Heartbeat,
)
"""A simulated node's whole heartbeat: 8 GPUs, health checks, latency, jobs."""

healths = st.none() | st.builds(
    Health,
    ts=st.just(1.0),
    status=st.sampled_from(["healthy", "degraded", "unhealthy"]),
    score=st.integers(0, 100),
)
samples = st.none() | st.lists(st.sampled_from(["GPU-a", "GPU-b", "GPU-c"]), unique=True).map(
    lambda uuids: gpus(*uuids)
)
notices = st.none() | st.builds(
    Interruption,
    ts=st.just(1.0),
    provider=st.just("aws"),
    kind=st.sampled_from(["terminate", "rebalance"]),
)


@st.composite
def previous_records(draw: st.DrawFn) -> NodeRecord:
    """A record as the aggregator may hold it when a heartbeat comes: pending, accepted,
    stale, offline, refused, deregistered, with a seq reset or a fingerprint."""
    record = record_rules.pending_record("n1", "c1", draw(st.sampled_from(["", "UOLD"])))
    if draw(st.booleans()):
        beat = heartbeat(seq=draw(st.integers(1, 5)), sample=draw(samples))
        record = record_rules.with_lifecycle(
            record, record_rules.accept(record, beat, "UOLD", 50.0), beat
        )
    changes: dict[str, object] = {}
    if draw(st.booleans()):
        changes["stale_since"] = 60.0
        if draw(st.booleans()):
            changes["offline_since"] = 70.0
    if draw(st.booleans()):
        changes["deregistered"] = True
        changes["deregistered_by"] = draw(st.sampled_from(["node", "UOP"]))
        changes["deregistered_at"] = 65.0
    if draw(st.booleans()):
        changes["refused"], changes["refused_at"] = "replay", 66.0
    changes["seq_reset"] = draw(st.booleans())
    changes["health_status"] = draw(st.sampled_from([None, "healthy", "degraded"]))
    changes["created"] = draw(st.sampled_from([None, 40.0]))
    return record_state.with_state(record, **changes)


@st.composite
def heartbeats(draw: st.DrawFn) -> Heartbeat:
    return heartbeat(
        seq=draw(st.integers(1, 10)),
        boot_id=draw(st.sampled_from(["b1", "b2"])),
        schedulability=draw(st.sampled_from(["schedulable", "cordoned", "draining"])),
        health=draw(healths),
        sample=draw(samples),
        spot=SpotStatus(notice=draw(notices)),
        deregistering=draw(st.booleans()),
        schedulability_reason=draw(st.sampled_from(["", "leaving"])),
        labels=draw(st.sampled_from([{}, {"zone": "a"}])),
    )


@given(previous_records(), heartbeats(), st.sampled_from(["UOLD", "UNEW"]))
def test_one_step_accept_is_accept_then_lifecycle(
    previous: NodeRecord, beat: Heartbeat, key: str
) -> None:
    """The hot path's one-step record equals the rules' accept then with_lifecycle, field
    for field and byte for byte; with the slim heartbeat kept (whose strings and labels
    the record then holds), every field but the heartbeat itself."""
    slow = record_rules.with_lifecycle(
        previous, record_rules.accept(previous, beat, key, 100.0, 9, 99.0), beat
    )
    fingerprint = record_rules.gpu_fingerprint(beat)
    fast = record_rules.accepted(previous, beat, key, 100.0, 9, 99.0, fingerprint)
    assert fast == slow
    assert codec.encode(fast) == codec.encode(slow)
    kept = hot_state.slim_heartbeat(beat, previous)
    lean = record_rules.accepted(previous, beat, key, 100.0, 9, 99.0, fingerprint, kept)
    assert lean.heartbeat is kept
    assert msgspec.structs.replace(lean, heartbeat=beat) == slow


MARKS: dict[str, dict[str, object]] = {
    "": {},
    "stale": {"stale_since": 60.0},
    "refused": {"refused": "replay", "refused_at": 66.0},
    "seq_reset": {"seq_reset": True},
    "deregistered": {"deregistered": True, "deregistered_by": "UOP"},
}
NEXT_BEATS: dict[str, dict[str, object]] = {
    "": {},
    "seq_replayed": {"seq": 5},
    "seq_gap": {"seq": 8},
    "late": {"ts": 1002.0},
    "boot": {"boot_id": "b2"},
    "health": {"health": Health(ts=1.0, status="degraded", score=60)},
    "gpus": {"sample": gpus("GPU-a", "GPU-c")},
    "notice": {"spot": SpotStatus(notice=Interruption(ts=1.0, provider="aws", kind="terminate"))},
    "cordon": {"schedulability": "cordoned"},
    "labels": {"labels": {"zone": "b"}},
    "version": {"agent_version": "next"},
    "leaving": {"deregistering": True},
    "score": {"health": Health(ts=1.0, status="healthy", score=70)},
    "no_sample": {"sample": None, "health": None},
    "key": {},
}
"""What may differ in a node's next heartbeat; ``key``: signed under a new approved key."""


@pytest.mark.parametrize("change", list(NEXT_BEATS))
@pytest.mark.parametrize("mark", list(MARKS))
def test_a_steady_beat_is_accepted_exactly_as_any_other(mark: str, change: str) -> None:
    """A record that accepted a heartbeat (perhaps marked since), then the node's next one
    with one thing or nothing changed. Where the hot path's steady-beat shortcut applies,
    its record is the one the whole rules build, byte for byte, and the whole rules raise
    no alert and see no transition; on an unmarked record, a heartbeat that changed only
    its score or lost its sample takes the shortcut, any other change does not."""
    first = heartbeat(
        seq=5, health=Health(ts=1.0, status="healthy", score=90), sample=gpus("GPU-a", "GPU-b")
    )
    first = msgspec.structs.replace(first, ts=1000.0)
    previous = record_rules.accepted(
        record_rules.pending_record("n1", "c1", "UOLD"),
        first,
        "UOLD",
        50.0,
        7,
        49.0,
        record_rules.gpu_fingerprint(first),
    )
    previous = record_state.with_state(previous, **MARKS[mark])
    beat = msgspec.structs.replace(first, **{"seq": 6, "ts": 1000.4, **NEXT_BEATS[change]})
    key = "UNEW" if change == "key" else "UOLD"
    fingerprint = record_rules.gpu_fingerprint(beat)
    kept = hot_state.slim_heartbeat(beat, previous)
    whole = record_rules.accepted(previous, beat, key, 100.0, 9, 99.0, fingerprint, kept)
    packed = None if fingerprint is None else hot_state.packed_gpus(fingerprint)
    known = hot_state.packed_gpus(previous.gpu_fingerprint)
    steady = record_rules.is_steady(previous, beat, key, packed, known)
    assert steady == (mark == "" and change in ("", "score", "no_sample"))
    if steady:
        assert record_rules.judge_seq(previous, beat.seq, 1000, key) == "next"
        assert alert_rules.deregistered_refusal(previous, beat) is None
        assert alert_rules.heartbeat_alerts(previous, whole, beat) == []
        assert alert_rules.hardware_alert(previous, beat, fingerprint) is None
        assert not record_rules.is_transition(previous, whole)
        short = record_rules.steady_beat(previous, beat, 100.0, 9, 99.0, kept)
        assert short == whole
        assert codec.encode(short) == codec.encode(whole)


def test_a_beat_kept_shares_the_records_objects_where_it_holds_the_same() -> None:
    """A new heartbeat decodes into new strings; the slim one kept holds the record's
    name, cluster, boot, version, labels, schedulability and spot status instead (equal
    values, one object each), and a value that differs stays the heartbeat's own."""
    record = hot_state.slim(
        record_rules.accepted(
            record_rules.pending_record("n1", "c1"), SIM_BEAT, "U", 1.0, 1, 1.0, None
        )
    )
    assert record.heartbeat is not None
    beat = codec.decode(codec.encode(msgspec.structs.replace(SIM_BEAT, seq=8)), Heartbeat)
    kept = hot_state.slim_heartbeat(beat, record)
    assert kept == hot_state.slim_heartbeat(beat)
    for name in ("node_id", "cluster", "boot_id", "agent_version", "labels", "schedulability"):
        assert getattr(kept, name) is getattr(record, name), name
    assert kept.spot is record.heartbeat.spot
    rebooted = msgspec.structs.replace(beat, boot_id="b2", labels={"rack": "r9"})
    other = hot_state.slim_heartbeat(rebooted, record)
    assert other.boot_id == "b2" and other.labels == {"rack": "r9"}
    assert other.node_id is record.node_id


def test_slim_record_writes_exactly_the_whole_one() -> None:
    """A record kept slim with its heartbeat's bytes encodes to exactly the bytes of the
    whole record, and keeps every field the rules read of a last heartbeat."""
    whole = record_rules.accepted(
        record_rules.pending_record("n1", "c1"),
        SIM_BEAT,
        "U",
        100.0,
        3,
        99.0,
        record_rules.gpu_fingerprint(SIM_BEAT),
    )
    kept = hot_state.slim(whole)
    assert kept.heartbeat is not None and kept.heartbeat.sample is None
    assert kept.heartbeat.health is None and kept.heartbeat.workloads == []
    for name in ("seq", "ts", "boot_id", "interval", "stale_after", "spot", "labels"):
        assert getattr(kept.heartbeat, name) == getattr(SIM_BEAT, name)
    table = hot_state.NodeTable()
    body = table.bodies.pack(codec.encode(SIM_BEAT))
    assert whole.gpu_fingerprint and whole.gpu_fingerprint == record_rules.gpu_fingerprint(SIM_BEAT)
    assert kept.gpu_fingerprint is hot_state.APART
    gpus = hot_state.packed_gpus(whole.gpu_fingerprint)
    assert codec.encode(hot_state.full(kept, body, gpus, table.bodies)) == codec.encode(whole)
    # What the owner writes: the same bytes, the heartbeat's spliced in undecoded.
    assert hot_state.encoded(kept, body, gpus, table.bodies) == codec.encode(whole)
    state = hot_state.from_stored("n1", codec.encode(whole), 5.0, table.bodies)
    assert state.record == kept and state.fresh and state.gpus == gpus
    assert state.stored == hot_state.digest(kept, gpus) and not state.stored_reset
    assert state.stored == hot_state.stored_digest(whole)
    assert codec.encode(table.whole(state)) == codec.encode(whole)
    without = record_rules.pending_record("n1", "c1")
    assert hot_state.slim(without) == without
    assert hot_state.from_stored("n1", codec.encode(without), 5.0, table.bodies).body is None


@given(first=st.binary(max_size=4096), bodies=st.lists(st.binary(max_size=4096), max_size=5))
def test_packed_bodies_unpack_to_exactly_their_bytes(first: bytes, bodies: list[bytes]) -> None:
    """Whatever the first body (the dictionary) and the ones after it, each unpacks to
    exactly what was packed."""
    packer = packing.Bodies()
    packed = [packer.pack(body) for body in [first, *bodies]]
    assert [packer.unpack(frame) for frame in packed] == [first, *bodies]


def test_another_nodes_heartbeat_packs_to_a_small_part_of_its_bytes() -> None:
    """The dictionary is the first heartbeat packed: another node's heartbeat (other
    name, GPUs, readings, seq and time) keeps under a fifth of its bytes."""
    packer = packing.Bodies()
    packer.pack(codec.encode(SIM_BEAT))
    sample = SIM_BEAT.sample
    assert sample is not None and sample.gpus
    other = msgspec.structs.replace(
        SIM_BEAT,
        node_id="gpu-node-0412",
        seq=81234,
        ts=1700001234.25,
        sample=msgspec.structs.replace(
            sample,
            hostname="gpu-node-0412",
            gpus=[
                msgspec.structs.replace(
                    gpu,
                    uuid=f"GPU-{index:08x}-9d1c-4be2-a3f0-5c6e{index:08x}",
                    temperature_c=51.0 + index,
                    power_w=412.5 - index,
                    memory_used=gpu.memory_used + 7_340_032 * index,
                )
                for index, gpu in enumerate(sample.gpus)
            ],
        ),
    )
    body = codec.encode(other)
    packed = packer.pack(body)
    assert packer.unpack(packed) == body
    assert len(packed) < len(body) / 5


def test_slim_record_is_a_fraction_of_the_whole() -> None:
    """What the aggregator keeps per node (slim record and bytes) is well under the
    decoded whole record (tracemalloc)."""
    import tracemalloc

    value = codec.encode(
        record_rules.accepted(
            record_rules.pending_record("n1", "c1"), SIM_BEAT, "U", 1.0, 1, 1.0, None
        )
    )
    tracemalloc.start()
    wholes = [codec.decode(value, NodeRecord) for _ in range(200)]
    whole_size = tracemalloc.get_traced_memory()[0] / 200
    tracemalloc.stop()
    del wholes
    tracemalloc.start()
    bodies = packing.Bodies()
    states = [hot_state.from_stored("n1", value, 1.0, bodies) for _ in range(200)]
    lean_size = tracemalloc.get_traced_memory()[0] / 200
    tracemalloc.stop()
    assert len(states) == 200
    assert lean_size < 0.7 * whole_size


def test_encoded_records_decode_on_access() -> None:
    """The fleet API's records are kept as bytes and read back equal; summaries and
    readable leave out the nodes asked to skip and unreadable bytes."""
    records = EncodedRecords()
    one = record_rules.pending_record("n1", "c1")
    records["n1"] = one
    records["n2"] = record_state.with_state(one, node_id="n2", cluster="c2")
    records.raw["n3"] = b'{"node_id": "n3", "state": 7}'
    assert records["n1"] == one and isinstance(records.raw["n1"], bytes)
    assert sorted(records.readable({"n2": None})) == ["n1"]
    assert records.summaries({}) == [
        RecordSummary(cluster="c1", state="pending"),
        RecordSummary(cluster="c2", state="pending"),
    ]
    del records["n1"]
    assert list(records) == ["n2", "n3"] and len(records) == 2
    assert msgspec.structs.asdict(records["n2"])["cluster"] == "c2"


def test_a_nodes_name_and_key_are_one_string_however_many_tables_hold_them() -> None:
    """The slim record interns the node's name and key, and the owner's table interns
    its keys: a name decoded anew (a subject, a KV key) is stored as that same object."""
    whole = codec.decode(
        codec.encode(
            record_rules.accepted(
                record_rules.pending_record("n-intern", "c1"),
                SIM_BEAT,
                "U" * 56,
                1.0,
                1,
                1.0,
                None,
            )
        ),
        NodeRecord,
    )
    kept = hot_state.slim(whole)
    assert kept.node_id is sys.intern("n-intern") and kept.public_key is sys.intern("U" * 56)
    table = hot_state.NodeTable()
    name = "".join(["n-", "intern"])  # equal, another object
    table[name] = hot_state.NodeState(kept, 1.0)
    assert next(iter(table)) is kept.node_id
    unscored = hot_state.slim(msgspec.structs.replace(whole, health_status=None))
    assert unscored.health_status is None and unscored.node_id is kept.node_id


def test_a_record_written_keeps_the_heartbeat_as_it_came() -> None:
    """The record written embeds the heartbeat's own bytes: a field a newer agent sends
    and this version does not know stays in fleet_nodes (readers ignore it), and the
    record reads back as the whole one."""
    newer = codec.encode(SIM_BEAT)[:-1] + b',"from_a_newer_agent":{"x":[1,2]}}'
    beat = codec.decode(newer, Heartbeat)
    whole = record_rules.accepted(
        record_rules.pending_record("n1", "c1"), beat, "U", 100.0, 3, 99.0, None
    )
    bodies = packing.Bodies()
    written = hot_state.encoded(
        hot_state.slim(whole), bodies.pack(newer), hot_state.NO_GPUS, bodies
    )
    assert b'"from_a_newer_agent":{"x":[1,2]}' in written
    assert codec.decode(written, NodeRecord) == whole
    pending = hot_state.slim(record_rules.pending_record("n1", "c1"))
    assert hot_state.encoded(pending, None, hot_state.NO_GPUS, bodies) == (
        codec.encode(record_rules.pending_record("n1", "c1"))
    )


def judged(state: hot_state.NodeState | None, beat: Heartbeat, stream_seq: int) -> NodeRecord:
    """The record after the judge accepts ``beat`` for a node in ``state`` (None: none in
    memory), stored at the beat's own ts."""
    verdict = judge.accept(
        state,
        beat,
        "U",
        judge.Stored(stream_seq=stream_seq, at=SIM_BEAT.ts),
        judge.Moment(now=SIM_BEAT.ts, monotonic=1.0, max_skew=60.0, max_jump=1000),
    )
    return verdict.record


def kept_per_node(
    values: list[bytes], bodies: packing.Bodies
) -> tuple[float, list[hot_state.NodeState]]:
    """Bytes a node's state holds, by ``tracemalloc``, for the stored records ``values``
    loaded in a fleet already running. CPython 3.11 frees a call's 20-name tuple of
    keyword names onto a free list it never takes 20-tuples from (up to 2,000 of them,
    which ``tracemalloc`` counts as held: 400 KB once, not per node); the list is filled
    first, and the collector, whose full collections empty it, paused until the end."""
    import tracemalloc

    gc.disable()
    try:
        warm = [hot_state.from_stored("warm", values[0], 1.0, bodies) for _ in range(2100)]
        del warm
        tracemalloc.start()
        states = [
            hot_state.from_stored(f"n{index}", value, 1.0, bodies)
            for index, value in enumerate(values)
        ]
        per_node = tracemalloc.get_traced_memory()[0] / len(states)
        tracemalloc.stop()
    finally:
        gc.enable()
    return per_node, states


def test_nodes_alike_share_their_empty_fields_spot_status_and_durations() -> None:
    """Two nodes' slim records loaded from fleet_nodes hold one labels, empty
    candidates, settings status, spot status, interval and stale_after between them, a loaded
    heartbeat's seq is its record's last_seq object, and a node kept costs under 1,250
    bytes (tracemalloc; 1,138 now, about 1,390 before they and the decision facts'
    number were shared)."""

    def stored(node: str) -> bytes:
        beat = codec.decode(
            codec.encode(msgspec.structs.replace(SIM_BEAT, node_id=node)), Heartbeat
        )
        whole = record_rules.accepted(
            record_rules.pending_record(node, "c1"), beat, "U", 1.0, 1, 1.0, None
        )
        return codec.encode(whole)

    values = [stored(f"n{index}") for index in range(200)]
    bodies = packing.Bodies()
    bodies.pack(codec.encode(SIM_BEAT))  # the dictionary: not a node's cost
    per_node, states = kept_per_node(values, bodies)
    first, second = (state.record for state in states[:2])
    assert first.heartbeat is not None and second.heartbeat is not None
    assert first.labels is second.labels is first.heartbeat.labels
    assert first.candidates is second.candidates is record_rules.NO_CANDIDATES
    assert first.heartbeat.settings is second.heartbeat.settings
    assert first.heartbeat.spot is second.heartbeat.spot
    assert first.heartbeat.interval is second.heartbeat.interval
    assert first.heartbeat.stale_after is second.heartbeat.stale_after
    big_seq = msgspec.structs.replace(SIM_BEAT, seq=10**6)
    loaded = hot_state.slim(
        codec.decode(
            codec.encode(
                record_rules.accepted(
                    record_rules.pending_record("n-seq", "c1"), big_seq, "U", 1.0, 1, 1.0, None
                )
            ),
            NodeRecord,
        )
    )
    assert loaded.heartbeat is not None and loaded.heartbeat.seq is loaded.last_seq
    assert per_node < 1250


def eight_gpus(node: str) -> list[str]:
    """Eight uuids of ``node``'s own, as NVML names a machine's GPUs."""
    return [f"GPU-{uuid.uuid5(uuid.NAMESPACE_DNS, f'{node}.{index}')}" for index in range(8)]


def test_a_nodes_gpu_fingerprint_is_kept_packed_beside_its_record() -> None:
    """A node of eight GPUs: the record kept holds no fingerprint of its own (``APART``),
    its state keeps it packed, 384 bytes where the list of uuids was about 900 (under
    600 more than a node without one, by tracemalloc), and every whole record has it
    back. A steady next beat takes the shortcut and leaves it as it is; a GPU swapped
    raises ``hardware_changed`` with both lists, and the state keeps the new one."""
    bodies = packing.Bodies()
    bodies.pack(codec.encode(SIM_BEAT))

    def stored(node: str, fingerprinted: bool = True) -> bytes:
        beat = msgspec.structs.replace(SIM_BEAT, node_id=node, sample=gpus(*eight_gpus(node)))
        whole = record_rules.accepted(
            record_rules.pending_record(node, "c1"),
            codec.decode(codec.encode(beat), Heartbeat),
            "U",
            1.0,
            1,
            1.0,
            record_rules.gpu_fingerprint(beat) if fingerprinted else None,
        )
        return codec.encode(whole)

    # The same heartbeats kept, their records with and without the fingerprint.
    with_gpus, states = kept_per_node([stored(f"n{i}") for i in range(200)], bodies)
    without, _ = kept_per_node([stored(f"n{i}", fingerprinted=False) for i in range(200)], bodies)
    # 378 bytes packed: this window reads 412-498 more a node (five runs; the decode's
    # leftovers vary), where the list of uuids read 824 more (the code before).
    assert 0 < with_gpus - without < 600, (with_gpus, without)
    state = states[0]
    assert state.record.gpu_fingerprint is hot_state.APART
    assert hot_state.unpacked_gpus(state.gpus) == sorted(eight_gpus("n0"))
    table = hot_state.NodeTable()
    table.bodies = bodies
    assert table.whole(state).gpu_fingerprint == sorted(eight_gpus("n0"))
    assert state.stored == hot_state.stored_digest(codec.decode(stored("n0"), NodeRecord))

    def beat(seq: int, fingerprint: list[str]) -> Heartbeat:
        return msgspec.structs.replace(SIM_BEAT, node_id="n0", seq=seq, sample=gpus(*fingerprint))

    def judge_beat(next_beat: Heartbeat) -> judge.Verdict:
        return judge.accept(
            state,
            next_beat,
            "U",
            judge.Stored(stream_seq=next_beat.seq, at=SIM_BEAT.ts),
            judge.Moment(now=SIM_BEAT.ts, monotonic=1.0, max_skew=60.0, max_jump=1000),
        )

    steady = judge_beat(beat(SIM_BEAT.seq + 1, eight_gpus("n0")))
    assert steady.alerts is judge.STEADY and steady.record.gpu_fingerprint is hot_state.APART
    kept = state.gpus
    state.keep(steady.record)
    assert state.gpus is kept
    swapped = [*eight_gpus("n0")[:7], "GPU-00000000-0000-0000-0000-000000000000"]
    changed = judge_beat(beat(SIM_BEAT.seq + 2, swapped))
    (alert,) = [alert for alert in changed.alerts if alert.kind == "hardware_changed"]
    assert alert.details["before"] == ",".join(sorted(eight_gpus("n0")))
    assert alert.details["after"] == ",".join(sorted(swapped))
    state.keep(changed.record)
    assert state.record.gpu_fingerprint is hot_state.APART
    assert hot_state.unpacked_gpus(state.gpus) == sorted(swapped)
    assert table.whole(state).gpu_fingerprint == sorted(swapped)
    # What the owner last wrote is told apart by its fingerprint too.
    assert hot_state.digest(state.record, state.gpus) != hot_state.digest(state.record, kept)


def test_first_heartbeats_judged_share_the_fleets_alike_strings_and_empties() -> None:
    """Records made by nodes' first heartbeats (no state in memory: a fresh fleet, an
    owner taking over) hold one cluster, version and schedulability string for the
    fleet, and one empty labels and candidates, as records loaded from fleet_nodes do
    (256 bytes a node otherwise, 25 MB at 100,000 nodes); a node whose version differs
    from the rest keeps its own value."""

    def first(node: str, version: str = "1.0.0") -> NodeRecord:
        # Decoded anew, as each heartbeat is: equal strings, other objects.
        fresh = msgspec.structs.replace(SIM_BEAT, node_id=node, labels={}, agent_version=version)
        return judged(None, codec.decode(codec.encode(fresh), Heartbeat), stream_seq=1)

    one, two, upgraded = first("n1"), first("n2"), first("n3", version="1.1.0")
    assert one.heartbeat is not None and two.heartbeat is not None
    for name in ("cluster", "agent_version", "schedulability"):
        assert getattr(one, name) is getattr(two, name), name
        assert getattr(one.heartbeat, name) is getattr(one, name), name
    assert one.labels is two.labels is one.heartbeat.labels is hot_state.NO_LABELS
    assert one.candidates is two.candidates is record_rules.NO_CANDIDATES
    assert upgraded.agent_version == "1.1.0" and upgraded.cluster is one.cluster


def test_a_node_sending_a_new_version_every_beat_keeps_its_own_once_the_fleets_are_full(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The fleet's alike strings are bounded (``sys.intern`` keeps every string for good
    on some CPython 3.12 releases): a node that makes up a version each heartbeat fills
    them up to the bound, then keeps its own strings, each equal to what it sent."""
    alike: SharedValues[str] = SharedValues(4)
    monkeypatch.setattr(hot_state, "ALIKE", alike)
    record = hot_state.slim(
        record_rules.accepted(
            record_rules.pending_record("n1", "c1"), SIM_BEAT, "U", 1.0, 1, 1.0, None
        )
    )
    for step in range(20):
        version = "".join(["v", str(step)])  # a string of its own, as decoded
        kept = hot_state.slim_heartbeat(
            msgspec.structs.replace(SIM_BEAT, agent_version=version), record
        )
        assert kept.agent_version == version
    assert len(alike) == 4


def agent_beat(node: str, zone: str = "us-east-1a") -> Heartbeat:
    """``SIM_BEAT`` of ``node`` as a real agent sends it (:func:`agent_shaped`)."""
    return agent_shaped(msgspec.structs.replace(SIM_BEAT, node_id=node), zone)


def test_agents_alike_share_their_labels_capabilities_and_settings() -> None:
    """Nodes that send an agent's labels, capabilities and settings status alike hold one
    object of each for the fleet, loaded or judged, first heartbeat or steady one (a
    node of 9 labels cost 2,000 bytes more than one without, 200 MB at 100,000 nodes);
    the slim heartbeat leaves out ``started`` and ``previous_ts``, which the whole
    record written and served keeps; a node of another zone keeps its own labels."""

    def stored(node: str) -> bytes:
        whole = record_rules.accepted(
            record_rules.pending_record(node, "c1"), agent_beat(node), "U", 1.0, 1, 1.0, None
        )
        return codec.encode(whole)

    values = [stored(f"n{index}") for index in range(200)]
    bodies = packing.Bodies()
    bodies.pack(codec.encode(agent_beat("n-first")))  # the dictionary: the fleet's first
    per_node, states = kept_per_node(values, bodies)
    sim_bodies = packing.Bodies()
    sim_bodies.pack(codec.encode(SIM_BEAT))
    sim_values = [
        codec.encode(
            record_rules.accepted(
                record_rules.pending_record(f"s{index}", "c1"),
                codec.decode(codec.encode(SIM_BEAT), Heartbeat),
                "U",
                1.0,
                1,
                1.0,
                None,
            )
        )
        for index in range(200)
    ]
    sim_per_node, _ = kept_per_node(sim_values, sim_bodies)
    assert per_node < sim_per_node + 100, (per_node, sim_per_node)
    first, second = (state.record for state in states[:2])
    assert first.heartbeat is not None and second.heartbeat is not None
    assert first.labels is second.labels is first.heartbeat.labels is second.heartbeat.labels
    assert first.heartbeat.capabilities is second.heartbeat.capabilities
    assert first.heartbeat.settings is second.heartbeat.settings
    assert first.heartbeat.started is None and first.heartbeat.previous_ts is None
    whole = codec.decode(values[0], NodeRecord)
    gpus = states[0].gpus
    assert codec.decode(hot_state.encoded(first, states[0].body, gpus, bodies), NodeRecord) == whole
    assert hot_state.full(first, states[0].body, gpus, bodies) == whole

    def next_beat(node: str, zone: str) -> Heartbeat:
        return msgspec.structs.replace(agent_beat(node, zone), seq=SIM_BEAT.seq + 1)

    steady = judged(states[0], next_beat("n0", "us-east-1a"), stream_seq=2)
    fresh = judged(None, next_beat("n-new", "us-east-1a"), stream_seq=2)
    elsewhere = judged(None, next_beat("n-other", "us-west-2b"), stream_seq=2)
    for record in (steady, fresh):
        assert record.heartbeat is not None
        assert record.labels is record.heartbeat.labels is first.labels
        assert record.heartbeat.capabilities is first.heartbeat.capabilities
        assert record.heartbeat.settings is first.heartbeat.settings
    assert elsewhere.labels is not first.labels
    assert elsewhere.labels == {**first.labels, "zone": "us-west-2b", "region": "us-east-1"}


def test_a_node_sending_new_labels_every_beat_keeps_its_own_once_the_fleets_are_full(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The fleet's shared labels, capabilities and settings are bounded: a node that makes
    up new ones each heartbeat fills them up to the bound, then keeps its own, each
    equal to what it sent; one longer than SHARED_BYTES encoded is never kept."""
    for name in ("LABELS", "CAPABILITIES", "SETTINGS"):
        monkeypatch.setattr(hot_state, name, SharedByKey(4))
    record = hot_state.slim(
        record_rules.accepted(
            record_rules.pending_record("n1", "c1"), agent_beat("n1"), "U", 1.0, 1, 1.0, None
        )
    )
    for step in range(20):
        beat = msgspec.structs.replace(
            agent_beat("n1"),
            labels={"rack": f"r{step}"},
            capabilities=[f"engine{step}"],
            settings=SettingsStatus(revision=step),
        )
        kept = hot_state.slim_heartbeat(beat, record)
        assert kept.labels == {"rack": f"r{step}"}
        assert kept.capabilities == [f"engine{step}"]
        assert kept.settings == SettingsStatus(revision=step)
    assert len(hot_state.LABELS) == len(hot_state.CAPABILITIES) == len(hot_state.SETTINGS) == 4
    monkeypatch.setattr(hot_state, "LABELS", SharedByKey(4))
    long = {f"key{index}": "v" * 120 for index in range(10)}
    kept = hot_state.slim_heartbeat(msgspec.structs.replace(agent_beat("n1"), labels=long), record)
    assert kept.labels == long and len(hot_state.LABELS) == 0


def test_a_shared_duration_is_positive_and_the_cache_bounded() -> None:
    """Only positive durations are shared (-0.0 keeps its sign), and a node sending a new
    interval every heartbeat adds at most SHARED_FLOATS of them."""
    assert str(hot_state.shared_duration(-0.0)) == "-0.0"
    for step in range(hot_state.SHARED_FLOATS + 50):
        hot_state.shared_duration(1000.0 + step / 7)
    assert len(hot_state.DURATIONS) <= hot_state.SHARED_FLOATS
    fresh = float("1234.5678")
    assert hot_state.shared_duration(fresh) == fresh
