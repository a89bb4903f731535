"""Bulk enrollment: operator-signed tokens that let aggregators approve node keys at once.

A token is ``<issuer key>.<base64url claims JSON>.<base64url Ed25519 signature>``, the
claims (:class:`EnrollClaims`) signed by an operator key. ``fleetctl enroll-token create``
signs the claims and stores an :class:`EnrollRecord` in KV ``fleet_enroll``; a node
presents the token in its signed :class:`Registration`. An aggregator approves the node's
key only when all of these hold (:func:`admit`), and otherwise leaves the registration
pending for hand approval, saying why:

- the signature verifies over the exact claims bytes, and the issuer is an operator key
  this aggregator trusts (``trust_operators``), and the claims name that same issuer;
- the token is not expired, and its cluster (if it names one) is the registration's;
- its record exists, is not revoked and has uses left: a use is taken by compare-and-set
  on the record, so several aggregators together never approve more than ``uses`` nodes;
- the node has no trust entry yet. A node with an approved key (another key, or the same:
  then it is simply active and no use is spent) or a revoked one is never changed by a
  token: replacing or restoring a key stays a hand decision (``fleetctl approve``), so a
  leaked token cannot take over an existing node's name.

The trust entry is written with KV ``create`` (fails if one appeared meanwhile), so two
registrations racing for one node name with different keys approve at most one.
"""

from __future__ import annotations

import base64
import binascii
import logging
import os
import re
import time
from dataclasses import dataclass

import msgspec
import nats.js.errors

from actors.fleet import identity
from actors.runtime import kv
from actors.runtime.bus import Bus
from schemas import codec, signing
from schemas.base import MAX_ENROLL_TOKEN, MAX_ENROLLED, TOKEN_ID_PATTERN
from schemas.errors import DecodeError, FleetError, SignatureError
from schemas.messages import EnrollClaims, EnrollRecord, Registration, TrustEntry
from schemas.subjects import BUCKET_ENROLL, BUCKET_TRUST, Subjects, check_token

log = logging.getLogger(__name__)

MAX_TTL = 30 * 86400.0
"""Longest a token may live (its record is kept 31 days, see streams.ENROLL_KEEP)."""
MAX_USES = 1_000_000
CAS_ATTEMPTS = 16
TOKENS_LIMIT = 100_000
"""Token records :func:`records` keeps at most (a bound on memory; more are logged)."""
READ_TIMEOUT = 30.0
"""Seconds :func:`records` may take to read them all."""
"""Tries to take a use while other aggregators take uses of the same token."""


class BadToken(FleetError):
    """An enrollment token that admits nobody; the message says why (no secret in it)."""

    def __init__(self, why: str) -> None:
        self.why = why
        super().__init__(f"enrollment token refused: {why}")


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    """Strict base64url: a character outside the alphabet is an error, not skipped."""
    return base64.b64decode(text + "=" * (-len(text) % 4), altchars=b"-_", validate=True)


def new_id() -> str:
    return os.urandom(16).hex()


def issue(
    key: signing.KeyPair, cluster: str, ttl: float, uses: int, now: float | None = None
) -> tuple[str, EnrollRecord]:
    """A signed token and the record that goes with it (not stored yet)."""
    if cluster:
        check_token("cluster", cluster)
    if not 0 < ttl <= MAX_TTL:
        raise FleetError(f"--ttl must be above 0 and at most {MAX_TTL / 86400:.0f} days")
    if not 1 <= uses <= MAX_USES:
        raise FleetError(f"--uses must be 1 to {MAX_USES}")
    now = time.time() if now is None else now
    claims = EnrollClaims(
        id=new_id(),
        issuer=key.public_key,
        cluster=cluster,
        issued_at=now,
        expires_at=now + ttl,
        uses=uses,
    )
    body = codec.encode(claims)
    token = f"{key.public_key}.{_b64(body)}.{_b64(key.sign(body))}"
    record = EnrollRecord(
        id=claims.id,
        issuer=claims.issuer,
        cluster=cluster,
        issued_at=claims.issued_at,
        expires_at=claims.expires_at,
        uses=uses,
    )
    return token, record


def verify(token: str, trusted: set[str], now: float | None = None) -> EnrollClaims:
    """The claims of ``token`` if its signature verifies, its issuer is ``trusted`` and it
    has not expired; BadToken otherwise. The signature is checked over the bytes received,
    before they are decoded."""
    if len(token) > MAX_ENROLL_TOKEN:
        raise BadToken("too long")
    parts = token.strip().split(".")
    if len(parts) != 3:
        raise BadToken("not a token (expected KEY.CLAIMS.SIGNATURE)")
    issuer, claims_text, signature_text = parts
    try:
        body, signature = _unb64(claims_text), _unb64(signature_text)
    except (binascii.Error, ValueError):
        raise BadToken("not base64url") from None
    headers = {signing.HEADER_KEY: issuer, signing.HEADER_SIG: base64.b64encode(signature).decode()}
    try:
        signer = signing.verify(headers, body)
    except SignatureError as exc:
        raise BadToken(f"signature: {exc.reason}") from None
    if signer not in trusted:
        raise BadToken("not issued by an operator key this aggregator trusts")
    try:
        claims = codec.decode(body, EnrollClaims, "enrollment token")
    except DecodeError as exc:
        raise BadToken(f"claims unreadable: {exc.reason}") from None
    if claims.issuer != signer:
        raise BadToken("claims name another issuer than the signer")
    now = time.time() if now is None else now
    if now >= claims.expires_at:
        raise BadToken("expired")
    return claims


