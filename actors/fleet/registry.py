"""Operator-side operations on the fleet's KV buckets, shared by fleetctl and fleetctl up."""

from __future__ import annotations

import time

import nats.js.errors

from actors.runtime.bus import Bus
from schemas import codec, signing
from schemas import subjects as names
from schemas.errors import DecodeError, FleetError
from schemas.messages import NodeRecord, TrustEntry
from schemas.subjects import Subjects, check_token


class NotFound(FleetError):
    def __init__(self, what: str) -> None:
        super().__init__(f"{what} not found")


def check_public_key(public_key: str) -> None:
    try:
        signing.public_key_bytes(public_key)
    except ValueError as exc:
        raise FleetError(f"public key {public_key!r}: {exc}") from None


async def approve(bus: Bus, subjects: Subjects, node: str, public_key: str, by: str = "") -> None:
    """Record ``public_key`` as the approved key of ``node``."""
    check_token("node id", node)
    check_public_key(public_key)
    entry = TrustEntry(node_id=node, public_key=public_key, approved_at=time.time(), approved_by=by)
    trust = await bus.kv(subjects.bucket_name(names.BUCKET_TRUST))
    await trust.put(node, codec.encode(entry))


async def revoke(bus: Bus, subjects: Subjects, node: str) -> None:
    check_token("node id", node)
    trust = await bus.kv(subjects.bucket_name(names.BUCKET_TRUST))
    try:
        entry = await trust.get(node)
    except nats.js.errors.KeyNotFoundError:
        raise NotFound(f"approved key of {node}") from None
    if entry.value is None:
        raise NotFound(f"approved key of {node}")
    current = codec.decode(entry.value, TrustEntry, f"trust record {node}")
    await trust.put(
        node,
        codec.encode(
            TrustEntry(
                node_id=node,
                public_key=current.public_key,
                approved_at=current.approved_at,
                approved_by=current.approved_by,
                revoked=True,
            )
        ),
    )


async def node_ids(bus: Bus, subjects: Subjects) -> list[str]:
    """Every node id in fleet_nodes (a headers-only listing: no record is read)."""
    bucket = await bus.kv(subjects.bucket_name(names.BUCKET_NODES))
    try:
        return sorted(await bucket.keys())
    except nats.js.errors.NoKeysError:
        return []


async def records(bus: Bus, subjects: Subjects) -> list[NodeRecord]:
    """Every node record, sorted by node id; unreadable records are skipped."""
    bucket = await bus.kv(subjects.bucket_name(names.BUCKET_NODES))
    found = []
    for key in await node_ids(bus, subjects):
        try:
            entry = await bucket.get(key)
        except nats.js.errors.KeyNotFoundError:
            continue
        if entry.value:
            try:
                found.append(codec.decode(entry.value, NodeRecord, f"node record {key}"))
            except DecodeError:
                continue
    return found


async def record(bus: Bus, subjects: Subjects, node: str) -> NodeRecord:
    check_token("node id", node)
    bucket = await bus.kv(subjects.bucket_name(names.BUCKET_NODES))
    try:
        entry = await bucket.get(node)
    except nats.js.errors.KeyNotFoundError:
        raise NotFound(f"node {node}") from None
    if not entry.value:
        raise NotFound(f"node {node}")
    return codec.decode(entry.value, NodeRecord, f"node record {node}")
