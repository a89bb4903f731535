"""Pure rules of the aggregator: a node's record state and what a heartbeat does to it.

Kept apart from the actor so every rule is testable without a server.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import msgspec

from schemas.base import RecordState
from schemas.events import Health, notice_key
from schemas.messages import AlertKind, Heartbeat, NodeRecord, Severity


class AlertSpec(NamedTuple):
    """An alert to raise: kind, message, details (``event`` in details names its id), and
    a severity when it is not the kind's own."""

    kind: AlertKind
    message: str
    details: dict[str, str]
    severity: Severity | None = None


ANOMALY_FACTOR = 2.5
"""A heartbeat later than this many intervals after the previous one is an anomaly."""
MARKER_TOLERANCE = 1.0
"""Seconds a TTL marker may come before its heartbeat's ``stale_after`` ran out (clocks
of the servers of a cluster differ a little)."""

SeqVerdict = Literal["next", "replay", "jump"]


HELD_STATES: dict[str, RecordState] = {
    "drained": "drained",
    "draining": "draining",
    "cordoned": "cordoned",
}
"""The schedulabilities that are also record states. A record's schedulability is read as
an open string (a newer agent may report one this version does not know): an unknown one
holds no state of its own, so the node's other facts decide."""


def derive_state(record: NodeRecord) -> RecordState:
    """deregistered > offline > stale > drained > draining > cordoned > unhealthy >
    degraded > active > pending, each from its own fact in the record. What an operator
    did to the node (cordon, drain) outranks its health: it says the node is being dealt
    with."""
    if record.deregistered:
        return "deregistered"
    if record.offline_since is not None:
        return "offline"
    if record.stale_since is not None:
        return "stale"
    held = HELD_STATES.get(record.schedulability)
    if held is not None:
        return held
    if record.health_status == "unhealthy":
        return "unhealthy"
    if record.health_status == "degraded":
        return "degraded"
    if record.last_seq > 0:
        return "active"
    return "pending"


def with_state(record: NodeRecord, **changes: object) -> NodeRecord:
    """``record`` with ``changes`` applied and ``state`` derived again."""
    updated = msgspec.structs.replace(record, **changes)
    return msgspec.structs.replace(updated, state=derive_state(updated))


def pending_record(
    node_id: str, cluster: str, public_key: str = "", since: float | None = None
) -> NodeRecord:
    return NodeRecord(
        node_id=node_id,
        cluster=cluster,
        state="pending",
        last_seq=0,
        last_seen=0.0,
        public_key=public_key,
        pending_since=since,
        created=since,
    )


def judge_seq(record: NodeRecord, seq: int, max_jump: int) -> SeqVerdict:
    """``next`` if ``seq`` may follow the record's last accepted one: above it, by at most
    ``max_jump`` (one forged or corrupt seq near 2**63 must not lock the node out for
    good), or anything after an operator's ``reset-seq``. ``replay`` at or below it,
    ``jump`` too far above it."""
    if record.seq_reset:
        return "next"
    if seq <= record.last_seq:
        return "replay"
    if record.last_seq > 0 and seq - record.last_seq > max_jump:
        return "jump"
    return "next"


def marker_is_real(record: NodeRecord | None, marked_at: float, body: bytes) -> bool:
    """Whether a message with ``Nats-Marker-Reason`` can be the server's TTL marker for
    ``record``'s node: real markers have no body and come only once the last accepted
    heartbeat's ``stale_after`` has run out since the stream stored it. Any client may
    publish such a header, so one on a live node is a forgery."""
    if body or record is None or record.heartbeat is None:
        return False
    stored = record.last_stored if record.last_stored is not None else record.last_seen
    return marked_at - stored >= record.heartbeat.stale_after - MARKER_TOLERANCE


