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
    """deregistered > offline > stale > stopped > drained > draining > cordoned >
    unhealthy > degraded > active > pending, each from its own fact in the record. What
    an operator did to the node (cordon, drain) outranks its health: it says the node is
    being dealt with."""
    return state_of(
        record.deregistered,
        record.offline_since,
        record.stale_since,
        record.schedulability,
        record.health_status,
        record.last_seq,
        record.stopped_since is not None,
    )


def with_state(record: NodeRecord, **changes: object) -> NodeRecord:
    """``record`` with ``changes`` applied and ``state`` derived again."""
    updated = msgspec.structs.replace(record, **changes)
    return msgspec.structs.replace(updated, state=derive_state(updated))


def pending_record(
    node_id: str,
    cluster: str,
    public_key: str = "",
    since: float | None = None,
    approved: bool = False,
) -> NodeRecord:
    """A record before the node's first heartbeat. ``pending_since`` (awaiting approval,
    expired by the sweep) only if its key is not ``approved`` yet: an approved (enrolled)
    node waits for nobody but itself."""
    return NodeRecord(
        node_id=node_id,
        cluster=cluster,
        state="pending",
        last_seq=0,
        last_seen=0.0,
        public_key=public_key,
        pending_since=None if approved else since,
        created=since,
    )


def judge_seq(record: NodeRecord, seq: int, max_jump: int, public_key: str = "") -> SeqVerdict:
    """``next`` if ``seq`` may follow the record's last accepted one: above it, by at most
    ``max_jump`` (one forged or corrupt seq near 2**63 must not lock the node out for
    good), or anything after an operator's ``reset-seq`` or under a newly approved key
    (:func:`new_key_epoch`). ``replay`` at or below it, ``jump`` too far above it."""
    if record.seq_reset or new_key_epoch(record, public_key):
        return "next"
    if seq <= record.last_seq:
        return "replay"
    if record.last_seq > 0 and seq - record.last_seq > max_jump:
        return "jump"
    return "next"


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
        stopped_since=stopped_since(record, heartbeat, now),
        agent_version=heartbeat.agent_version,
        heartbeat=heartbeat,
        last_stream_seq=stream_seq,
        last_stored=stored,
        pending_since=None,
        seq_reset=False,
        created=record.created if record.created is not None else now,
        candidates=[],
        labels=heartbeat.labels,
    )


def stopped_since(record: NodeRecord, heartbeat: Heartbeat, now: float) -> float | None:
    """When the node said goodbye: kept from the first goodbye of its boot, None once it
    beats without one."""
    if not heartbeat.stopping:
        return None
    return record.stopped_since if record.stopped_since is not None else now


def state_of(
    deregistered: bool,
    offline_since: float | None,
    stale_since: float | None,
    schedulability: str,
    health_status: str | None,
    last_seq: int,
    stopped: bool = False,
) -> RecordState:
    """:func:`derive_state` from the facts themselves (no record built first)."""
    if deregistered:
        return "deregistered"
    if offline_since is not None:
        return "offline"
    if stale_since is not None:
        return "stale"
    if stopped:
        return "stopped"
    held = HELD_STATES.get(schedulability)
    if held is not None:
        return held
    if health_status == "unhealthy":
        return "unhealthy"
    if health_status == "degraded":
        return "degraded"
    if last_seq > 0:
        return "active"
    return "pending"


def accepted(
    previous: NodeRecord,
    heartbeat: Heartbeat,
    public_key: str,
    now: float,
    stream_seq: int,
    stored: float | None,
    fingerprint: list[str] | None,
    kept: Heartbeat | None = None,
) -> NodeRecord:
    """``with_lifecycle(previous, accept(previous, heartbeat, ...), heartbeat)`` built in
    one step (the hot path's; one record per heartbeat, not four), with ``kept`` as the
    record's heartbeat (default ``heartbeat``; the aggregator keeps a slim one) and
    ``fingerprint`` the one :func:`gpu_fingerprint` gives for ``heartbeat``."""
    health = heartbeat.health
    status = health.status if health else previous.health_status
    deregistering = heartbeat.deregistering
    changes: dict[str, object] = {
        "cluster": heartbeat.cluster,
        "last_seq": heartbeat.seq,
        "last_seen": now,
        "boot_id": heartbeat.boot_id,
        "public_key": public_key,
        "schedulability": heartbeat.schedulability,
        "health_status": status,
        "health_score": health.score if health else previous.health_score,
        "gpus_total": len(heartbeat.sample.gpus) if heartbeat.sample else 0,
        "stale_since": None,
        "offline_since": None,
        "deregistered": deregistering,
        "stopped_since": stopped_since(previous, heartbeat, now),
        "agent_version": heartbeat.agent_version,
        "heartbeat": heartbeat if kept is None else kept,
        "last_stream_seq": stream_seq,
        "last_stored": stored,
        "pending_since": None,
        "seq_reset": False,
        "created": previous.created if previous.created is not None else now,
        "candidates": [],
        "labels": heartbeat.labels,
        "refused": "",
        "refused_at": None,
        "state": state_of(
            deregistering,
            None,
            None,
            heartbeat.schedulability,
            status,
            heartbeat.seq,
            heartbeat.stopping,
        ),
    }
    if fingerprint is not None and (
        fingerprint != previous.gpu_fingerprint or not previous.gpus_seen
    ):
        changes["gpu_fingerprint"] = fingerprint
        changes["gpus_seen"] = True
    if deregistering and not previous.deregistered:
        changes["deregistered_by"] = "node"
        changes["deregistered_reason"] = heartbeat.schedulability_reason
        changes["deregistered_at"] = now
    return msgspec.structs.replace(previous, **changes)


