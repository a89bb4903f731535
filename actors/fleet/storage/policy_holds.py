"""Reading the remediation policy's records (KV ``fleet_policy``): what the policy holds,
the one "who set it" the fleet knows of itself. A node's heartbeat naming the policy's
key (``schedulability_by``) is the node's claim; a hold here is the policy's own record
of the cordon it sent. And the one edit of a record from outside the policy (an
operator's verified reset or clear: :mod:`actors.fleet.operator.policy_requests`)."""

from __future__ import annotations

from collections.abc import Callable

import nats.js.errors

from actors.runtime import kv
from actors.runtime.bus import Bus, NotProvisioned
from schemas import codec
from schemas.errors import FleetError
from schemas.remediation import PolicyRecord
from schemas.subjects import BUCKET_POLICY, Subjects

CAS_ATTEMPTS = 10
"""Compare-and-set tries of one edit before it gives up (the policy writes each round)."""

MAX_CLUSTERS = 10_000
"""Policy records one read keeps at most (one per cluster)."""
READ_TIMEOUT = 10.0
"""Seconds one read of every policy record may take."""


async def read_policies(bus: Bus, subjects: Subjects) -> list[PolicyRecord]:
    """Every cluster's policy record, by cluster (direct gets: no consumer, as every
    view's read); none when no aggregator ever ran the policy. An unreadable one raises
    DecodeError."""
    name = subjects.bucket_name(BUCKET_POLICY)
    try:
        await bus.kv(name)
    except NotProvisioned:
        return []
    values = await kv.latest_values(bus, name, MAX_CLUSTERS, READ_TIMEOUT)
    return [
        codec.decode(value, PolicyRecord, f"{name} key {cluster}")
        for cluster, value in sorted(values.items())
    ]


def policy_keys(records: list[PolicyRecord]) -> set[str]:
    """The keys the policy signed its records with (``updated_by``): a node naming one as
    who set its state while the policy holds nothing of it claims what the policy's own
    record does not say."""
    return {record.updated_by for record in records if record.updated_by}


async def edit_policy(
    bus: Bus, subjects: Subjects, cluster: str, edit: Callable[[PolicyRecord], PolicyRecord]
) -> PolicyRecord:
    """Compare-and-set ``edit`` on a cluster's policy record (``edit`` may raise
    FleetError to refuse); FleetError when there is no record or it kept changing."""
    try:
        bucket = await bus.kv(subjects.bucket_name(BUCKET_POLICY))
    except NotProvisioned:
        raise FleetError("no policy bucket: no aggregator has run the policy here") from None
    for _ in range(CAS_ATTEMPTS):
        current, revision = await kv.read_with_revision(bucket, cluster, PolicyRecord)
        if current is None or revision is None:
            raise FleetError(f"the policy has no record for cluster {cluster}")
        updated = edit(current)
        try:
            await bucket.update(cluster, codec.encode(updated), last=revision)
            return updated
        except nats.js.errors.KeyWrongLastSequenceError:
            continue
    raise FleetError(f"the policy record of {cluster} kept changing; try again")
