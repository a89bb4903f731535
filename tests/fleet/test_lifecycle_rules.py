"""Pure rules of issue 9's lifecycle: key epochs, deregistered nodes beating, refused
nodes going stale, GPU fingerprints, and the refusal bookkeeping."""

from __future__ import annotations

import msgspec

from actors.fleet import record_state
from actors.fleet.aggregator import alert_rules, record_rules
from actors.fleet.aggregator.refusals import MAX_TRACKED, RefusalTracker, mark_refused
from actors.fleet.aggregator.silence import StreamPulse
from actors.fleet.aggregator.sweeps import bus_silent, refused_silent, silent_without_marker
from schemas.events import Capacity, Gpu, Health, Sample
from schemas.messages import Heartbeat, NodeRecord
from tests.support.fleet import heartbeat


def gpus(*uuids: str) -> Sample:
    capacity = Capacity(
        cpu_cores=1,
        cpu_percent=0,
        load_avg_1m=0,
        memory_total=1,
        memory_available=1,
        gpus_total=len(uuids),
        gpus_available=len(uuids),
        storage_total=1,
        storage_available=1,
    )
    return Sample(
        ts=1.0,
        capacity=capacity,
        gpus=[
            Gpu(
                index=i,
                uuid=u,
                name="H100",
                pci_bus_id=f"0:{i}",
                memory_total=80,
                memory_used=0,
            )
            for i, u in enumerate(uuids)
        ],
    )


def accepted(beat: Heartbeat, key: str = "UOLD", now: float = 100.0) -> NodeRecord:
    pending = record_rules.pending_record("n1", "c1", key)
    return record_rules.with_lifecycle(pending, record_rules.accept(pending, beat, key, now), beat)


def test_a_new_key_starts_a_new_sequence_epoch() -> None:
    """Under the key of the last accepted beat a low seq is a replay; under another
    (newly approved) key any seq is accepted, and the record then holds the new key."""
    record = accepted(heartbeat(seq=5000), key="UOLD")
    assert record_rules.judge_seq(record, 1, 10_000, "UOLD") == "replay"
    assert record_rules.judge_seq(record, 1, 10_000, "UNEW") == "next"
    assert record_rules.judge_seq(record, 1, 10_000) == "replay"
    after = record_rules.accept(record, heartbeat(seq=1), "UNEW", 200.0)
    assert after.public_key == "UNEW" and after.last_seq == 1
    assert record_rules.judge_seq(after, 1, 10_000, "UNEW") == "replay"


def test_a_deregistered_record_refuses_all_but_deregistering_beats() -> None:
    """Deregistering beats of the leaving agent pass; any other beat is refused with an
    alert whose event is the boot id (once per boot)."""
    record = accepted(heartbeat(seq=1))
    left = accepted(heartbeat(seq=2, deregistering=True, schedulability_reason="bye"))
    assert left.deregistered and left.deregistered_by == "node"
    assert left.deregistered_reason == "bye"
    assert alert_rules.deregistered_refusal(record, heartbeat(seq=3)) is None
    assert alert_rules.deregistered_refusal(left, heartbeat(seq=3, deregistering=True)) is None
    spec = alert_rules.deregistered_refusal(left, heartbeat(seq=3, boot_id="b2"))
    assert spec is not None and spec.kind == "deregistered_node_beating"
    assert spec.details["event"] == "b2"


def test_hardware_change_names_before_and_after() -> None:
    """A GPU swapped (uuid changed) or gone raises hardware_changed with both lists; the
    same set raises nothing; the record keeps the current fingerprint."""
    record = accepted(heartbeat(seq=1, sample=gpus("GPU-a", "GPU-b")))
    assert record.gpu_fingerprint == ["GPU-a", "GPU-b"]
    same = heartbeat(seq=2, sample=gpus("GPU-b", "GPU-a"))
    assert alert_rules.hardware_alert(record, same) is None
    assert alert_rules.hardware_alert(record, heartbeat(seq=2)) is None  # no sample
    swapped = alert_rules.hardware_alert(record, heartbeat(seq=2, sample=gpus("GPU-a", "GPU-c")))
    assert swapped is not None and swapped.kind == "hardware_changed"
    assert swapped.details["before"] == "GPU-a,GPU-b"
    assert swapped.details["after"] == "GPU-a,GPU-c"
    assert swapped.details["gone"] == "GPU-b" and swapped.details["new"] == "GPU-c"
    gone = alert_rules.hardware_alert(record, heartbeat(seq=2, sample=gpus("GPU-a")))
    assert gone is not None and gone.details["after"] == "GPU-a" and gone.severity == "critical"
    updated = record_rules.with_lifecycle(
        record,
        record_rules.accept(record, heartbeat(seq=2, sample=gpus("GPU-a")), "UOLD", 101.0),
        heartbeat(seq=2, sample=gpus("GPU-a")),
    )
    assert updated.gpu_fingerprint == ["GPU-a"]


