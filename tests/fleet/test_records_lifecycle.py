"""Pure aggregator rules for the node lifecycle: interruption and deregistered alerts."""

from __future__ import annotations

import msgspec

from actors.fleet import record_state
from actors.fleet.aggregator import alert_rules, record_rules
from schemas.events import Interruption, SpotStatus
from schemas.messages import Heartbeat


def beat(seq: int, notice: Interruption | None = None, deregistering: bool = False) -> Heartbeat:
    return Heartbeat(
        node_id="n1",
        cluster="c1",
        seq=seq,
        boot_id="b1",
        ts=1000.0 + seq,
        agent_version="t",
        interval=1.0,
        stale_after=3.0,
        spot=SpotStatus(provider="aws", notice=notice) if notice else None,
        deregistering=deregistering,
    )


def test_interruption_alert_once_per_notice() -> None:
    """A notice raises one interruption alert with a deterministic event; repeating it in
    later heartbeats raises none; a different notice raises another."""
    notice = Interruption(ts=1.0, provider="aws", kind="terminate", deadline=2000.0, event_id="e1")
    record = record_rules.accept(record_rules.pending_record("n1", "c1"), beat(1), "U", 1.0)
    first = alert_rules.lifecycle_alerts(record, beat(2, notice))
    assert [(kind, details["event"]) for kind, _, details, _ in first] == [
        ("interruption", "aws:terminate:e1")
    ]
    record = record_rules.accept(record, beat(2, notice), "U", 2.0)
    assert (
        alert_rules.lifecycle_alerts(record, beat(3, msgspec.structs.replace(notice, ts=9.0))) == []
    )
    other = msgspec.structs.replace(notice, kind="rebalance", event_id="e2")
    assert [kind for kind, *_ in alert_rules.lifecycle_alerts(record, beat(3, other))] == [
        "interruption"
    ]


def test_deregistering_heartbeat_marks_record() -> None:
    """A heartbeat that says deregistering makes the record deregistered, with one alert."""
    record = record_rules.accept(record_rules.pending_record("n1", "c1"), beat(1), "U", 1.0)
    alerts = alert_rules.lifecycle_alerts(record, beat(2, deregistering=True))
    assert [kind for kind, *_ in alerts] == ["deregistered"]
    record = record_rules.accept(record, beat(2, deregistering=True), "U", 2.0)
    assert record.state == "deregistered"
    assert alert_rules.lifecycle_alerts(record, beat(3, deregistering=True)) == []


def test_state_precedence() -> None:
    """deregistered > offline > stale > drained > draining > cordoned > unhealthy >
    degraded > active > pending: each fact wins over every fact below it."""
    base = record_rules.accept(record_rules.pending_record("n1", "c1"), beat(1), "U", 1.0)
    assert record_rules.pending_record("n1", "c1").state == "pending"
    assert base.state == "active"
    layers: list[tuple[str, dict[str, object]]] = [
        ("degraded", {"health_status": "degraded"}),
        ("unhealthy", {"health_status": "unhealthy"}),
        ("cordoned", {"schedulability": "cordoned"}),
        ("draining", {"schedulability": "draining"}),
        ("drained", {"schedulability": "drained"}),
        ("stale", {"stale_since": 5.0}),
        ("offline", {"offline_since": 9.0}),
        ("deregistered", {"deregistered": True}),
    ]
    record = base
    for expected, change in layers:
        record = record_state.with_state(record, **change)
        assert record.state == expected


def test_heartbeat_alerts_recovered_gap_anomaly_health() -> None:
    """Accepting a beat after stale says recovered; skipped seqs in one boot are a gap
    (unless the aggregator is behind the stream); consecutive beats sent too far apart are
    an anomaly; a health change is named; a new boot is neither gap nor anomaly."""
    active = record_rules.accept(record_rules.pending_record("n1", "c1"), beat(1), "U", 100.0)
    later = beat(5)
    after = record_rules.accept(active, later, "U", 110.0)
    assert [k for k, *_ in alert_rules.heartbeat_alerts(active, after, later)] == ["sequence_gap"]
    assert alert_rules.heartbeat_alerts(active, after, later, gaps_are_news=False) == []

    stalled = msgspec.structs.replace(beat(2), ts=beat(1).ts + 10.0)  # interval is 1 s
    assert [(k, m) for k, m, *_ in alert_rules.heartbeat_alerts(active, after, stalled)] == [
        ("anomaly", "10.0s between consecutive heartbeats (interval 1s)")
    ]
    on_time = beat(2)
    assert alert_rules.heartbeat_alerts(active, after, on_time) == []

    stale = record_state.with_state(active, stale_since=105.0)
    assert [k for k, *_ in alert_rules.heartbeat_alerts(stale, after, beat(2))] == ["recovered"]

    rebooted = msgspec.structs.replace(beat(900), boot_id="b2", ts=5000.0)
    assert alert_rules.heartbeat_alerts(active, after, rebooted) == []

    healthy = record_state.with_state(active, health_status="healthy")
    sick = record_state.with_state(active, health_status="unhealthy", health_score=40)
    alerts = alert_rules.heartbeat_alerts(healthy, sick, beat(2))
    assert [(k, m) for k, m, *_ in alerts] == [("health", "health healthy -> unhealthy (score 40)")]
