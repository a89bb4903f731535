"""Which of a node's alerts a view shows when it has room for a few: a flood of ``info``
alerts (a policy's would-be actions, say) never pushes a warning or critical one out of
``fleetctl describe``, the dashboard's node page or its alert feed."""

from __future__ import annotations

from actors.fleet.alerts.publisher import AlertPublisher
from actors.fleet.views.history import AlertFeed, Entry, ranked, recent_history
from actors.runtime.bus import NatsBus
from schemas import codec
from schemas.messages import Alert, AlertKind, Severity
from schemas.subjects import Subjects
from tests.support.fleet import Fleet

NOW = 1_800_000_000.0


def alert(number: int, severity: Severity) -> Alert:
    kind: AlertKind = "remediation" if severity == "info" else "needs_attention"
    return Alert(
        id=f"a{number}",
        kind=kind,
        node_id="n1",
        cluster="c1",
        severity=severity,
        message=f"alert {number}",
        ts=NOW + number,
    )


def entry(number: int, severity: Severity) -> Entry:
    message = alert(number, severity)
    return Entry(ts=message.ts, subject="s", message=message, body=codec.encode(message))


def test_info_alerts_never_push_a_warning_out_of_a_view() -> None:
    """Of one critical alert followed by 30 info ones, a view of 10 keeps the critical and
    the 9 newest info ones, oldest first; with fewer alerts than room it keeps them all."""
    alerts = [entry(0, "critical"), *(entry(n, "info") for n in range(1, 31))]
    shown = ranked(alerts, 10)
    assert [e.ts - NOW for e in shown] == [0, *range(22, 31)]
    assert ranked(alerts[:4], 10) == alerts[:4]
    warnings = [entry(n, "warning") for n in range(12)]
    assert ranked([*warnings, entry(12, "info")], 10) == warnings[-10:]


def test_the_dashboard_feed_keeps_warnings_apart_from_an_info_flood() -> None:
    """A feed of 5 keeps its 2 warnings through 50 info alerts, in sequence order both
    ways."""
    feed = AlertFeed(5)
    feed.append((1, alert(1, "warning")))
    feed.append((2, alert(2, "critical")))
    for number in range(3, 53):
        feed.append((number, alert(number, "info")))
    assert [number for number, _ in feed] == [1, 2, 48, 49, 50, 51, 52]
    assert [number for number, _ in reversed(feed)] == [52, 51, 50, 49, 48, 2, 1]
    assert len(feed) == 7


async def test_recent_history_reads_past_the_flood(fleet: Fleet, bus: NatsBus, prefix: str) -> None:
    """What describe and the node page read of a node: a critical alert stored before 30
    info ones is among its 10 recent alerts (each publish was stored before the read)."""
    await fleet.start_aggregator()
    publisher = AlertPublisher(bus, Subjects(prefix))
    await publisher.publish("needs_attention", "c1", "n1", "cordon not taken", "x")
    for number in range(30):
        await publisher.publish("remediation", "c1", "n1", f"dry run {number}", f"d{number}")
    alerts, _ = await recent_history(bus, Subjects(prefix), "n1", 10)
    kinds = [e.message.kind for e in alerts if isinstance(e.message, Alert)]
    assert kinds == ["needs_attention", *["remediation"] * 9]
