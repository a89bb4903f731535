"""The one reader of ``fleet_trust``: what a revoked entry means to everyone who reads it."""

from __future__ import annotations

from actors.fleet import registry
from actors.fleet.node_store import NodeStore
from actors.runtime.bus import NatsBus
from schemas import signing
from schemas.subjects import Subjects


async def test_revoked_entry_yields_no_approved_key(bus: NatsBus, prefix: str) -> None:
    """After revoke the entry is still there, marked revoked, and neither the trust reader
    nor the aggregators' store gives its key."""
    subjects = Subjects(prefix)
    key = signing.KeyPair.generate().public_key
    await registry.approve(bus, subjects, "n1", key, by="test")
    store = NodeStore(bus, subjects)
    assert registry.approved_key(await registry.trust_entry(bus, subjects, "n1")) == key
    assert await store.trusted_key("n1", fresh=True) == key

    await registry.revoke(bus, subjects, "n1")

    entry = await registry.trust_entry(bus, subjects, "n1")
    assert entry is not None
    assert entry.revoked and entry.public_key == key and entry.approved_by == "test"
    assert registry.approved_key(entry) is None
    assert await store.trusted_key("n1", fresh=True) is None


async def test_unknown_node_has_no_trust_entry(bus: NatsBus, prefix: str) -> None:
    """A node never approved has no entry, hence no approved key."""
    subjects = Subjects(prefix)
    assert await registry.trust_entry(bus, subjects, "nobody") is None
    assert registry.approved_key(None) is None