def is_steady(
    previous: NodeRecord, heartbeat: Heartbeat, public_key: str, fingerprint: list[str] | None
) -> bool:
    """Whether accepting ``heartbeat`` after ``previous`` changes nothing but the beat
    itself: the next seq of the same boot under the same key, on time, the same state,
    health status, schedulability, version, labels and GPUs, no notice, nothing to clear.
    Then :func:`steady_beat` is :func:`accepted`'s record, with no alert and no transition
    (tests/fleet/test_lean_state.py checks both), for a fraction of the work: most
    heartbeats of a fleet are steady ones."""
    health = heartbeat.health
    last = previous.heartbeat
    return (
        previous.last_seq > 0
        and heartbeat.seq == previous.last_seq + 1
        and last is not None
        and heartbeat.ts - last.ts <= ANOMALY_FACTOR * heartbeat.interval
        and public_key == previous.public_key
        and heartbeat.boot_id == previous.boot_id
        and heartbeat.cluster == previous.cluster
        and heartbeat.schedulability == previous.schedulability
        and heartbeat.agent_version == previous.agent_version
        and (health is None or health.status == previous.health_status)
        and (
            fingerprint is None or (fingerprint == previous.gpu_fingerprint and previous.gpus_seen)
        )
        and (heartbeat.spot is None or heartbeat.spot.notice is None)
        and not heartbeat.deregistering
        and not heartbeat.stopping
        and previous.stopped_since is None
        and not previous.deregistered
        and not previous.seq_reset
        and previous.stale_since is None
        and previous.offline_since is None
        and previous.pending_since is None
        and not previous.refused
        and previous.refused_at is None
        and previous.created is not None
        and heartbeat.labels == previous.labels
        and previous.state
        == state_of(
            False, None, None, heartbeat.schedulability, previous.health_status, heartbeat.seq
        )
    )


def steady_beat(
    previous: NodeRecord,
    heartbeat: Heartbeat,
    now: float,
    stream_seq: int,
    stored: float | None,
    kept: Heartbeat,
) -> NodeRecord:
    """:func:`accepted`'s record for a heartbeat :func:`is_steady` allows: only the fields
    a steady beat changes are set."""
    health = heartbeat.health
    return msgspec.structs.replace(
        previous,
        last_seq=heartbeat.seq,
        last_seen=now,
        health_score=health.score if health else previous.health_score,
        gpus_total=len(heartbeat.sample.gpus) if heartbeat.sample else 0,
        heartbeat=kept,
        last_stream_seq=stream_seq,
        last_stored=stored,
    )


def lifecycle_alerts(previous: NodeRecord, heartbeat: Heartbeat) -> list[AlertSpec]:
    """``interruption`` for a spot notice not in the previous heartbeat, ``stopped`` when
    the node says goodbye, ``deregistered`` when it says it is leaving; each with a
    deterministic ``event`` for its id."""
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
    if heartbeat.stopping and previous.stopped_since is None and not heartbeat.deregistering:
        alerts.append(
            AlertSpec(
                "stopped",
                "agent stopped on request (its goodbye heartbeat); not stale while it stays away",
                {"event": f"{heartbeat.boot_id}-stop"},
            )
        )
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
    if previous.state in ("stale", "offline", "stopped") and not heartbeat.stopping:
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
    first = previous.health_status is None
    if updated.health_status != previous.health_status and (
        not first or updated.health_status not in (None, "healthy")
    ):
        # A node unhealthy (or degraded) from its first report is news: it joined broken.
        before = previous.health_status or "none"
        alerts.append(health_alert(before, updated, heartbeat.health))
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