async def store(bus: Bus, subjects: Subjects, record: EnrollRecord) -> None:
    """Store a new token's record (``create``: ids are random, never overwritten)."""
    bucket = await bus.kv(subjects.bucket_name(BUCKET_ENROLL))
    await bucket.create(record.id, codec.encode(record))


async def records(bus: Bus, subjects: Subjects) -> list[EnrollRecord]:
    """Every token's record, oldest first, read in one scan of the bucket
    (:func:`kv.latest_values`: nats-py's key listing can come back empty on a full
    bucket); an unreadable one is skipped and logged."""
    bucket = subjects.bucket_name(BUCKET_ENROLL)
    found = []
    for key, value in (await kv.latest_values(bus, bucket, TOKENS_LIMIT, READ_TIMEOUT)).items():
        try:
            found.append(codec.decode(value, EnrollRecord, f"key {key}"))
        except DecodeError as exc:
            log.warning("unreadable enrollment record", extra={"key": key, "reason": str(exc)})
    return sorted(found, key=lambda record: record.issued_at)


async def revoke(bus: Bus, subjects: Subjects, token_id: str) -> EnrollRecord:
    """Mark a token revoked (compare-and-set); idempotent. The nodes it already approved
    keep their keys (revoke those with ``fleetctl revoke NODE``)."""
    if not re.fullmatch(TOKEN_ID_PATTERN, token_id):
        raise FleetError(f"{token_id[:40]!r} is not a token id (32 hex digits, see list)")
    bucket = await bus.kv(subjects.bucket_name(BUCKET_ENROLL))
    for _ in range(CAS_ATTEMPTS):
        current, revision = await kv.read_with_revision(bucket, token_id, EnrollRecord)
        if current is None or revision is None:
            raise FleetError(f"enrollment token {token_id} not found")
        if current.revoked:
            return current
        revoked = msgspec.structs.replace(current, revoked=True, revoked_at=time.time())
        try:
            await bucket.update(token_id, codec.encode(revoked), last=revision)
            return revoked
        except nats.js.errors.KeyWrongLastSequenceError:
            continue
    raise FleetError(f"enrollment token {token_id} kept changing; try again")


@dataclass(frozen=True)
class Decision:
    """What a token did for a registration: ``approved`` (a use taken, key trusted) or
    not, with the reason shown to the node and logged."""

    approved: bool
    reason: str


async def admit(
    bus: Bus, subjects: Subjects, registration: Registration, trusted: set[str]
) -> Decision:
    """Approve ``registration``'s key with its token if every rule of the module holds."""
    try:
        claims = verify(registration.enroll_token, trusted)
    except BadToken as exc:
        return Decision(False, str(exc))
    try:
        return await _admit(bus, subjects, registration, claims)
    except DecodeError as exc:  # a damaged trust entry or token record: hands off
        log.error("enrollment: unreadable entry", extra={"reason": str(exc)})
        return Decision(False, "enrollment token not used: a stored entry is unreadable")


async def _admit(
    bus: Bus, subjects: Subjects, registration: Registration, claims: EnrollClaims
) -> Decision:
    if claims.cluster and claims.cluster != registration.cluster:
        return Decision(False, f"enrollment token refused: it is for cluster {claims.cluster}")
    node = registration.node_id
    trust = await bus.kv(subjects.bucket_name(BUCKET_TRUST))
    existing = await kv.read(trust, node, TrustEntry)
    if existing is not None:
        if not existing.revoked and existing.public_key == registration.public_key:
            return Decision(True, "already approved")
        return Decision(
            False,
            "enrollment token not used: this node name has another or a revoked key; "
            "an operator must approve by hand",
        )
    taken = await _take_use(bus, subjects, claims.id, node)
    if taken:
        return Decision(False, taken)
    now = time.time()
    enrolled = identity.recordable(registration.identity)
    entry = TrustEntry(
        node_id=node,
        public_key=registration.public_key,
        approved_at=now,
        approved_by=f"enroll:{claims.id}",
        identity=enrolled,
        identity_by=f"enroll:{claims.id}" if enrolled is not None else "",
        identity_at=now if enrolled is not None else None,
    )
    try:
        await trust.create(node, codec.encode(entry))
    except nats.js.errors.KeyWrongLastSequenceError:
        # Another registration for this name won the race a moment ago; the use taken
        # here is spent (bounded by uses), the winner's key stays.
        return Decision(False, "enrollment token not used: this node name was just approved")
    log.info(
        "node enrolled with a token",
        extra={"node": node, "token": claims.id, "cluster": registration.cluster},
    )
    return Decision(True, f"enrolled with token {claims.id}")


async def _take_use(bus: Bus, subjects: Subjects, token_id: str, node: str) -> str:
    """Take one use of the token by compare-and-set; "" when taken, else why not."""
    bucket = await bus.kv(subjects.bucket_name(BUCKET_ENROLL))
    for _ in range(CAS_ATTEMPTS):
        current, revision = await kv.read_with_revision(bucket, token_id, EnrollRecord)
        if current is None or revision is None:
            return "enrollment token refused: unknown (never stored, or deleted)"
        if current.revoked:
            return "enrollment token refused: revoked"
        if current.used >= current.uses:
            return "enrollment token refused: no uses left"
        nodes = [*current.nodes, node][-MAX_ENROLLED:]
        used = msgspec.structs.replace(current, used=current.used + 1, nodes=nodes)
        try:
            await bucket.update(token_id, codec.encode(used), last=revision)
            return ""
        except nats.js.errors.KeyWrongLastSequenceError:
            continue
    return "enrollment token busy (many nodes at once); retry"
