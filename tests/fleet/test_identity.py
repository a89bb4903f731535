"""A node's enrolled identity: recorded from its registration by an approval (by hand,
for the key chosen, or by an enrollment token), kept when the same key is approved
again, replaced only by an operator's confirmation; and the rule that says when a node's
claims name another machine."""

from __future__ import annotations

import time

import msgspec
import pytest

from actors.fleet import identity
from actors.fleet.aggregator import pending
from actors.fleet.operator import enroll
from actors.fleet.storage.records import read_record
from actors.fleet.storage.registry import approve, confirm_identity, revoke, trust_entry
from actors.runtime.bus import NatsBus
from schemas import codec, signing
from schemas.errors import FleetError
from schemas.messages import (
    MAX_IDENTITY_BYTES,
    MAX_IDENTITY_FACT,
    NodeIdentity,
    Registration,
    RegistrationReply,
)
from schemas.subjects import Subjects
from tests.security.attack import attacker
from tests.support.fleet import Fleet

OPERATOR = signing.KeyPair.generate()
ONE = NodeIdentity(hostname="gpu-1", gpus=["GPU-a", "GPU-b"], gpu_product="H100", gpu_count=2)
TWO = NodeIdentity(hostname="gpu-2", gpus=["GPU-c"], gpu_product="H100", gpu_count=1)


@pytest.mark.parametrize(
    ("claims", "found"),
    [
        (ONE, []),
        (NodeIdentity(hostname="gpu-1", gpus=["GPU-a"]), []),
        (NodeIdentity(hostname="", gpus=[]), []),
        (None, []),
        (NodeIdentity(hostname="gpu-9", gpus=["GPU-a"]), ["host gpu-9 (enrolled: gpu-1)"]),
        (NodeIdentity(hostname="gpu-1", gpus=["GPU-a", "GPU-c"]), ["GPU GPU-c (not enrolled)"]),
    ],
    ids=["same", "a-gpu-gone", "nothing-claimed", "no-sample", "other-host", "other-gpu"],
)
def test_claims_differ_only_where_they_name_another_machine(
    claims: NodeIdentity | None, found: list[str]
) -> None:
    """Another host name or a GPU not enrolled differ; a GPU gone (the boot check's
    finding) or a claim naming nothing does not; nothing enrolled differs from nothing."""
    assert identity.differences(ONE, claims) == found
    assert identity.differences(None, claims) == []


def test_another_provider_or_instance_type_is_another_machine() -> None:
    """Enrolled on an aws p5.48xlarge: a claim of another instance type or provider
    differs; a claim naming no cloud (no facts yet, on-premises) does not."""
    enrolled = msgspec.structs.replace(ONE, provider="aws", instance_type="p5.48xlarge")
    resized = msgspec.structs.replace(enrolled, instance_type="p4d.24xlarge")
    moved = msgspec.structs.replace(enrolled, provider="gcp", instance_type="")
    unsaid = msgspec.structs.replace(enrolled, provider="", instance_type="")
    assert identity.differences(enrolled, resized) == [
        "instance type p4d.24xlarge (enrolled: p5.48xlarge)"
    ]
    assert identity.differences(enrolled, moved) == ["provider gcp (enrolled: aws)"]
    assert identity.differences(enrolled, unsaid) == []
    assert identity.summary(enrolled) == (
        "host gpu-1, 2 GPUs (H100), aws p5.48xlarge: GPU-a, GPU-b"
    )


def test_the_largest_real_identity_fits_its_bound() -> None:
    """64 GPUs, a 255-character host name, a 128-character product and the longest cloud
    facts still fit MAX_IDENTITY_BYTES: the bound refuses only a forger's identity."""
    uuids = [f"GPU-{index:08x}-aaaa-bbbb-cccc-dddddddddddd" for index in range(64)]
    largest = NodeIdentity(
        hostname="h" * 255,
        gpus=uuids,
        gpu_product="P" * 128,
        gpu_count=72,
        gpu_passthrough=8,
        provider="p" * MAX_IDENTITY_FACT,
        region="r" * MAX_IDENTITY_FACT,
        instance_type="i" * MAX_IDENTITY_FACT,
    )
    assert identity.recordable(largest) == largest
    assert len(codec.encode(largest)) <= MAX_IDENTITY_BYTES