def silent_without_marker(record: NodeRecord, now: float, grace: float) -> bool:
    """A live record whose node has sent nothing for twice its ``stale_after`` plus
    ``grace``, though no TTL marker came: the marker was lost (a node's ``Nats-Rollup:
    all`` heartbeat purges every subject of FLEET_HB, markers pending included, and the
    server cannot be told to refuse rollups on a stream with delete markers). Twice, and
    the grace, so a slow aggregator behind the stream does not call a live node stale."""
    if record.heartbeat is None or record.stale_since is not None or record.deregistered:
        return False
    return now - record.last_seen > 2 * record.heartbeat.stale_after + grace


def pending_expired(record: NodeRecord, now: float, after: float) -> bool:
    """A registration nobody approved (no heartbeat ever accepted) older than ``after``."""
    return (
        record.state == "pending"
        and record.last_seq == 0
        and record.pending_since is not None
        and now - record.pending_since > after
    )


def accept(
    record: NodeRecord,
    heartbeat: Heartbeat,
    public_key: str,
    now: float,
    stream_seq: int = 0,
    stored: float | None = None,
) -> NodeRecord:
    """The record after a valid heartbeat: facts refreshed, stale/offline cleared, a
    sequence reset used up. A heartbeat without a health report (the first ones after an
    agent starts) keeps the last reported health: a restart neither heals nor forgets."""
    health = heartbeat.health
    return with_state(
        record,
        cluster=heartbeat.cluster,
        last_seq=heartbeat.seq,
        last_seen=now,
        boot_id=heartbeat.boot_id,
        public_key=public_key,
        schedulability=heartbeat.schedulability,
        health_status=health.status if health else record.health_status,
        health_score=health.score if health else record.health_score,
        gpus_total=len(heartbeat.sample.gpus) if heartbeat.sample else 0,
        stale_since=None,
        offline_since=None,
        deregistered=heartbeat.deregistering,
        agent_version=heartbeat.agent_version,
        heartbeat=heartbeat,
        last_stream_seq=stream_seq,
        last_stored=stored,
        pending_since=None,
        seq_reset=False,
        created=record.created if record.created is not None else now,
    )


def lifecycle_alerts(previous: NodeRecord, heartbeat: Heartbeat) -> list[AlertSpec]:
    """``interruption`` for a spot notice not in the previous heartbeat, ``deregistered``
    when the node says it is leaving; each with a deterministic ``event`` for its id."""
    alerts: list[AlertSpec] = []
    notice = heartbeat.spot.notice if heartbeat.spot else None
    spot_before = previous.heartbeat.spot if previous.heartbeat else None
    before = spot_before.notice if spot_before else None
    if notice is not None and (before is None or notice_key(before) != notice_key(notice)):
        key = notice_key(notice)
        details = {"event": key, "provider": notice.provider, "notice": notice.kind}
        if notice.deadline is not None:
            details["deadline"] = f"{notice.deadline:.0f}"
        alerts.append(AlertSpec("interruption", f"{notice.provider} {notice.kind} notice", details))
    if heartbeat.deregistering and not previous.deregistered:
        alerts.append(
            AlertSpec(
                "deregistered",
                f"node deregistered ({heartbeat.schedulability_reason or 'no reason given'})",
                {"event": heartbeat.boot_id},
            )
        )
    return alerts


