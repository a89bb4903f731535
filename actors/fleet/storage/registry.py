"""Operator-side operations on the fleet's KV buckets, shared by fleetctl and fleetctl up,
and the one reader of ``fleet_trust``, so the aggregators and fleetctl agree on which key
a node has."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import msgspec
import nats.js.errors

from actors.fleet import record_state
from actors.runtime import kv
from actors.runtime.bus import Bus
from schemas import codec, signing
from schemas.errors import DecodeError, FleetError
from schemas.messages import MAX_IDENTITY_BYTES, NodeIdentity, NodeRecord, TrustEntry
from schemas.subjects import (
    BUCKET_NODES,
    BUCKET_TRUST,
    STREAM_COMMANDS,
    Subjects,
    check_token,
)

log = logging.getLogger(__name__)

CAS_ATTEMPTS = 8
RECORDS_LIMIT = 1_000_000
"""Entries :func:`read_trust` keeps at most: ten times the 100,000-node fleet the
aggregator is sized for, a bound on memory, not a limit any fleet meets."""
READ_TIMEOUT = 60.0
"""Seconds :func:`read_trust` may take in all (100,000 entries are about 100 pages)."""


class NotFound(FleetError):
    def __init__(self, what: str) -> None:
        super().__init__(f"{what} not found")


def check_public_key(public_key: str) -> None:
    """Refuse anything but a user public key; a seed gets its own explanation, since
    pasting one means the secret has left its file."""
    if signing.is_seed(public_key):
        raise FleetError(
            "that is a seed (the secret key, SU...), not a public key (U...): it was not "
            "used or stored; print the public key with 'node-agent key show', and treat "
            "this seed as exposed (it may now be in your shell history)"
        )
    try:
        signing.public_key_bytes(public_key)
    except ValueError as exc:
        raise FleetError(f"public key {public_key!r}: {exc}") from None


async def approve(
    bus: Bus,
    subjects: Subjects,
    node: str,
    public_key: str,
    by: str = "",
    identity: NodeIdentity | None = None,
) -> None:
    """Record ``public_key`` as the approved key of ``node``, with ``identity`` as its
    enrolled identity; without one, the identity already recorded for the same key is
    kept (approving a node again), and a new key has none."""
    check_token("node id", node)
    check_public_key(public_key)
    now = time.time()
    entry = TrustEntry(node_id=node, public_key=public_key, approved_at=now, approved_by=by)
    if identity is not None:
        entry = msgspec.structs.replace(entry, identity=identity, identity_by=by, identity_at=now)
    else:
        try:
            existing = await trust_entry(bus, subjects, node)
        except DecodeError:
            existing = None  # replaced, as approving always replaced it
        if existing is not None and existing.public_key == public_key:
            entry = msgspec.structs.replace(
                entry,
                identity=existing.identity,
                identity_by=existing.identity_by,
                identity_at=existing.identity_at,
            )
    trust = await bus.kv(subjects.bucket_name(BUCKET_TRUST))
    await trust.put(node, codec.encode(entry))


async def confirm_identity(
    bus: Bus, subjects: Subjects, node: str, identity: NodeIdentity, by: str
) -> None:
    """Record ``identity`` as the enrolled identity of ``node``, whose key must be
    approved (compare-and-set, so a revocation meanwhile is not undone); one over
    MAX_IDENTITY_BYTES is refused."""
    check_token("node id", node)
    size = len(codec.encode(identity))
    if size > MAX_IDENTITY_BYTES:
        raise FleetError(
            f"{node}'s claimed identity is {size} bytes, over {MAX_IDENTITY_BYTES}: not recorded"
        )
    trust = await bus.kv(subjects.bucket_name(BUCKET_TRUST))
    for _ in range(CAS_ATTEMPTS):
        current, revision = await kv.read_with_revision(trust, node, TrustEntry)
        if current is None or revision is None or current.revoked:
            raise FleetError(f"{node} has no approved key: approve it first (fleetctl approve)")
        updated = msgspec.structs.replace(
            current, identity=identity, identity_by=by, identity_at=time.time()
        )
        try:
            await trust.update(node, codec.encode(updated), last=revision)
            return
        except nats.js.errors.KeyWrongLastSequenceError:
            continue
    raise FleetError(f"trust entry of {node} kept changing; try again")


async def revoke(bus: Bus, subjects: Subjects, node: str) -> None:
    """Mark the approved key of ``node`` revoked; the entry stays, so the record of who
    approved it does too."""
    check_token("node id", node)
    current = await trust_entry(bus, subjects, node)
    if current is None:
        raise NotFound(f"approved key of {node}")
    trust = await bus.kv(subjects.bucket_name(BUCKET_TRUST))
    await trust.put(node, codec.encode(msgspec.structs.replace(current, revoked=True)))


async def reset_seq(bus: Bus, subjects: Subjects, node: str) -> None:
    """Let the next valid heartbeat of ``node`` in whatever its seq (a re-imaged node that
    starts again at 1, one refused for a seq jump). The flag is in the node's record, which
    the aggregator that accepts that heartbeat clears; compare-and-set, so no aggregator's
    write is lost."""
    check_token("node id", node)
    bucket = await bus.kv(subjects.bucket_name(BUCKET_NODES))
    for _ in range(CAS_ATTEMPTS):
        current, revision = await kv.read_with_revision(bucket, node, NodeRecord)
        if current is None or revision is None:
            raise NotFound(f"node {node}")
        body = codec.encode(msgspec.structs.replace(current, seq_reset=True))
        try:
            await bucket.update(node, body, last=revision)
            return
        except nats.js.errors.KeyWrongLastSequenceError:
            continue
    raise FleetError(f"record of {node} kept changing; try again")


async def trust_entry(bus: Bus, subjects: Subjects, node: str) -> TrustEntry | None:
    """The trust entry of ``node`` as stored, revoked or not; None when there is none.
    Every reader of ``fleet_trust`` starts here; an unreadable entry raises DecodeError."""
    trust = await bus.kv(subjects.bucket_name(BUCKET_TRUST))
    return await kv.read(trust, node, TrustEntry)


async def read_trust(bus: Bus, subjects: Subjects) -> list[TrustEntry]:
    """Every trust entry, revoked or not, sorted by node id; an unreadable entry raises
    DecodeError (a generated server config must not silently drop a node)."""
    bucket = subjects.bucket_name(BUCKET_TRUST)
    values = await kv.latest_values(bus, bucket, RECORDS_LIMIT, READ_TIMEOUT)
    return [
        codec.decode(value, TrustEntry, f"key {node}") for node, value in sorted(values.items())
    ]


def approved_key(entry: TrustEntry | None) -> str | None:
    """The public key ``entry`` approves; None when there is no entry or it is revoked."""
    if entry is None or entry.revoked:
        return None
    return entry.public_key


# Lifecycle: forgetting a node and admitting it again.


async def _change_record(
    bus: Bus, subjects: Subjects, node: str, change: Callable[[NodeRecord], NodeRecord | None]
) -> tuple[NodeRecord | None, NodeRecord | None]:
    """Compare-and-set ``change`` on the record of ``node``: (before, written); written is
    None when ``change`` wrote nothing, before is None when there is no record."""
    bucket = await bus.kv(subjects.bucket_name(BUCKET_NODES))
    for _ in range(CAS_ATTEMPTS):
        current, revision = await kv.read_with_revision(bucket, node, NodeRecord)
        if current is None or revision is None:
            return None, None
        updated = change(current)
        if updated is None:
            return current, None
        try:
            await bucket.update(node, codec.encode(updated), last=revision)
            return current, updated
        except nats.js.errors.KeyWrongLastSequenceError:
            continue
    raise FleetError(f"record of {node} kept changing; try again")


class Forgotten(msgspec.Struct, frozen=True, kw_only=True):
    """What ``fleetctl forget`` did (each part idempotent)."""

    record: NodeRecord | None
    already: bool
    """The record was deregistered before."""
    revoked: bool
    """An approved key was revoked now."""
    purged: bool
    """The node's pending commands were purged from the commands stream."""