async def test_approval_records_the_identity_of_the_key_approved(bus: NatsBus, prefix: str) -> None:
    """A pending name keeps its first registration's identity, for that key only (a
    candidate key's is not kept), and the one approved becomes the enrolled identity;
    approving the same key again keeps it, a new key starts without one; only an
    operator's confirmation replaces it, and it needs an approved, unrevoked key and an
    identity of at most MAX_IDENTITY_BYTES."""
    subjects = Subjects(prefix)
    first, second = signing.KeyPair.generate(), signing.KeyPair.generate()
    record = pending.new_record("n1", "c1", first.public_key, "", 1.0, identity=ONE)
    with_two = pending.with_candidate(record, second.public_key, "c1", 2.0)
    assert with_two is not None
    assert pending.identity_of_key(with_two, first.public_key) == ONE
    assert pending.identity_of_key(with_two, second.public_key) is None
    huge = NodeIdentity(hostname="h", gpus=["GPU-" + "\x00" * 120] * 64)
    assert identity.recordable(huge) is None and identity.recordable(ONE) == ONE
    with pytest.raises(FleetError, match="over 4096: not recorded"):
        await confirm_identity(bus, subjects, "n1", huge, by="fleetctl")
    await approve(bus, subjects, "n1", second.public_key, by="fleetctl", identity=TWO)
    entry = await trust_entry(bus, subjects, "n1")
    assert entry is not None and entry.identity == TWO and entry.identity_by == "fleetctl"
    await approve(bus, subjects, "n1", second.public_key, by="fleetctl")
    again = await trust_entry(bus, subjects, "n1")
    assert again is not None and again.identity == TWO and again.identity_at == entry.identity_at
    await approve(bus, subjects, "n1", first.public_key, by="fleetctl")
    rekeyed = await trust_entry(bus, subjects, "n1")
    assert rekeyed is not None and rekeyed.identity is None
    await confirm_identity(bus, subjects, "n1", ONE, by="fleetctl")
    confirmed = await trust_entry(bus, subjects, "n1")
    assert confirmed is not None and confirmed.identity == ONE
    assert confirmed.public_key == first.public_key and not confirmed.revoked
    await revoke(bus, subjects, "n1")
    with pytest.raises(FleetError, match="no approved key"):
        await confirm_identity(bus, subjects, "n1", TWO, by="fleetctl")
    with pytest.raises(FleetError, match="no approved key"):
        await confirm_identity(bus, subjects, "n9", TWO, by="fleetctl")


async def test_a_token_enrollment_records_the_registrations_identity(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """A registration with a valid enrollment token approves its key and records the
    identity it carried, named after the token; one without an identity, or with one over
    MAX_IDENTITY_BYTES (a pending record would keep none either), enrolls with none."""
    await fleet.start_aggregator(trust_operators=[OPERATOR.public_key])
    token, record = enroll.issue(OPERATOR, "c1", 3600.0, 3)
    await enroll.store(bus, Subjects(prefix), record)
    huge = NodeIdentity(hostname="h", gpus=["GPU-" + "\x00" * 120] * 64)
    async with attacker(fleet.url) as nc:
        for node, carried in (("n1", ONE), ("n2", None), ("n3", huge)):
            key = signing.KeyPair.generate()
            registration = Registration(
                node_id=node,
                cluster="c1",
                public_key=key.public_key,
                ts=time.time(),
                enroll_token=token,
                identity=carried,
            )
            body = codec.encode(registration)
            reply = await nc.request(
                Subjects(prefix).register(), body, timeout=5, headers=key.headers(body)
            )
            assert codec.decode(reply.data, RegistrationReply).status == "active"
    one = await trust_entry(bus, Subjects(prefix), "n1")
    assert one is not None and one.identity == ONE
    assert one.identity_by == f"enroll:{record.id}" and one.identity_at is not None
    for node in ("n2", "n3"):
        none = await trust_entry(bus, Subjects(prefix), node)
        assert none is not None and none.identity is None and none.identity_by == ""


async def test_a_pending_record_keeps_a_registrations_identity_within_its_bound(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """A registration's identity is kept in the pending record it makes, for ``fleetctl
    approve``; one over MAX_IDENTITY_BYTES is not (the registration is still taken), so
    registrations, which cost nothing, cannot fill fleet_nodes with identities."""
    await fleet.start_aggregator()
    huge = NodeIdentity(hostname="h", gpus=["GPU-" + "\x00" * 120] * 64)
    async with attacker(fleet.url) as nc:
        for node, carried in (("n1", ONE), ("n2", huge)):
            key = signing.KeyPair.generate()
            registration = Registration(
                node_id=node,
                cluster="c1",
                public_key=key.public_key,
                ts=time.time(),
                identity=carried,
            )
            body = codec.encode(registration)
            reply = await nc.request(
                Subjects(prefix).register(), body, timeout=5, headers=key.headers(body)
            )
            assert codec.decode(reply.data, RegistrationReply).status == "pending"
    kept = await read_record(bus, Subjects(prefix), "n1")
    dropped = await read_record(bus, Subjects(prefix), "n2")
    assert kept.registered_identity == ONE and dropped.registered_identity is None
    assert len(codec.encode(dropped)) < 1024