def heartbeat_alerts(
    previous: NodeRecord,
    updated: NodeRecord,
    heartbeat: Heartbeat,
    gaps_are_news: bool = True,
) -> list[AlertSpec]:
    """What accepting ``heartbeat`` tells operators: recovered, sequence_gap, anomaly,
    health changes, interruption and deregistered. ``gaps_are_news`` is False while the
    aggregator is behind the stream, where skipped heartbeats are its own doing."""
    alerts: list[AlertSpec] = []
    if previous.state in ("stale", "offline"):
        alerts.append(AlertSpec("recovered", f"heartbeats resumed after {previous.state}", {}))
    same_boot = previous.boot_id == heartbeat.boot_id
    if gaps_are_news and same_boot and heartbeat.seq > previous.last_seq + 1:
        missed = heartbeat.seq - previous.last_seq - 1
        alerts.append(
            AlertSpec(
                "sequence_gap",
                f"{missed} heartbeat(s) missing",
                {"from": str(previous.last_seq), "to": str(heartbeat.seq)},
            )
        )
    # Spacing between two consecutive beats as the node sent them: the aggregator's own
    # lag cannot make a node look irregular.
    last = previous.heartbeat
    consecutive = last is not None and same_boot and heartbeat.seq == last.seq + 1
    spacing = heartbeat.ts - last.ts if last is not None else 0.0
    if consecutive and spacing > ANOMALY_FACTOR * heartbeat.interval:
        alerts.append(
            AlertSpec(
                "anomaly",
                f"{spacing:.1f}s between consecutive heartbeats (interval {heartbeat.interval:g}s)",
                {},
            )
        )
    if previous.health_status is not None and updated.health_status != previous.health_status:
        alerts.append(health_alert(previous.health_status, updated, heartbeat.health))
    return alerts + lifecycle_alerts(previous, heartbeat)


HEALTH_SEVERITY: dict[str, Severity] = {
    "unhealthy": "critical",
    "degraded": "warning",
    "healthy": "info",
}
"""A health alert's severity follows where the node went; a status this version does not
know is a warning."""


def health_alert(before: str, updated: NodeRecord, health: Health | None) -> AlertSpec:
    """``health <before> -> <after> (score N)``, then every failing check and every
    component short of its points, each with its reason: the alert says what happened,
    not only that something did. Details name them for machines, with the checks'
    recommended actions."""
    after = updated.health_status or "unknown"
    message = f"health {before} -> {after} (score {updated.health_score})"
    failing = [c for c in health.checks if c.status in ("degraded", "unhealthy")] if health else []
    short = [c for c in health.components if c.points < c.max_points] if health else []
    findings = [f"{c.name} {c.status}: {c.reason}" for c in failing]
    findings += [f"{c.name} {c.points}/{c.max_points}: {c.reason}" for c in short]
    if findings:
        message += ": " + "; ".join(findings)
    details = {"from": before, "to": after, "score": str(updated.health_score)}
    if failing:
        details["checks"] = ",".join(c.name for c in failing)
        actions = [c.action for c in failing if c.action]
        if actions:
            details["action"] = "; ".join(actions)
    if short:
        details["components"] = ",".join(c.name for c in short)
    return AlertSpec("health", message, details, HEALTH_SEVERITY.get(after, "warning"))


def checkpoint(stored: NodeRecord | None, mine: NodeRecord, reset_consumed: bool) -> NodeRecord:
    """What the partition owner writes over ``stored`` (the record in ``fleet_nodes``)
    from its in-memory ``mine``: its own, except that an operator's ``reset-seq`` written
    since (``stored.seq_reset``) is kept unless a heartbeat already used it up."""
    if stored is not None and stored.seq_reset and not mine.seq_reset and not reset_consumed:
        return msgspec.structs.replace(mine, seq_reset=True)
    return mine


def is_transition(previous: NodeRecord, updated: NodeRecord) -> bool:
    """Whether accepting a heartbeat changed what readers of ``fleet_nodes`` act on (the
    state and the facts it is derived from, the node's identity), so the owner writes the
    record at once rather than at its next checkpoint. ``last_seen``, ``last_seq`` and the
    embedded heartbeat alone are not: they are checkpointed."""
    return (
        previous.state != updated.state
        or previous.health_status != updated.health_status
        or previous.schedulability != updated.schedulability
        or previous.deregistered != updated.deregistered
        or previous.boot_id != updated.boot_id
        or previous.cluster != updated.cluster
        or previous.public_key != updated.public_key
        or previous.agent_version != updated.agent_version
        or previous.seq_reset != updated.seq_reset
    )
