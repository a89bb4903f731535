"""Pure rules of the aggregator: which alerts a judged heartbeat raises (lifecycle
changes, recoveries, gaps and anomalies, health changes, changed hardware) and the
refusal of a deregistered node's heartbeat. Kept apart from the record's own rules
(:mod:`actors.fleet.aggregator.record_rules`), testable without a server.
"""

from __future__ import annotations

from actors.fleet.aggregator.record_rules import (
    ANOMALY_FACTOR,
    AlertSpec,
    gpu_fingerprint,
)
from schemas.events import Health, notice_key
from schemas.messages import Heartbeat, NodeRecord, Severity


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


# Lifecycle rules: terminal deregistration, key epochs, refused nodes, hardware.


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
