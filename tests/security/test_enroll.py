"""Enrollment tokens under attack, with plain nats-py clients: forged, garbled, expired,
revoked, exhausted and other-cluster tokens approve nothing; a token never replaces or
restores an existing node's key; uses are counted exactly across several aggregators."""

from __future__ import annotations

import asyncio
import base64
import time

import msgspec
from nats.aio.client import Client

from actors.fleet.operator import enroll
from actors.fleet.storage.registry import approve, revoke, trust_entry
from actors.runtime.bus import NatsBus
from schemas import codec, signing
from schemas.messages import EnrollClaims, EnrollRecord, Registration, RegistrationReply
from schemas.subjects import Subjects
from tests.security.attack import attacker
from tests.support.fleet import Fleet

OPERATOR = signing.KeyPair.generate()


def b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


async def register(
    nc: Client,
    prefix: str,
    node: str,
    token: str,
    key: signing.KeyPair | None = None,
    cluster: str = "c1",
) -> RegistrationReply:
    key = key or signing.KeyPair.generate()
    registration = Registration(
        node_id=node, cluster=cluster, public_key=key.public_key, ts=time.time(), enroll_token=token
    )
    body = codec.encode(registration)
    reply = await nc.request(
        Subjects(prefix).register(), body, timeout=5, headers=key.headers(body)
    )
    return codec.decode(reply.data, RegistrationReply, "reply")


async def new_token(
    bus: NatsBus, prefix: str, cluster: str = "c1", uses: int = 1, ttl: float = 3600.0
) -> tuple[str, EnrollRecord]:
    token, record = enroll.issue(OPERATOR, cluster, ttl, uses)
    await enroll.store(bus, Subjects(prefix), record)
    return token, record


async def stored(bus: NatsBus, prefix: str, token_id: str) -> EnrollRecord:
    [record] = [r for r in await enroll.records(bus, Subjects(prefix)) if r.id == token_id]
    return record


async def start(fleet: Fleet, bus: NatsBus | None = None) -> None:
    await fleet.start_aggregator(bus, trust_operators=[OPERATOR.public_key])


async def test_token_admits_up_to_its_uses(fleet: Fleet, bus: NatsBus, prefix: str) -> None:
    """A valid token approves exactly `uses` new nodes (trust entry names the token); the
    next is left pending with the reason; the record counts and names them."""
    await start(fleet)
    token, record = await new_token(bus, prefix, uses=2)
    async with attacker(fleet.url) as nc:
        replies = [await register(nc, prefix, f"n{i}", token) for i in range(3)]
    assert [reply.status for reply in replies] == ["active", "active", "pending"]
    assert replies[0].reason == f"enrolled with token {record.id}"
    assert replies[2].reason == "enrollment token refused: no uses left"
    entry = await trust_entry(bus, Subjects(prefix), "n0")
    assert entry is not None and entry.approved_by == f"enroll:{record.id}"
    assert await trust_entry(bus, Subjects(prefix), "n2") is None
    after = await stored(bus, prefix, record.id)
    assert (after.used, after.nodes) == (2, ["n0", "n1"])


