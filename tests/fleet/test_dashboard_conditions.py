"""The dashboard's alerts as conditions: repeats counted, storms grouped, resolutions by
alert, by the fleet's state and by quiet, the filters, and the memory bound."""

from __future__ import annotations

import msgspec

from actors.fleet.views.dashboard.conditions import (
    KEEP_RESOLVED,
    QUIET,
    Conditions,
    Filter,
    Now,
)
from schemas.messages import Alert, NodeRecord


def alert(node: str, kind: str, ts: float, **changes: object) -> Alert:
    """An alert of ``kind`` about ``node`` in cluster c1 at ``ts``."""
    made = Alert(
        id=f"{node}-{kind}-{ts}",
        kind=kind,  # type: ignore[arg-type]
        node_id=node,
        cluster="c1",
        severity="warning",
        message=f"{kind} {node}",
        ts=ts,
    )
    return msgspec.structs.replace(made, **changes)


def record(node: str, state: str, **changes: object) -> NodeRecord:
    made = NodeRecord(node_id=node, cluster="c1", state=state, last_seq=1, last_seen=1.0)
    return msgspec.structs.replace(made, **changes)


def fleet_of(*records: NodeRecord, **facts: object) -> Now:
    """What the fleet says now: these records, and ``facts`` (needs_attention, tripped)."""
    by_node = {made.node_id: made for made in records}
    return Now(record=by_node.get, **facts)  # type: ignore[arg-type]


def test_repeats_are_counted_in_one_row_with_the_latest_message() -> None:
    """Eight dry-run lines for one node are one row, x8, saying the latest; another
    node's is its own row; the newest first."""
    conditions = Conditions()
    for second in range(8):
        conditions.add(alert("n1", "remediation", 100.0 + second, message=f"dry run {second}"))
    conditions.add(alert("n2", "remediation", 105.0))
    rows = conditions.rows(110.0, fleet_of())
    assert [(row.nodes, row.count, row.message) for row in rows] == [
        (["n1"], 8, "dry run 7"),
        (["n2"], 1, "remediation n2"),
    ]
    assert rows[0].since == 100.0 and rows[0].last == 107.0 and rows[0].resolved_at is None


def test_a_storm_is_one_row_listing_its_nodes() -> None:
    """20 nodes stale in one cluster are one row naming the count, the cluster and every
    node; a critical condition elsewhere comes first."""
    conditions = Conditions()
    stale = [record(f"sim-{i:02}", "stale") for i in range(20)]
    for number, made in enumerate(stale):
        conditions.add(alert(made.node_id, "stale", 100.0 + number))
    conditions.add(alert("n1", "health", 90.0, severity="critical", details={"to": "unhealthy"}))
    rows = conditions.rows(
        130.0, fleet_of(*stale, record("n1", "unhealthy", health_status="unhealthy"))
    )
    assert len(rows) == 2
    assert rows[0].kind == "health" and rows[0].severity == "critical"
    storm = rows[1]
    assert storm.message.startswith("20 nodes stale in c1")
    assert storm.nodes == [made.node_id for made in stale] and storm.count == 20
    assert storm.since == 100.0 and storm.last == 119.0


def test_silence_resolves_by_recovered_and_by_the_record() -> None:
    """stale then offline is one condition; recovered resolves it (greyed, kept), a record
    no longer silent resolves another, and a resolved one goes after KEEP_RESOLVED."""
    conditions = Conditions()
    conditions.add(alert("n1", "stale", 100.0))
    conditions.add(alert("n1", "offline", 110.0, severity="critical"))
    conditions.add(alert("n2", "stale", 100.0))
    silent = fleet_of(record("n1", "offline"), record("n2", "stale"))
    first, _ = conditions.rows(120.0, silent)
    assert first.kind == "offline" and first.count == 2 and first.severity == "critical"
    conditions.add(alert("n1", "recovered", 130.0))
    back = fleet_of(record("n1", "active"), record("n2", "active", last_seen=135.0))
    rows = {row.nodes[0]: row for row in conditions.rows(140.0, back)}
    assert rows["n1"].resolved_at == 130.0, "the recovered alert's time"
    assert rows["n2"].resolved_at == 140.0, "the record says it is over"
    assert conditions.rows(140.0 + KEEP_RESOLVED + 1, back) == []


