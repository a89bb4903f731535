"""Pure rules of the aggregator: what a heartbeat does to a node's record (the record's
state itself: :mod:`actors.fleet.record_state`).

Kept apart from the actor so every rule is testable without a server.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import msgspec

from actors.fleet.record_state import state_of, with_state
from schemas.messages import AlertKind, Candidate, Heartbeat, NodeRecord, Severity


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

NO_CANDIDATES: list[Candidate] = []
"""The one empty candidates list of every accepted record (and every slim one without
candidates): never changed in place, as a pending record's candidates are replaced whole
(:func:`~actors.fleet.aggregator.pending.with_candidate`). An empty list a node is 56
bytes, 5.6 MB at 100,000 nodes."""


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
        candidates=NO_CANDIDATES,
        registered_identity=None,
        labels=heartbeat.labels,
    )


def stopped_since(record: NodeRecord, heartbeat: Heartbeat, now: float) -> float | None:
    """When the node said goodbye: kept from the first goodbye of its boot, None once it
    beats without one."""
    if not heartbeat.stopping:
        return None
    return record.stopped_since if record.stopped_since is not None else now


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
    ``fingerprint`` the one :func:`gpu_fingerprint` gives for ``heartbeat``. The record's
    strings and labels are ``kept``'s objects (equal to the heartbeat's; the slim one
    holds the fleet's shared ones, which a decoded heartbeat does not)."""
    health = heartbeat.health
    status = health.status if health else previous.health_status
    deregistering = heartbeat.deregistering
    beat = heartbeat if kept is None else kept
    changes: dict[str, object] = {
        "cluster": beat.cluster,
        "last_seq": heartbeat.seq,
        "last_seen": now,
        "boot_id": beat.boot_id,
        "public_key": public_key,
        "schedulability": beat.schedulability,
        "health_status": status,
        "health_score": health.score if health else previous.health_score,
        "gpus_total": len(heartbeat.sample.gpus) if heartbeat.sample else 0,
        "stale_since": None,
        "offline_since": None,
        "deregistered": deregistering,
        "stopped_since": stopped_since(previous, heartbeat, now),
        "agent_version": beat.agent_version,
        "heartbeat": beat,
        "last_stream_seq": stream_seq,
        "last_stored": stored,
        "pending_since": None,
        "seq_reset": False,
        "created": previous.created if previous.created is not None else now,
        "candidates": NO_CANDIDATES,
        "registered_identity": None,
        "labels": beat.labels,
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
    previous: NodeRecord,
    heartbeat: Heartbeat,
    public_key: str,
    fingerprint: bytes | None,
    known_gpus: bytes,
) -> bool:
    """Whether accepting ``heartbeat`` after ``previous`` changes nothing but the beat
    itself: the next seq of the same boot under the same key, on time, the same state,
    health status, schedulability, version, labels and GPUs (``fingerprint``, the
    heartbeat's packed as the owner keeps the record's, ``known_gpus``: see
    ``hot_state.packed_gpus``), no notice, nothing to clear.
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
        and (fingerprint is None or (fingerprint == known_gpus and previous.gpus_seen))
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


def new_key_epoch(record: NodeRecord, public_key: str) -> bool:
    """A heartbeat signed by another key than the one of the record's last accepted
    heartbeat starts a new sequence epoch: the operator approved a new key (a re-imaged
    node, whose sequence starts again at 1), and the signature check already refused every
    key but the approved one, so the old key's replays never get here."""
    known = bool(record.public_key) and bool(public_key) and record.last_seq > 0
    return known and public_key != record.public_key


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


def decision_facts(heartbeat: Heartbeat) -> int:
    """What the fleet's decisions read in a heartbeat beyond the record's own fields, as
    one number: each workload's state (the reconciler: a replica ready, failed, gone),
    what the node can run (placement), the checks not ok, whether the engine
    component is at zero and the scheduler's state (the remediation policy's reason
    classes), who set the node's schedulability and which GPUs are lost. The owner keeps it per node
    (``NodeState.facts``): a heartbeat that changes it is written at once, like a state
    change, so a reader following ``fleet_nodes`` (:mod:`actors.fleet.live`) sees it
    within the heartbeat; GPU readings, which change every beat, are left to the
    checkpoint. A hash: equal facts give equal numbers within one process (all that is
    compared), and a collision costs one checkpoint's delay, never a wrong record."""
    health = heartbeat.health
    sample = heartbeat.sample
    scheduler = heartbeat.scheduler
    workloads = heartbeat.workloads
    capabilities = heartbeat.capabilities
    # List comprehensions, not generators: 2.4 µs a heartbeat of 8 GPUs, not 4.4.
    return hash(
        (
            tuple([(w.name, w.state, w.since, w.restarts) for w in workloads])
            if workloads
            else None,
            tuple(capabilities) if capabilities is not None else None,
            tuple([(c.name, c.status) for c in health.checks if c.status != "ok"])
            if health is not None
            else None,
            [part.points for part in health.components if part.name == "engine"][:1] == [0]
            if health is not None
            else None,
            scheduler.slurm_state if scheduler is not None else None,
            heartbeat.schedulability_by,
            tuple([gpu.index for gpu in sample.gpus if gpu.lost]) if sample is not None else None,
        )
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
