"""A third party holding only the README's wire contract and an Ed25519 library can
verify real heartbeats and use the registration service."""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import time
from pathlib import Path

import nacl.signing
from nats.aio.msg import Msg

from actors.cli.node_agent import main as node_agent
from actors.fleet.storage.records import read_record
from actors.fleet.storage.registry import approve
from actors.runtime.bus import NatsBus
from schemas import codec, signing
from schemas.messages import Registration, RegistrationReply
from schemas.subjects import Subjects
from tests.support.fleet import Fleet, wait_for


def verify_as_a_stranger(headers: dict[str, str], body: bytes) -> dict[str, object]:
    """The README's recipe, with no project code: nkey -> 32 bytes, verify, then parse."""
    raw = base64.b32decode(headers["Fleet-Key"] + "=" * (-len(headers["Fleet-Key"]) % 8))
    key = nacl.signing.VerifyKey(raw[1:-2])
    key.verify(body, base64.b64decode(headers["Fleet-Sig"]))
    parsed: dict[str, object] = json.loads(body)
    return parsed


async def test_every_heartbeat_verifies_with_only_ed25519(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """Heartbeats on fleet.hb.> carry the documented headers and verify by the recipe."""
    seen: list[Msg] = []

    async def collect(msg: Msg) -> None:
        seen.append(msg)

    await bus.subscribe(Subjects(prefix).heartbeats(), collect)
    await bus.flush()
    await fleet.start_aggregator()
    await fleet.start_agent()
    await wait_for(lambda: len(seen) >= 3)
    for msg in seen[:3]:
        assert msg.headers is not None
        body = verify_as_a_stranger(msg.headers, msg.data)
        _, _, cluster, node = msg.subject.split(".")
        assert (body["node_id"], body["cluster"]) == (node, cluster)
        assert msg.headers["Nats-Msg-Id"] == f"{node}:{body['boot_id']}:{body['seq']}"
        assert msg.headers["Nats-TTL"] == "2"
        assert body["seq"] and body["sample"] and body["schedulability"] == "schedulable"


async def test_register_says_pending_then_active(
    fleet: Fleet, bus: NatsBus, prefix: str, tmp_path: Path
) -> None:
    """node-agent register: an unapproved key is pending (and recorded), an approved one
    is active, and a registration signed by another key is rejected."""
    await fleet.start_aggregator()
    key_file = tmp_path / "node.nk"
    key = signing.create_key_file(key_file)
    args = [
        "register",
        "--server",
        fleet.url,
        "--prefix",
        prefix,
        "--node-id",
        "r1",
        "--cluster",
        "c1",
        "--key-file",
        str(key_file),
        "--state-dir",
        str(tmp_path),
    ]
    assert await asyncio.to_thread(node_agent, args) == 0
    assert (await read_record(bus, Subjects(prefix), "r1")).state == "pending"
    await approve(bus, Subjects(prefix), "r1", key.public_key)
    body = codec.encode(
        Registration(
            node_id="r1",
            cluster="c1",
            public_key=key.public_key,
            ts=time.time(),
            hostname=socket.gethostname(),
        )
    )
    reply = await bus.request(Subjects(prefix).register(), body, 5, key.headers(body))
    assert codec.decode(reply.data, RegistrationReply).status == "active"
    other = signing.KeyPair.generate()
    forged = await bus.request(Subjects(prefix).register(), body, 5, other.headers(body))
    assert codec.decode(forged.data, RegistrationReply).status == "rejected"