# Lifecycle rules (issue 9): terminal deregistration, key epochs, refused nodes, hardware.


def new_key_epoch(record: NodeRecord, public_key: str) -> bool:
    """A heartbeat signed by another key than the one of the record's last accepted
    heartbeat starts a new sequence epoch: the operator approved a new key (a re-imaged
    node, whose sequence starts again at 1), and the signature check already refused every
    key but the approved one, so the old key's replays never get here."""
    known = bool(record.public_key) and bool(public_key) and record.last_seq > 0
    return known and public_key != record.public_key


def deregistered_refusal(record: NodeRecord, heartbeat: Heartbeat) -> AlertSpec | None:
    """A deregistered record takes only the node's own deregistering heartbeats (the last
    ones of the agent that left); anything else is a node beating after it left, refused
    until an operator re-admits it (``fleetctl approve``). Its alert names the boot, so it
    is raised once per agent start."""
    if not record.deregistered or heartbeat.deregistering:
        return None
    by = record.deregistered_by or "node"
    return AlertSpec(
        "deregistered_node_beating",
        f"node was deregistered (by {by}) but beats again; re-admit it with fleetctl approve",
        {"event": heartbeat.boot_id, "boot_id": heartbeat.boot_id, "by": by},
    )


def gpu_fingerprint(heartbeat: Heartbeat) -> list[str] | None:
    """The sorted GPU uuids of ``heartbeat``; None without a sample (nothing to compare)."""
    if heartbeat.sample is None:
        return None
    return sorted([gpu.uuid for gpu in heartbeat.sample.gpus])


def with_lifecycle(previous: NodeRecord, updated: NodeRecord, heartbeat: Heartbeat) -> NodeRecord:
    """What accepting ``heartbeat`` adds to :func:`accept`'s record: the refusal mark is
    cleared, the GPU fingerprint is kept current, and a deregistering heartbeat records
    who deregistered the node."""
    fingerprint = gpu_fingerprint(heartbeat)
    changes: dict[str, object] = {}
    if updated.refused or updated.refused_at is not None:
        changes["refused"], changes["refused_at"] = "", None
    if fingerprint is not None and (
        fingerprint != updated.gpu_fingerprint or not updated.gpus_seen
    ):
        changes["gpu_fingerprint"] = fingerprint
        changes["gpus_seen"] = True
    if heartbeat.deregistering and not previous.deregistered:
        changes["deregistered_by"] = "node"
        changes["deregistered_reason"] = heartbeat.schedulability_reason
        changes["deregistered_at"] = updated.last_seen
    elif previous.deregistered:
        for name in ("deregistered_by", "deregistered_reason", "deregistered_at"):
            if getattr(updated, name) != getattr(previous, name):
                changes[name] = getattr(previous, name)
    # Most heartbeats change none of it: no second copy of the record on the hot path.
    return with_state(updated, **changes) if changes else updated


def hardware_alert(
    previous: NodeRecord, heartbeat: Heartbeat, fingerprint: list[str] | None = None
) -> AlertSpec | None:
    """``hardware_changed`` when the GPUs in ``heartbeat`` are not the ones the record
    knew (a GPU swapped: its uuid changed; a GPU gone or added), with both lists. A record
    without a fingerprint yet (first sample, older aggregator) knows nothing to compare.
    ``fingerprint``: :func:`gpu_fingerprint` of ``heartbeat``, if already computed."""
    after = fingerprint if fingerprint is not None else gpu_fingerprint(heartbeat)
    before = list(previous.gpu_fingerprint)
    # An empty set is news only when a sample said so (NVML failing), not before any.
    if after is None or (not before and not previous.gpus_seen) or after == before:
        return None
    gone = sorted(set(before) - set(after))
    new = sorted(set(after) - set(before))
    return AlertSpec(
        "hardware_changed",
        f"GPU set changed: {len(before)} -> {len(after)} GPUs"
        + (f", gone {','.join(gone)}" if gone else "")
        + (f", new {','.join(new)}" if new else ""),
        {
            "event": "hw-" + ",".join(after)[-64:] + f"-{heartbeat.seq}",
            "before": ",".join(before),
            "after": ",".join(after),
            "gone": ",".join(gone),
            "new": ",".join(new),
        },
        "critical" if gone else "warning",
    )


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
        or previous.labels != updated.labels
        or previous.gpu_fingerprint != updated.gpu_fingerprint
        or previous.refused != updated.refused
        or previous.deregistered_by != updated.deregistered_by
    )