def test_a_record_older_than_the_alert_settles_nothing() -> None:
    """The pages' snapshot may predate an alert: a record still active, written before
    the node went stale or degraded, leaves the condition firing; the node's next
    heartbeat (a record written after the alert) resolves it."""
    conditions = Conditions()
    conditions.add(alert("n1", "stale", 100.0))
    conditions.add(alert("n2", "health", 100.0, details={"to": "degraded"}))
    before = fleet_of(record("n1", "active", last_seen=98.0), record("n2", "active"))
    assert [row.resolved_at for row in conditions.rows(101.0, before)] == [None, None]
    after = fleet_of(
        record("n1", "active", last_seen=102.0),
        record("n2", "active", health_status="healthy", last_seen=99.0, last_stored=102.5),
    )
    assert [row.resolved_at for row in conditions.rows(103.0, after)] == [103.0, 103.0]


def test_health_resolves_when_healthy_again() -> None:
    """A health alert to degraded opens a condition; one back to healthy resolves it; the
    next one to unhealthy opens a new one."""
    conditions = Conditions()
    sick = record("n1", "degraded", health_status="degraded")
    conditions.add(alert("n1", "health", 100.0, details={"to": "degraded"}))
    assert [row.resolved_at for row in conditions.rows(101.0, fleet_of(sick))] == [None]
    conditions.add(alert("n1", "health", 102.0, details={"to": "healthy"}, severity="info"))
    assert [row.resolved_at for row in conditions.rows(103.0, fleet_of(sick))] == [102.0]
    conditions.add(alert("n1", "health", 104.0, details={"to": "unhealthy"}, severity="critical"))
    worse = record("n1", "unhealthy", health_status="unhealthy")
    rows = conditions.rows(105.0, fleet_of(worse))
    assert [(row.since, row.count, row.resolved_at) for row in rows] == [(104.0, 1, None)]


def test_events_resolve_when_quiet_and_policy_kinds_by_the_policy() -> None:
    """A refused-heartbeat kind resolves QUIET seconds after its last repeat; the policy's
    needs_attention and breaker_tripped hold while the policy's records say so."""
    conditions = Conditions()
    conditions.add(alert("n1", "replay", 100.0))
    conditions.add(alert("n2", "needs_attention", 100.0))
    conditions.add(alert("_cluster", "breaker_tripped", 100.0))
    held = fleet_of(needs_attention={("c1", "n2")}, tripped={"c1"})
    assert all(row.resolved_at is None for row in conditions.rows(100.0 + QUIET, held))
    rows = {row.kind: row for row in conditions.rows(101.0 + QUIET, held)}
    assert rows["replay"].resolved_at == 101.0 + QUIET
    assert rows["needs_attention"].resolved_at is None
    cleared = {row.kind: row for row in conditions.rows(102.0 + QUIET, fleet_of())}
    assert cleared["needs_attention"].resolved_at == cleared["breaker_tripped"].resolved_at


def test_filters_choose_by_severity_and_kind() -> None:
    """Only the rows of the severity and the kind asked for."""
    conditions = Conditions()
    conditions.add(alert("n1", "replay", 100.0, severity="critical"))
    conditions.add(alert("n2", "anomaly", 100.0))
    now = fleet_of()
    critical = conditions.rows(101.0, now, Filter(severities=frozenset({"critical"})))
    assert [row.kind for row in critical] == ["replay"]
    anomalies = conditions.rows(101.0, now, Filter(kinds=frozenset({"anomaly"})))
    assert [row.nodes for row in anomalies] == [["n2"]]


def test_conditions_are_bounded_and_the_dropped_counted() -> None:
    """Past the limit the oldest resolved go first, then the oldest; each is counted."""
    conditions = Conditions(limit=3)
    conditions.add(alert("n1", "stale", 1.0))
    conditions.add(alert("n1", "recovered", 2.0))
    for node in ("n2", "n3", "n4"):
        conditions.add(alert(node, "replay", 3.0))
    assert sorted(node for node, _ in conditions.held) == ["n2", "n3", "n4"]
    conditions.add(alert("n5", "replay", 4.0))
    assert sorted(node for node, _ in conditions.held) == ["n3", "n4", "n5"]
    assert conditions.dropped == 2
