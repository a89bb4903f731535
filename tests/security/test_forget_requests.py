"""``fleet.forget`` under attack, with plain nats-py clients: only a request signed by an
operator key the aggregators trust, fresh and sent once, removes a node; every other one
is answered ``rejected`` with the reason and changes nothing."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import pytest
from nats.aio.client import Client

from actors.fleet.storage.records import read_record
from actors.fleet.storage.registry import trust_entry
from actors.node.agent import NodeAgent
from actors.runtime.bus import NatsBus
from schemas import codec, signing
from schemas.events import Inject
from schemas.messages import Forget, ForgetReply
from schemas.subjects import Subjects
from tests.security.attack import attacker as plain_client
from tests.support.fleet import Fleet, wait_record

OPERATOR = signing.KeyPair.generate()


@pytest.fixture
async def attacker(fleet: Fleet) -> AsyncIterator[Client]:
    async with plain_client(fleet.url) as client:
        yield client


@pytest.fixture
async def node(fleet: Fleet, bus: NatsBus, prefix: str) -> NodeAgent:
    """Node n1 active, under an aggregator that trusts OPERATOR."""
    await fleet.start_aggregator(trust_operators=[OPERATOR.public_key])
    agent = await fleet.start_agent()
    await wait_record(bus, prefix, "n1", lambda r: r.state == "active")
    return agent


async def ask(
    client: Client, prefix: str, body: bytes, headers: dict[str, str] | None
) -> ForgetReply:
    msg = await client.request(Subjects(prefix).forget(), body, timeout=5, headers=headers)
    return codec.decode(msg.data, ForgetReply)


async def assert_unchanged(bus: NatsBus, prefix: str) -> None:
    record = await read_record(bus, Subjects(prefix), "n1")
    entry = await trust_entry(bus, Subjects(prefix), "n1")
    assert record.state == "active" and not record.deregistered
    assert entry is not None and not entry.revoked


def forget(ts: float | None = None) -> bytes:
    return codec.encode(Forget(node_id="n1", ts=time.time() if ts is None else ts, reason="x"))


async def test_unsigned_forged_and_untrusted_requests_change_nothing(
    node: NodeAgent, bus: NatsBus, prefix: str, attacker: Client
) -> None:
    """No signature, a signature over other bytes, a key the aggregators do not trust, a
    body that is not a Forget: each rejected with its reason; the node stays."""
    body = forget()
    stranger = signing.KeyPair.generate()
    tampered = forget(time.time() + 1)
    cases = [
        (body, None, "signature"),
        (tampered, OPERATOR.headers(body), "signature"),
        (body, stranger.headers(body), "do not trust"),
        (b"{}", OPERATOR.headers(b"{}"), "Forget"),
    ]
    for data, headers, reason in cases:
        reply = await ask(attacker, prefix, data, headers)
        assert reply.status == "rejected" and reason in reply.reason, (reason, reply)
    await assert_unchanged(bus, prefix)


async def test_stale_and_replayed_requests_are_rejected(
    node: NodeAgent, bus: NatsBus, prefix: str, attacker: Client
) -> None:
    """A request older than max_skew is rejected; a fresh one works once, and the same
    signed bytes sent again after an operator re-admitted the node are rejected."""
    old = forget(time.time() - 3600)
    reply = await ask(attacker, prefix, old, OPERATOR.headers(old))
    assert reply.status == "rejected" and "off the aggregator's clock" in reply.reason
    await assert_unchanged(bus, prefix)

    body = forget()
    headers = OPERATOR.headers(body)
    reply = await ask(attacker, prefix, body, headers)
    assert reply.status == "forgotten" and reply.revoked
    record = await read_record(bus, Subjects(prefix), "n1")
    assert record.deregistered and record.deregistered_by == OPERATOR.public_key

    again = await ask(attacker, prefix, body, headers)
    assert again.status == "rejected" and again.reason == "request replayed"


async def test_an_operator_signed_inject_is_not_a_forget(
    node: NodeAgent, bus: NatsBus, prefix: str, attacker: Client
) -> None:
    """Issue 30: an operator's signed ``inject`` (published on the node's event subject,
    where others may read it) has a Forget's fields, ``node_id`` and a fresh ``ts``. Its
    bytes sent again to ``fleet.forget`` under its signature are rejected: the body says
    it is an ``inject``. A Forget of an earlier version (no ``type``) is still taken."""
    inject = codec.encode(Inject(ts=time.time(), node_id="n1", fault="temp", value=90.0))
    assert b'"type":"inject"' in inject
    reply = await ask(attacker, prefix, inject, OPERATOR.headers(inject))
    assert reply.status == "rejected" and "inject" in reply.reason, reply
    await assert_unchanged(bus, prefix)
    untyped = forget().replace(b'"type":"forget",', b"")
    assert b'"type"' not in untyped
    reply = await ask(attacker, prefix, untyped, OPERATOR.headers(untyped))
    assert reply.status == "forgotten", reply
