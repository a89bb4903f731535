"""Registration spam and squatting: self-signed registrations are rate-limited per key
before all keys, pending records capped in all and per key, a name keeps every key that
registered it (approve without a key refuses to choose among several), pending records
expire, and every refusal says why."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from nats.aio.client import Client

from actors.cli.fleetctl.main import main
from actors.fleet.aggregator import pending
from actors.fleet.storage.records import read_record, read_records
from actors.fleet.storage.registry import trust_entry
from actors.runtime.bus import NatsBus
from schemas import codec, signing
from schemas.messages import MAX_CANDIDATES, NodeRecord, Registration, RegistrationReply
from schemas.subjects import Subjects
from tests.security.attack import attacker
from tests.support.fleet import Fleet, wait_for, wait_record


async def register(
    nc: Client, prefix: str, node: str, key: signing.KeyPair | None = None
) -> RegistrationReply:
    key = key or signing.KeyPair.generate()
    registration = Registration(
        node_id=node, cluster="c1", public_key=key.public_key, ts=time.time()
    )
    body = codec.encode(registration)
    reply = await nc.request(
        Subjects(prefix).register(), body, timeout=5, headers=key.headers(body)
    )
    return codec.decode(reply.data, RegistrationReply, "reply")


async def pending_names(bus: NatsBus, prefix: str) -> list[str]:
    records = await read_records(bus, Subjects(prefix))
    return [record.node_id for record in records if record.state == "pending"]


async def spam(fleet: Fleet, prefix: str, count: int, **settings: Any) -> list[str]:
    await fleet.start_aggregator(**settings)
    async with attacker(fleet.url) as nc:
        return [
            (await register(nc, prefix, f"phantom-{i}")).reason or "pending" for i in range(count)
        ]


async def test_pending_records_are_capped(fleet: Fleet, bus: NatsBus, prefix: str) -> None:
    replies = await spam(fleet, prefix, 12, max_pending=5)
    assert replies == ["pending"] * 5 + ["too many pending registrations"] * 7
    assert len(await pending_names(bus, prefix)) == 5


async def test_registrations_are_rate_limited(fleet: Fleet, bus: NatsBus, prefix: str) -> None:
    replies = await spam(fleet, prefix, 12, registrations_per_minute=8)
    assert replies == ["pending"] * 8 + ["too many registrations; retry later"] * 4
    key = signing.KeyPair.generate()
    async with attacker(fleet.url) as nc:
        assert (await register(nc, prefix, "again", key)).status == "rejected"


async def test_one_key_is_rate_limited(fleet: Fleet, prefix: str) -> None:
    await fleet.start_aggregator(registrations_per_key_per_minute=2)
    key = signing.KeyPair.generate()
    async with attacker(fleet.url) as nc:
        replies = [await register(nc, prefix, f"n{i}", key) for i in range(3)]
        other = await register(nc, prefix, "n9")
    assert [reply.status for reply in replies] == ["pending", "pending", "rejected"]
    assert replies[2].reason == "too many registrations from this key; retry later"
    assert other.status == "pending"


async def test_pending_records_expire(fleet: Fleet, bus: NatsBus, prefix: str) -> None:
    settings = dict(
        max_pending=3, pending_expire_after=0.5, sweep_interval=0.1, full_sweep_interval=0.1
    )
    assert await spam(fleet, prefix, 4, **settings) == ["pending"] * 3 + [
        "too many pending registrations"
    ]
    await wait_for(lambda: _none_pending(bus, prefix))
    async with attacker(fleet.url) as nc:
        assert (await register(nc, prefix, "late")).status == "pending"


async def _none_pending(bus: NatsBus, prefix: str) -> bool:
    return not await pending_names(bus, prefix)


async def record_of(bus: NatsBus, prefix: str, node: str) -> NodeRecord:
    return await read_record(bus, Subjects(prefix), node)


async def approve(
    capsys: pytest.CaptureFixture[str], fleet: Fleet, *args: str
) -> tuple[int, str, str]:
    """``fleetctl approve ARGS`` in this process, its exit code, stdout and stderr."""
    argv = ["approve", *args, "--server", fleet.url, "--prefix", fleet.prefix]
    code = await asyncio.to_thread(main, argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


async def test_a_squatted_name_keeps_the_genuine_key_and_approve_shows_both(
    fleet: Fleet, bus: NatsBus, prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A name registered first by a squatter's key and then by the genuine node's keeps
    both keys; approve without a key lists both fingerprints and approves neither, --yes
    included; approve with the genuine key approves it."""
    await fleet.start_aggregator()
    squatter, genuine = signing.KeyPair.generate(), signing.KeyPair.generate()
    async with attacker(fleet.url) as nc:
        assert (await register(nc, prefix, "gpu-1", squatter)).status == "pending"
        assert (await register(nc, prefix, "gpu-1", genuine)).status == "pending"
        assert (await register(nc, prefix, "gpu-1", squatter)).status == "pending"
    record = await record_of(bus, prefix, "gpu-1")
    assert pending.keys(record) == [squatter.public_key, genuine.public_key]
    for extra in ([], ["--yes"]):
        code, out, err = await approve(capsys, fleet, "gpu-1", *extra)
        assert code == 1 and out == ""
        assert signing.fingerprint(squatter.public_key) in err
        assert signing.fingerprint(genuine.public_key) in err
        assert "2 keys registered gpu-1" in err and "fleetctl approve gpu-1 KEY" in err
        assert await trust_entry(bus, Subjects(prefix), "gpu-1") is None
    code, out, _ = await approve(capsys, fleet, "gpu-1", genuine.public_key)
    assert code == 0 and out == "approved gpu-1\n"
    entry = await trust_entry(bus, Subjects(prefix), "gpu-1")
    assert entry is not None and entry.public_key == genuine.public_key


