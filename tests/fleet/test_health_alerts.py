"""Health alerts say what happened and how bad it is; the record shows ``unhealthy``."""

from __future__ import annotations

import time

import pytest
from nats.aio.msg import Msg

from actors.fleet import record_state
from actors.fleet.aggregator import alert_rules, record_rules
from actors.runtime.bus import NatsBus
from schemas import codec
from schemas.base import HealthStatus
from schemas.events import Health, HealthCheck, HealthComponent, Inject
from schemas.messages import Alert, Heartbeat, NodeRecord
from schemas.subjects import EVENT_INJECT, Subjects
from tests.support.fleet import Fleet, wait_for, wait_record

XID_79 = HealthCheck(
    name="xid",
    status="unhealthy",
    reason="XID 79 on GPU 0: GPU has fallen off the bus",
    action="drain the node and reboot",
)
HOT = HealthCheck(name="nvml", status="degraded", reason="GPU 1 at 95 C (> 85 C)")
OK = HealthCheck(name="boot", status="ok", reason="2/2 GPUs answer")
COOKED = HealthComponent(name="gpu_temperature", points=0, max_points=20, reason="hottest 95 C")
FULL = HealthComponent(name="cpu", points=10, max_points=10, reason="CPU 5.0% busy")


def health(status: HealthStatus, score: int, *checks: HealthCheck) -> Health:
    return Health(ts=1.0, status=status, score=score, components=[COOKED, FULL], checks=[*checks])


def beat(seq: int, report: Health | None, boot_id: str = "b1") -> Heartbeat:
    return Heartbeat(
        node_id="n1",
        cluster="c1",
        seq=seq,
        boot_id=boot_id,
        ts=1000.0 + seq,
        agent_version="t",
        interval=1.0,
        stale_after=3.0,
        health=report,
    )


def step(record: NodeRecord, heartbeat: Heartbeat) -> tuple[NodeRecord, list[Alert]]:
    """Accept ``heartbeat`` and return the record and its health alerts, as published."""
    after = record_rules.accept(record, heartbeat, "U", 1000.0 + heartbeat.seq)
    alerts = [
        Alert(
            id="x",
            kind=spec.kind,
            node_id="n1",
            cluster="c1",
            severity=spec.severity or "warning",
            message=spec.message,
            ts=1.0,
            details=spec.details,
        )
        for spec in alert_rules.heartbeat_alerts(record, after, heartbeat)
        if spec.kind == "health"
    ]
    return after, alerts


def healthy_record() -> NodeRecord:
    start = record_rules.pending_record("n1", "c1")
    return record_rules.accept(start, beat(1, health("healthy", 100, OK)), "U", 1001.0)


@pytest.mark.parametrize(
    ("before", "after", "severity"),
    [
        (health("healthy", 100, OK), health("unhealthy", 49, OK, XID_79), "critical"),
        (health("healthy", 100, OK), health("degraded", 79, OK, HOT), "warning"),
        (health("unhealthy", 49, XID_79), health("degraded", 79, HOT), "warning"),
        (health("unhealthy", 49, XID_79), health("healthy", 100, OK), "info"),
        (health("degraded", 79, HOT), health("unhealthy", 30, XID_79), "critical"),
    ],
)
def test_severity_follows_the_transition(before: Health, after: Health, severity: str) -> None:
    """critical into unhealthy, warning into degraded (from either side), info on recovery."""
    record, _ = step(healthy_record(), beat(2, before))
    _, alerts = step(record, beat(3, after))
    assert [(alert.severity, alert.details["to"]) for alert in alerts] == [(severity, after.status)]


def test_health_alert_names_failing_checks_and_components_with_reasons() -> None:
    _, alerts = step(healthy_record(), beat(2, health("unhealthy", 40, OK, XID_79, HOT)))
    [alert] = alerts
    assert alert.message == (
        "health healthy -> unhealthy (score 40): "
        "xid unhealthy: XID 79 on GPU 0: GPU has fallen off the bus; "
        "nvml degraded: GPU 1 at 95 C (> 85 C); "
        "gpu_temperature 0/20: hottest 95 C"
    )
    assert alert.details == {
        "from": "healthy",
        "to": "unhealthy",
        "score": "40",
        "checks": "xid,nvml",
        "action": "drain the node and reboot",
        "components": "gpu_temperature",
    }


def test_restart_without_health_report_raises_no_alert_and_keeps_status() -> None:
    """The first heartbeats after an agent start carry no health report: no ``healthy ->
    None`` alert, and the record keeps the last status until a report comes."""
    record, alerts = step(healthy_record(), beat(2, None, boot_id="b2"))
    assert alerts == []
    assert (record.health_status, record.health_score, record.state) == ("healthy", 100, "active")
    record, alerts = step(record, beat(3, health("unhealthy", 40, XID_79), boot_id="b2"))
    assert [alert.details["to"] for alert in alerts] == ["unhealthy"]


def test_state_unhealthy_is_shown_apart_from_degraded() -> None:
    record, _ = step(healthy_record(), beat(2, health("unhealthy", 40, XID_79)))
    assert record.state == "unhealthy"
    record, _ = step(record, beat(3, health("degraded", 70, HOT)))
    assert record.state == "degraded"
    cordoned = record_state.with_state(record, health_status="unhealthy", schedulability="cordoned")
    assert cordoned.state == "cordoned"


async def test_injected_xid_79_raises_one_critical_alert_naming_the_check(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """End to end: XID 79 on a running agent makes the record ``unhealthy`` and raises a
    critical health alert naming the xid check; restarting the agent raises no health
    alert at all."""
    alerts: list[Alert] = []

    async def collect(msg: Msg) -> None:
        alerts.append(codec.decode(msg.data, Alert))

    await bus.subscribe(Subjects(prefix).alert("health", "c1", "n1"), collect)
    await bus.flush()
    await fleet.start_aggregator()
    agent = await fleet.start_agent()
    await wait_record(bus, prefix, "n1", lambda r: r.health_status == "healthy")
    fault = Inject(ts=time.time(), node_id="n1", fault="xid", gpu=0, value=79)
    await fleet.publish_event(EVENT_INJECT, fault)
    broken = await wait_record(bus, prefix, "n1", lambda r: r.state == "unhealthy")
    assert broken.health_status == "unhealthy"
    assert broken.health_score is not None and broken.health_score < 50
    await wait_for(lambda: alerts)
    [alert] = alerts
    assert alert.severity == "critical"
    assert alert.details["checks"] == "xid"
    assert "xid unhealthy: " in alert.message and "79" in alert.message

    await agent.stop()
    await fleet.start_agent()
    # The new run's fake GPUs have no XID: its first report is healthy, and that is the
    # one alert; the heartbeats before it (no report yet) raise none.
    healed = await wait_record(
        bus,
        prefix,
        "n1",
        lambda r: r.boot_id != broken.boot_id and r.health_status == "healthy",
    )
    await wait_record(bus, prefix, "n1", lambda r: r.last_seq > healed.last_seq + 2)
    await bus.flush()
    assert [(a.severity, a.details["from"], a.details["to"]) for a in alerts[1:]] == [
        ("info", "unhealthy", "healthy")
    ]
