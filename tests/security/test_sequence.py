"""Sequence numbers: bounded on the wire, bounded jumps, and an operator's reset."""

from __future__ import annotations

import os

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from actors.fleet.config import AggregatorConfig
from actors.fleet.storage.records import read_record
from actors.fleet.storage.registry import approve, reset_seq
from actors.runtime.bus import NatsBus
from schemas import codec, signing
from schemas.errors import DecodeError
from schemas.messages import Alert, Heartbeat
from schemas.subjects import Subjects
from tests.security.attack import attacker
from tests.support.fleet import Fleet, heartbeat, wait_for, wait_record

MAX_JUMP = AggregatorConfig().max_seq_jump


async def beat(nc: Client, prefix: str, key: signing.KeyPair, body: bytes) -> None:
    headers = {**key.headers(body), "Nats-Msg-Id": os.urandom(8).hex()}
    await nc.jetstream().publish(Subjects(prefix).heartbeat("c1", "n1"), body, headers=headers)


def signed_seq(seq: int, boot_id: str = "b1") -> bytes:
    """A heartbeat body with ``seq`` written in by hand: the encoder would not bound it."""
    body = codec.encode(heartbeat(seq=1, boot_id=boot_id))
    return body.replace(b'"seq":1,', f'"seq":{seq},'.encode())


def test_seq_beyond_63_bits_is_refused_at_decode() -> None:
    assert codec.decode(signed_seq(2**63 - 1), Heartbeat, "t").seq == 2**63 - 1
    for seq in (2**63, 2**64):
        with pytest.raises(DecodeError):
            codec.decode(signed_seq(seq), Heartbeat, "t")


async def test_huge_seq_and_big_jumps_never_lock_a_node_out(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    alerts: list[Alert] = []

    async def on_alert(msg: Msg) -> None:
        alerts.append(codec.decode(msg.data, Alert, msg.subject))

    await bus.subscribe(Subjects(prefix).alerts(), on_alert)
    key = signing.KeyPair.generate()
    await approve(bus, Subjects(prefix), "n1", key.public_key)
    await fleet.start_aggregator()
    async with attacker(fleet.url) as nc:
        await beat(nc, prefix, key, signed_seq(5))
        await wait_record(bus, prefix, "n1", lambda record: record.last_seq == 5)
        await beat(nc, prefix, key, signed_seq(2**64))
        await wait_for(lambda: [a for a in alerts if a.kind == "bad_signature"])
        await beat(nc, prefix, key, signed_seq(5 + MAX_JUMP + 1))
        await wait_for(lambda: [a for a in alerts if a.kind == "sequence_gap"])
        await beat(nc, prefix, key, signed_seq(6))
        await wait_record(bus, prefix, "n1", lambda record: record.last_seq == 6)
        await beat(nc, prefix, key, signed_seq(6 + MAX_JUMP))  # the largest jump allowed
        await wait_record(bus, prefix, "n1", lambda record: record.last_seq == 6 + MAX_JUMP)
    (jump,) = [a for a in alerts if a.kind == "sequence_gap" and "refused" in a.details]
    assert jump.details["to"] == str(5 + MAX_JUMP + 1)


async def test_reset_seq_lets_a_reimaged_node_back_in(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    subjects = Subjects(prefix)
    old, new = signing.KeyPair.generate(), signing.KeyPair.generate()
    await approve(bus, subjects, "n1", old.public_key)
    await fleet.start_aggregator()
    async with attacker(fleet.url) as nc:
        await beat(nc, prefix, old, signed_seq(5000))
        await wait_record(bus, prefix, "n1", lambda record: record.last_seq == 5000)
        # Re-imaged: a new key, approved, and a seq that starts again at 1.
        await approve(bus, subjects, "n1", new.public_key)
        await reset_seq(bus, subjects, "n1")
        assert (await read_record(bus, subjects, "n1")).seq_reset
        await beat(nc, prefix, new, signed_seq(1, boot_id="b2"))
        after = await wait_record(bus, prefix, "n1", lambda r: r.last_seq == 1, stored=True)
        assert not after.seq_reset and after.public_key == new.public_key
        await beat(nc, prefix, new, signed_seq(1, boot_id="b2"))  # the reset is used up
        await beat(nc, prefix, new, signed_seq(2, boot_id="b2"))
        await wait_record(bus, prefix, "n1", lambda record: record.last_seq == 2)