def test_refusal_is_noted_rate_limited_and_cleared_by_an_accepted_beat() -> None:
    """mark_refused writes a new kind at once, the same kind again only after ``every``;
    accepting a beat clears it."""
    record = accepted(heartbeat(seq=1))
    noted = mark_refused(record, "unknown_node", 200.0, 30.0)
    assert noted is not None and noted.refused == "unknown_node"
    assert mark_refused(noted, "unknown_node", 210.0, 30.0) is None
    assert mark_refused(noted, "replay", 210.0, 30.0) is not None
    assert mark_refused(noted, "unknown_node", 231.0, 30.0) is not None
    assert mark_refused(None, "unknown_node", 1.0, 30.0) is None
    beat = heartbeat(seq=2)
    cleared = record_rules.with_lifecycle(
        noted, record_rules.accept(noted, beat, "UOLD", 240.0), beat
    )
    assert cleared.refused == "" and cleared.refused_at is None


def test_refused_silent_after_stale_after() -> None:
    """A live record is refused-silent once its last accepted beat is stale_after old;
    stale or deregistered records are not."""
    record = accepted(heartbeat(seq=1, stale_after=2.0), now=100.0)
    assert not refused_silent(record, 101.9)
    assert refused_silent(record, 102.0)
    assert not refused_silent(record_state.with_state(record, stale_since=101.0), 200)
    gone = msgspec.structs.replace(record, deregistered=True)
    assert not refused_silent(gone, 200.0)


def test_a_refused_node_waits_out_a_silent_stream_up_to_the_outage_bound() -> None:
    """A refused node's silence is maybe the bus's while the stream stored nothing for
    half its stale_after before now; not once the stream flows again, nor past
    stale_after plus bus_outage_max after its last accepted beat."""
    record = accepted(heartbeat(seq=1, stale_after=4.0), now=100.0)
    pulse = StreamPulse()
    pulse.stored(100.2)
    assert bus_silent(record, pulse, 104.5, 300.0, 30.0)
    for second in range(105, 108):
        pulse.stored(second + 0.1)
    assert not bus_silent(record, pulse, 108.5, 300.0, 30.0)
    assert not bus_silent(record, StreamPulse(), 134.0, 300.0, 30.0)  # past the bound
    assert bus_silent(record, StreamPulse(), 133.9, 300.0, 30.0)


def test_silence_is_judged_by_the_aggregators_bound_not_the_nodes_claim() -> None:
    """A node claiming a day of stale_after is silent, for both sweeps, once the
    aggregator's bound (here 5 s) has passed: twice it plus the grace for the full sweep,
    once it for a refused node."""
    record = accepted(heartbeat(seq=1, stale_after=86_400.0), now=100.0)
    assert not silent_without_marker(record, 110.9, 1.0, 5.0)
    assert silent_without_marker(record, 111.1, 1.0, 5.0)
    assert not silent_without_marker(record, 111.1, 1.0, 86_400.0)
    assert not refused_silent(record, 104.9, 5.0)
    assert refused_silent(record, 105.0, 5.0)


def test_refusal_tracker_notes_boots_and_stays_bounded() -> None:
    """Notes once per kind and interval, raises deregistered_node_beating once per boot,
    forgets a node accepted again, and never holds more than MAX_TRACKED nodes."""
    tracker = RefusalTracker(note_every=10.0)
    assert tracker.should_note("n1", "replay", 0.0)
    assert not tracker.should_note("n1", "replay", 5.0)
    assert tracker.should_note("n1", "unknown_node", 5.0)
    assert tracker.should_note("n1", "unknown_node", 15.1)
    assert tracker.first_of_boot("n1", "b1") and not tracker.first_of_boot("n1", "b1")
    assert tracker.first_of_boot("n1", "b2")
    tracker.on_refused("n1")
    tracker.on_accepted("n1")
    assert "n1" not in tracker.refused
    for index in range(MAX_TRACKED + 5):
        tracker.on_refused(f"n{index}")
    assert len(tracker.refused) == MAX_TRACKED and "n0" not in tracker.refused


def test_a_gpu_set_from_none_to_some_is_a_hardware_change() -> None:
    """A node whose samples named no GPU (NVML failing) and then name some raises
    hardware_changed; before any sample, a first set is not a change."""
    failing = accepted(heartbeat(seq=1, sample=gpus()))
    assert failing.gpus_seen and failing.gpu_fingerprint == []
    back = alert_rules.hardware_alert(failing, heartbeat(seq=2, sample=gpus("GPU-a")))
    assert back is not None and back.details["new"] == "GPU-a" and back.details["before"] == ""
    unsampled = accepted(heartbeat(seq=1))
    assert not unsampled.gpus_seen
    assert alert_rules.hardware_alert(unsampled, heartbeat(seq=2, sample=gpus("GPU-a"))) is None


def test_a_node_unhealthy_from_its_first_report_raises_health() -> None:
    """A first health report that is not healthy raises `health` (none -> unhealthy);
    a healthy first report raises nothing."""
    pending = record_rules.pending_record("n1", "c1", "U")
    sick = heartbeat(seq=1, health=Health(ts=1.0, status="unhealthy", score=10))
    after = record_rules.accept(pending, sick, "U", 100.0)
    kinds = [
        (a.kind, a.details.get("from"), a.severity)
        for a in alert_rules.heartbeat_alerts(pending, after, sick)
    ]
    assert ("health", "none", "critical") in kinds
    well = heartbeat(seq=1, health=Health(ts=1.0, status="healthy", score=100))
    after = record_rules.accept(pending, well, "U", 100.0)
    assert [a.kind for a in alert_rules.heartbeat_alerts(pending, after, well)] == []
