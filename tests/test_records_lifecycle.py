"""Pure aggregator rules for the node lifecycle: interruption and deregistered alerts."""

from __future__ import annotations

import msgspec

from actors import records
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
    record = records.accept(records.pending_record("n1", "c1"), beat(1), "U", 1.0)
    first = records.lifecycle_alerts(record, beat(2, notice))
    assert [(kind, details["event"]) for kind, _, details in first] == [
        ("interruption", "aws:terminate:e1")
    ]
    record = records.accept(record, beat(2, notice), "U", 2.0)
    assert records.lifecycle_alerts(record, beat(3, msgspec.structs.replace(notice, ts=9.0))) == []
    other = msgspec.structs.replace(notice, kind="rebalance", event_id="e2")
    assert [kind for kind, _, _ in records.lifecycle_alerts(record, beat(3, other))] == [
        "interruption"
    ]


def test_deregistering_heartbeat_marks_record() -> None:
    """A heartbeat that says deregistering makes the record deregistered, with one alert."""
    record = records.accept(records.pending_record("n1", "c1"), beat(1), "U", 1.0)
    alerts = records.lifecycle_alerts(record, beat(2, deregistering=True))
    assert [kind for kind, _, _ in alerts] == ["deregistered"]
    record = records.accept(record, beat(2, deregistering=True), "U", 2.0)
    assert record.state == "deregistered"
    assert records.lifecycle_alerts(record, beat(3, deregistering=True)) == []