async def test_one_registered_key_is_approved_with_yes(
    fleet: Fleet, bus: NatsBus, prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """With only one key registered, approve --yes takes it, as before."""
    await fleet.start_aggregator()
    key = signing.KeyPair.generate()
    async with attacker(fleet.url) as nc:
        assert (await register(nc, prefix, "gpu-2", key)).status == "pending"
    code, out, err = await approve(capsys, fleet, "gpu-2", "--yes")
    assert code == 0 and out == "approved gpu-2\n", err
    entry = await trust_entry(bus, Subjects(prefix), "gpu-2")
    assert entry is not None and entry.public_key == key.public_key


async def test_a_name_keeps_at_most_its_candidates(fleet: Fleet, bus: NatsBus, prefix: str) -> None:
    """Past MAX_CANDIDATES more keys, another key's registration of the name is refused
    saying how to approve it by key; the keys kept are unchanged."""
    await fleet.start_aggregator()
    keys = [signing.KeyPair.generate() for _ in range(MAX_CANDIDATES + 2)]
    async with attacker(fleet.url) as nc:
        replies = [await register(nc, prefix, "gpu-3", key) for key in keys]
    assert [r.status for r in replies] == ["pending"] * (MAX_CANDIDATES + 1) + ["rejected"]
    assert replies[-1].reason == (
        f"{MAX_CANDIDATES + 1} keys registered this name already; an operator approves "
        "yours by key (fleetctl approve NODE KEY)"
    )
    record = await record_of(bus, prefix, "gpu-3")
    assert pending.keys(record) == [key.public_key for key in keys[:-1]]


async def test_one_key_cannot_fill_the_pending_cap(fleet: Fleet, bus: NatsBus, prefix: str) -> None:
    """One key registers at most max_pending_per_key names (then it is told so), and
    other keys still register new names."""
    await fleet.start_aggregator(
        max_pending=10, max_pending_per_key=3, registrations_per_key_per_minute=100
    )
    hog = signing.KeyPair.generate()
    async with attacker(fleet.url) as nc:
        replies = [await register(nc, prefix, f"hog-{i}", hog) for i in range(8)]
        others = [await register(nc, prefix, f"new-{i}") for i in range(3)]
    assert [r.reason or r.status for r in replies] == ["pending"] * 3 + [
        "too many pending registrations for this key"
    ] * 5
    assert [r.status for r in others] == ["pending"] * 3
    assert sorted(await pending_names(bus, prefix)) == [
        "hog-0", "hog-1", "hog-2", "new-0", "new-1", "new-2"
    ]  # fmt: skip


async def test_one_keys_flood_does_not_spend_the_shared_rate(fleet: Fleet, prefix: str) -> None:
    """Registrations refused by the per-key limit do not count against the limit of all
    keys: after one key's flood, as many other keys register as that limit allows."""
    await fleet.start_aggregator(registrations_per_minute=10, registrations_per_key_per_minute=2)
    hog = signing.KeyPair.generate()
    async with attacker(fleet.url) as nc:
        flood = [await register(nc, prefix, f"hog-{i % 2}", hog) for i in range(30)]
        others = [await register(nc, prefix, f"new-{i}") for i in range(9)]
    assert [r.status for r in flood] == ["pending"] * 2 + ["rejected"] * 28
    assert {r.reason for r in flood[2:]} == {"too many registrations from this key; retry later"}
    assert [r.status for r in others] == ["pending"] * 8 + ["rejected"]
    assert others[-1].reason == "too many registrations; retry later"


async def test_the_approved_candidate_comes_in_and_the_others_are_gone(
    fleet: Fleet, bus: NatsBus, prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """After a squatter registered n1 first, approving the genuine node's key by name lets
    its agent in: the record goes active under that key, with no candidates left."""
    await fleet.start_aggregator()
    genuine = fleet.node_key("n1")
    async with attacker(fleet.url) as nc:
        assert (await register(nc, prefix, "n1", signing.KeyPair.generate())).status == "pending"
        assert (await register(nc, prefix, "n1", genuine)).status == "pending"
    code, _, err = await approve(capsys, fleet, "n1", genuine.public_key)
    assert code == 0, err
    await fleet.start_agent()
    record = await wait_record(bus, prefix, "n1", lambda r: r.state == "active")
    assert record.public_key == genuine.public_key and record.candidates == []
    assert pending.keys(record) == [genuine.public_key]