async def forget(bus: Bus, subjects: Subjects, node: str, by: str, reason: str = "") -> Forgotten:
    """The provider side removes a node that may never come back: its record becomes
    ``deregistered`` naming ``by`` (the operator's public key) and ``reason``, its key is
    revoked (its heartbeats are refused from now on) and the commands still waiting for it
    are purged. Idempotent: forgetting again changes nothing but purges what came since.
    NotFound when the node has neither a record nor a key."""
    check_token("node id", node)
    now = time.time()

    def change(record: NodeRecord) -> NodeRecord | None:
        if record.deregistered and record.deregistered_by == by:
            return None
        return record_state.with_state(
            record,
            deregistered=True,
            deregistered_by=by,
            deregistered_reason=reason,
            deregistered_at=now,
        )

    before, written = await _change_record(bus, subjects, node, change)
    entry = await trust_entry(bus, subjects, node)
    if before is None and entry is None:
        raise NotFound(f"node {node}")
    revoked, purged = await withdraw(bus, subjects, node, entry)
    return Forgotten(
        record=written if written is not None else before,
        already=before is not None and before.deregistered,
        revoked=revoked,
        purged=purged,
    )


async def withdraw(
    bus: Bus, subjects: Subjects, node: str, entry: TrustEntry | None
) -> tuple[bool, bool]:
    """What forgetting a node does beside its record: its approved key (``entry``, as
    read) revoked and the commands still queued for it purged. (revoked now, purged)."""
    revoked = entry is not None and not entry.revoked
    if revoked:
        await revoke(bus, subjects, node)
    purged = await bus.js.purge_stream(
        subjects.stream_name(STREAM_COMMANDS), subject=subjects.commands_of(node)
    )
    return revoked, bool(purged)


async def readmit(bus: Bus, subjects: Subjects, node: str) -> bool:
    """Clear the deregistration of ``node``'s record (``fleetctl approve`` of a
    deregistered node), so aggregators accept its heartbeats again. True if it was
    deregistered."""

    def change(record: NodeRecord) -> NodeRecord | None:
        if not record.deregistered:
            return None
        return record_state.with_state(
            record,
            deregistered=False,
            deregistered_by="",
            deregistered_reason="",
            deregistered_at=None,
            refused="",
            refused_at=None,
        )

    _, written = await _change_record(bus, subjects, node, change)
    return written is not None
