"""Pure rules of the aggregator: a node's record state and what a heartbeat does to it.

Kept apart from the actor so every rule is testable without a server.
"""

from __future__ import annotations

import msgspec

from schemas.base import RecordState
from schemas.events import Interruption
from schemas.messages import AlertKind, Heartbeat, NodeRecord


def derive_state(record: NodeRecord) -> RecordState:
    """deregistered > offline > stale > drained > draining > cordoned > degraded > active >
    pending, each from its own fact in the record."""
    if record.deregistered:
        return "deregistered"
    if record.offline_since is not None:
        return "offline"
    if record.stale_since is not None:
        return "stale"
    if record.schedulability in ("drained", "draining", "cordoned"):
        return record.schedulability
    if record.health_status in ("degraded", "unhealthy"):
        return "degraded"
    if record.last_seq > 0:
        return "active"
    return "pending"


def with_state(record: NodeRecord, **changes: object) -> NodeRecord:
    """``record`` with ``changes`` applied and ``state`` derived again."""
    updated = msgspec.structs.replace(record, **changes)
    return msgspec.structs.replace(updated, state=derive_state(updated))


def pending_record(node_id: str, cluster: str, public_key: str = "") -> NodeRecord:
    return NodeRecord(
        node_id=node_id,
        cluster=cluster,
        state="pending",
        last_seq=0,
        last_seen=0.0,
        public_key=public_key,
    )


def accept(record: NodeRecord, heartbeat: Heartbeat, public_key: str, now: float) -> NodeRecord:
    """The record after a valid heartbeat: facts refreshed, stale/offline cleared."""
    health = heartbeat.health
    return with_state(
        record,
        cluster=heartbeat.cluster,
        last_seq=heartbeat.seq,
        last_seen=now,
        boot_id=heartbeat.boot_id,
        public_key=public_key,
        schedulability=heartbeat.schedulability,
        health_status=health.status if health else None,
        health_score=health.score if health else None,
        gpus_total=len(heartbeat.sample.gpus) if heartbeat.sample else 0,
        stale_since=None,
        offline_since=None,
        deregistered=heartbeat.deregistering,
        agent_version=heartbeat.agent_version,
        heartbeat=heartbeat,
    )


def notice_key(notice: Interruption) -> str:
    """One spot notice's identity, the same in every heartbeat that carries it."""
    mark = notice.event_id or (f"{notice.deadline:.0f}" if notice.deadline else "")
    return f"{notice.provider}:{notice.kind}:{mark}".rstrip(":")


def lifecycle_alerts(
    previous: NodeRecord, heartbeat: Heartbeat
) -> list[tuple[AlertKind, str, dict[str, str]]]:
    """``interruption`` for a spot notice not in the previous heartbeat, ``deregistered``
    when the node says it is leaving; each with a deterministic ``event`` for its id."""
    alerts: list[tuple[AlertKind, str, dict[str, str]]] = []
    notice = heartbeat.spot.notice if heartbeat.spot else None
    spot_before = previous.heartbeat.spot if previous.heartbeat else None
    before = spot_before.notice if spot_before else None
    if notice is not None and (before is None or notice_key(before) != notice_key(notice)):
        key = notice_key(notice)
        details = {"event": key, "provider": notice.provider, "notice": notice.kind}
        if notice.deadline is not None:
            details["deadline"] = f"{notice.deadline:.0f}"
        alerts.append(("interruption", f"{notice.provider} {notice.kind} notice", details))
    if heartbeat.deregistering and not previous.deregistered:
        alerts.append(
            (
                "deregistered",
                f"node deregistered ({heartbeat.schedulability_reason or 'no reason given'})",
                {"event": heartbeat.boot_id},
            )
        )
    return alerts