async def test_forged_and_garbled_tokens_approve_nothing(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """Untrusted issuer, tampered claims, swapped issuer, garbage and truncation: each is
    refused with a reason, no trust entry is written and no use is spent."""
    await start(fleet)
    token, record = await new_token(bus, prefix, uses=5)
    issuer, claims, signature = token.split(".")
    body = base64.urlsafe_b64decode(claims + "=" * (-len(claims) % 4))
    rogue = signing.KeyPair.generate()
    rogue_token, rogue_record = enroll.issue(rogue, "c1", 3600, 5)
    await enroll.store(bus, Subjects(prefix), rogue_record)
    more_uses = codec.encode(
        msgspec.structs.replace(codec.decode(body, EnrollClaims, "t"), uses=1000)
    )
    tampered = f"{issuer}.{base64.urlsafe_b64encode(more_uses).decode().rstrip('=')}.{signature}"
    # The rogue signs claims naming the trusted operator as issuer, with its own key.
    rogue_claims = codec.encode(
        msgspec.structs.replace(codec.decode(body, EnrollClaims, "t"), issuer=OPERATOR.public_key)
    )
    impostor = f"{rogue.public_key}.{b64(rogue_claims)}.{b64(rogue.sign(rogue_claims))}"
    relabelled = f"{OPERATOR.public_key}.{b64(rogue_claims)}.{b64(rogue.sign(rogue_claims))}"
    cases = {
        rogue_token: "not issued by an operator key this aggregator trusts",
        tampered: "signature",
        impostor: "not issued by an operator key",
        relabelled: "signature",
        "garbage": "not a token",
        f"{issuer}.%%%.{signature}": "not base64url",
        token[:-4]: "signature",
        "x" * 3000: "rejected",
    }
    async with attacker(fleet.url) as nc:
        for i, (bad, why) in enumerate(cases.items()):
            reply = await register(nc, prefix, f"evil{i}", bad)
            assert reply.status in ("pending", "rejected"), bad
            assert why in (reply.reason if why != "rejected" else reply.status), (bad, reply)
            assert await trust_entry(bus, Subjects(prefix), f"evil{i}") is None
    assert (await stored(bus, prefix, record.id)).used == 0
    assert (await stored(bus, prefix, rogue_record.id)).used == 0


async def test_token_for_another_cluster_expired_revoked_or_unstored(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """A token is refused in another cluster, after expiry, once revoked, and when no
    record of it was ever stored (signed by a trusted key or not)."""
    await start(fleet)
    for_c2, c2_record = await new_token(bus, prefix, cluster="c2", uses=5)
    expired, _ = enroll.issue(OPERATOR, "c1", 3600, 5, now=time.time() - 7200)
    revoked, revoked_record = await new_token(bus, prefix, uses=5)
    await enroll.revoke(bus, Subjects(prefix), revoked_record.id)
    unstored, _ = enroll.issue(OPERATOR, "c1", 3600, 5)
    async with attacker(fleet.url) as nc:
        other = await register(nc, prefix, "x1", for_c2)
        old = await register(nc, prefix, "x2", expired)
        gone = await register(nc, prefix, "x3", revoked)
        never = await register(nc, prefix, "x4", unstored)
        right = await register(nc, prefix, "x5", for_c2, cluster="c2")
    assert other.reason == "enrollment token refused: it is for cluster c2"
    assert old.reason == "enrollment token refused: expired"
    assert gone.reason == "enrollment token refused: revoked"
    assert never.reason == "enrollment token refused: unknown (never stored, or deleted)"
    assert [r.status for r in (other, old, gone, never)] == ["pending"] * 4
    assert right.status == "active"
    assert (await stored(bus, prefix, c2_record.id)).used == 1
    for node in ("x1", "x2", "x3", "x4"):
        assert await trust_entry(bus, Subjects(prefix), node) is None


async def test_token_never_replaces_or_restores_a_key(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """A node name with an approved key keeps it when another key presents a token; a
    revoked node is not restored; the same key re-registering is active and spends no use."""
    await start(fleet)
    token, record = await new_token(bus, prefix, uses=5)
    owner, thief = signing.KeyPair.generate(), signing.KeyPair.generate()
    await approve(bus, Subjects(prefix), "taken", owner.public_key, by="fleetctl")
    await approve(bus, Subjects(prefix), "banned", owner.public_key, by="fleetctl")
    await revoke(bus, Subjects(prefix), "banned")
    async with attacker(fleet.url) as nc:
        stolen = await register(nc, prefix, "taken", token, thief)
        restored = await register(nc, prefix, "banned", token, owner)
        same = await register(nc, prefix, "taken", token, owner)
    assert stolen.status == "pending" and "approve by hand" in stolen.reason
    assert restored.status == "pending" and "approve by hand" in restored.reason
    assert same.status == "active"
    entry = await trust_entry(bus, Subjects(prefix), "taken")
    assert entry is not None and entry.public_key == owner.public_key
    banned = await trust_entry(bus, Subjects(prefix), "banned")
    assert banned is not None and banned.revoked
    assert (await stored(bus, prefix, record.id)).used == 0


async def test_uses_are_exact_across_aggregators(fleet: Fleet, bus: NatsBus, prefix: str) -> None:
    """Three aggregators answering 12 concurrent registrations with a 4-use token approve
    exactly 4 nodes: the use count is compare-and-set."""
    await start(fleet)
    await start(fleet, await fleet.connect("agg-2"))
    await start(fleet, await fleet.connect("agg-3"))
    token, record = await new_token(bus, prefix, uses=4)
    async with attacker(fleet.url) as nc:
        replies = await asyncio.gather(*(register(nc, prefix, f"m{i}", token) for i in range(12)))
    assert sorted(reply.status for reply in replies) == ["active"] * 4 + ["pending"] * 8
    assert (await stored(bus, prefix, record.id)).used == 4
    approved = [
        node
        for node in (f"m{i}" for i in range(12))
        if await trust_entry(bus, Subjects(prefix), node) is not None
    ]
    assert len(approved) == 4


async def test_hand_approval_stays_the_default(fleet: Fleet, bus: NatsBus, prefix: str) -> None:
    """An aggregator that trusts no operator key honours no token: the node stays pending."""
    await fleet.start_aggregator()
    token, record = await new_token(bus, prefix, uses=5)
    async with attacker(fleet.url) as nc:
        reply = await register(nc, prefix, "n1", token)
    assert reply.status == "pending"
    assert (
        reply.reason == "enrollment token refused: not issued by an operator key this "
        "aggregator trusts"
    )
    assert (await stored(bus, prefix, record.id)).used == 0
