"""``fleet.policy`` (``fleetctl policy reset|clear``) under attack, with plain nats-py
clients: only a request signed by an operator key the aggregators trust, fresh, naming
the state it acts on, changes the policy's record; every other one is answered
``rejected`` with the reason and changes nothing."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from nats.aio.client import Client

from actors.fleet.config import AggregatorConfig
from actors.fleet.operator.policy_requests import PolicyRequestsActor
from actors.fleet.remediation.actor import policy_bucket
from actors.runtime import kv
from actors.runtime.bus import NatsBus
from schemas import codec, signing
from schemas.messages import PolicyReply, PolicyRequest
from schemas.remediation import Hold, PolicyRecord
from schemas.subjects import BUCKET_POLICY, Subjects
from tests.security.attack import attacker as plain_client
from tests.support.fleet import Fleet

OPERATOR = signing.KeyPair.generate()
TRIPPED_AT = time.time() - 60
SINCE = time.time() - 600
RECORD = PolicyRecord(
    cluster="c1",
    holds={
        "n1": Hold(
            reason_class="xid",
            reason="XID 79",
            action="cordon",
            command_id="c-0",
            since=SINCE,
            needs_attention=True,
        )
    },
    history={"n1": [SINCE]},
    tripped_at=TRIPPED_AT,
    would=["cordon n2 (policy: xid: XID 79)"],
    limit=2,
)


@pytest.fixture
async def attacker(fleet: Fleet) -> AsyncIterator[Client]:
    async with plain_client(fleet.url) as client:
        yield client


@pytest.fixture
async def tripped(fleet: Fleet, bus: NatsBus, prefix: str) -> PolicyRecord:
    """A tripped breaker and a node needing attention in c1, with the aggregators'
    request service trusting OPERATOR."""
    config = AggregatorConfig(prefix=prefix, trust_operators=[OPERATOR.public_key])
    await fleet.start_supervisor(PolicyRequestsActor(config, bus))
    bucket = await bus.js.create_key_value(policy_bucket(Subjects(prefix)))
    await bucket.put("c1", codec.encode(RECORD))
    return RECORD


def request(**changes: Any) -> bytes:
    values: dict[str, Any] = {
        "action": "reset",
        "cluster": "c1",
        "ts": time.time(),
        "tripped_at": TRIPPED_AT,
    }
    return codec.encode(PolicyRequest(**{**values, **changes}))


async def ask(
    client: Client, prefix: str, body: bytes, headers: dict[str, str] | None
) -> PolicyReply:
    msg = await client.request(Subjects(prefix).policy(), body, timeout=5, headers=headers)
    return codec.decode(msg.data, PolicyReply)


async def stored(bus: NatsBus, prefix: str) -> PolicyRecord | None:
    bucket = await bus.kv(Subjects(prefix).bucket_name(BUCKET_POLICY))
    return await kv.read(bucket, "c1", PolicyRecord)


async def test_unsigned_forged_untrusted_and_stale_requests_change_nothing(
    tripped: PolicyRecord, bus: NatsBus, prefix: str, attacker: Client
) -> None:
    """No signature, a signature over other bytes, a key the aggregators do not trust, a
    body that is not a PolicyRequest, one from an hour ago: each rejected with its
    reason; the breaker stays tripped and the hold stays."""
    body = request()
    clear = request(action="clear", node="n1", since=SINCE, tripped_at=None)
    stranger = signing.KeyPair.generate()
    cases = [
        (body, None, "signature"),
        (clear, None, "signature"),
        (request(ts=time.time() + 1), OPERATOR.headers(body), "signature"),
        (body, stranger.headers(body), "do not trust"),
        (clear, stranger.headers(clear), "do not trust"),
        (b"{}", OPERATOR.headers(b"{}"), "PolicyRequest"),
        (old := request(ts=time.time() - 3600), OPERATOR.headers(old), "off the aggregator"),
    ]
    for data, headers, reason in cases:
        reply = await ask(attacker, prefix, data, headers)
        assert reply.status == "rejected" and reason in reply.reason, (reason, reply)
    assert await stored(bus, prefix) == tripped


async def test_a_request_naming_another_state_changes_nothing(
    tripped: PolicyRecord, bus: NatsBus, prefix: str, attacker: Client
) -> None:
    """A trusted operator's reset of another trip (a copy replayed after the breaker
    tripped again) and a clear of another hold are refused; the ones naming the state
    as it is are carried out, and sent again they are refused."""
    other_trip = request(tripped_at=TRIPPED_AT - 3600)
    reply = await ask(attacker, prefix, other_trip, OPERATOR.headers(other_trip))
    assert reply.status == "rejected" and "tripped again" in reply.reason
    other_hold = request(action="clear", node="n1", since=SINCE - 1, tripped_at=None)
    reply = await ask(attacker, prefix, other_hold, OPERATOR.headers(other_hold))
    assert reply.status == "rejected" and "changed since" in reply.reason
    assert await stored(bus, prefix) == tripped
    reset = request()
    assert (await ask(attacker, prefix, reset, OPERATOR.headers(reset))).status == "done"
    replayed = await ask(attacker, prefix, reset, OPERATOR.headers(reset))
    assert replayed.status == "rejected" and "not tripped" in replayed.reason
    clear = request(action="clear", node="n1", since=SINCE, tripped_at=None)
    assert (await ask(attacker, prefix, clear, OPERATOR.headers(clear))).status == "done"
    again = await ask(attacker, prefix, clear, OPERATOR.headers(clear))
    assert again.status == "rejected" and "holds nothing of n1" in again.reason
    after = await stored(bus, prefix)
    assert after is not None and after.tripped_at is None and after.holds == {}
    assert after.updated_by == OPERATOR.public_key
