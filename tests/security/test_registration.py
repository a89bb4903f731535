"""Registration spam: self-signed registrations are rate-limited, pending records capped
and expired, and every refusal says why."""

from __future__ import annotations

import time
from typing import Any

from nats.aio.client import Client

from actors.fleet.registry import read_records
from actors.runtime.bus import NatsBus
from schemas import codec, signing
from schemas.messages import Registration, RegistrationReply
from schemas.subjects import Subjects
from tests.security.attack import attacker
from tests.support.fleet import Fleet, wait_for


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


async def pending(bus: NatsBus, prefix: str) -> list[str]:
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
    assert len(await pending(bus, prefix)) == 5


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
    await wait_for(lambda: _none_pending(bus, prefix), timeout=10)
    async with attacker(fleet.url) as nc:
        assert (await register(nc, prefix, "late")).status == "pending"


async def _none_pending(bus: NatsBus, prefix: str) -> bool:
    return not await pending(bus, prefix)
