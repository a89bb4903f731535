"""Poison messages: malformed signature headers and handler failures never restart an
actor, are counted, and are settled for good (never redelivered)."""

from __future__ import annotations

import asyncio

from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, ConsumerInfo, StreamConfig

from actors.fleet.metrics import AggregatorMetrics
from actors.fleet.operator.commands import new_command
from actors.fleet.storage.registry import approve
from actors.runtime.bus import NatsBus
from actors.runtime.consumer import DurableConsumer, consume_forever
from schemas import codec, signing
from schemas.errors import SignatureError
from schemas.messages import Cordon, command_digest
from schemas.subjects import STREAM_COMMANDS, STREAM_HEARTBEATS, Subjects, partition_of
from tests.security.attack import attacker, counted, restarts
from tests.support.commanding import Results
from tests.support.fleet import (
    TEST_LIMITS,
    Fleet,
    heartbeat,
    new_aggregator,
    wait_for,
    wait_record,
)

NON_ASCII_SIG = "é" * 88
NON_ASCII_KEY = "Ü" * 56


async def refusals_reach(metrics: AggregatorMetrics, count: int) -> None:
    """Wait until ``count`` heartbeats were refused for their signature or key, whichever
    check caught them."""

    def refused() -> float:
        return sum(
            counted(metrics.registry, "fleet_heartbeats_refused", kind=kind)
            for kind in ("bad_signature", "unknown_node")
        )

    await wait_for(lambda: refused() == count)


def test_verify_refuses_every_malformed_header() -> None:
    key = signing.KeyPair.generate()
    for headers in (
        {"Fleet-Key": key.public_key, "Fleet-Sig": NON_ASCII_SIG},
        {"Fleet-Key": NON_ASCII_KEY, "Fleet-Sig": "AAAA"},
        {"Fleet-Key": "", "Fleet-Sig": ""},
        {"Fleet-Key": key.public_key, "Fleet-Sig": "=" * 3},
        {"Fleet-Key": "U" + "\x00" * 55, "Fleet-Sig": "AAAA"},
    ):
        try:
            signing.verify(headers, b"{}")
        except SignatureError:
            continue
        raise AssertionError(f"accepted {headers!r}")


async def test_poisoned_heartbeats_restart_nothing_and_are_counted(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    subjects = Subjects(prefix)
    key = signing.KeyPair.generate()
    await approve(bus, subjects, "n1", key.public_key)
    metrics = AggregatorMetrics()
    aggregator = new_aggregator(bus, prefix, metrics)
    supervisor = await fleet.start_supervisor(aggregator)
    body = codec.encode(heartbeat(seq=1))
    poisons = [
        {"Fleet-Key": key.public_key, "Fleet-Sig": NON_ASCII_SIG},
        {"Fleet-Key": NON_ASCII_KEY, "Fleet-Sig": NON_ASCII_SIG},
        {"Fleet-Key": key.public_key, "Fleet-Sig": "not base64 at all!"},
        {"Fleet-Key": key.public_key, "Fleet-Sig": "AAAA", "X-Garbage": "\x01\x02"},
    ]
    async with attacker(fleet.url) as nc:
        js = nc.jetstream()
        for count, headers in enumerate(poisons, start=1):
            await js.publish(subjects.heartbeat("c1", "n1"), body, headers=headers)
            # FLEET_HB keeps one message per node: each is handled before the next.
            await refusals_reach(metrics, count)
        await js.publish(subjects.heartbeat("c1", "n1"), body, headers=key.headers(body))
        await wait_record(bus, prefix, "n1", lambda record: record.last_seq == 1)
        stream = subjects.stream_name(STREAM_HEARTBEATS)
        durable = subjects.partition_consumer(
            "aggregator", partition_of("n1", TEST_LIMITS.partitions)
        )

        async def settled() -> ConsumerInfo | None:
            # The fetch is acked once its record write is done: the server may see the
            # ack a moment after the record.
            info = await js.consumer_info(stream, durable)
            return info if info.num_ack_pending == 0 else None

        info = await wait_for(settled)
    assert restarts(supervisor) == {"aggregator": 0}
    assert info.num_redelivered == 0
    assert counted(metrics.registry, "fleet_heartbeats_accepted") == 1


async def test_poisoned_command_restarts_nothing(fleet: Fleet, bus: NatsBus, prefix: str) -> None:
    subjects = Subjects(prefix)
    operator = signing.KeyPair.generate()
    results = await Results().start(bus, prefix)
    agent = await fleet.start_agent(fleet.config(trust_operators=[operator.public_key]))
    assert agent.supervisor is not None and await agent.supervisor.wait_ready(10)
    poisoned = new_command("n1", "c1", Cordon())
    body = codec.encode(poisoned)
    async with attacker(fleet.url) as nc:
        js = nc.jetstream()
        await js.publish(
            subjects.command("c1", "n1"),
            body,
            headers={"Fleet-Key": operator.public_key, "Fleet-Sig": NON_ASCII_SIG},
        )
        # The node could not verify it, so the refusal names only the body's digest.
        final = await results.final(command_digest(body))
        assert final.command_id == ""
        assert final.status == "rejected"
        good = new_command("n1", "c1", Cordon())
        good_body = codec.encode(good)
        await js.publish(
            subjects.command("c1", "n1"), good_body, headers=operator.headers(good_body)
        )
        await wait_for(lambda: "accepted" in results.statuses(good.id))

        async def settled() -> ConsumerInfo | None:
            # The agent acks a command after publishing its result: the server may see
            # the ack a moment after the result.
            info = await js.consumer_info(subjects.stream_name(STREAM_COMMANDS), "cmd_c1_n1")
            return info if info.num_ack_pending == 0 else None

        info = await wait_for(settled)
    assert restarts(agent.supervisor)["commands"] == 0
    assert info.num_redelivered == 0


async def test_a_handler_failure_terminates_only_its_message(bus: NatsBus, prefix: str) -> None:
    """The generic loop: a message its handler cannot digest is counted and terminated
    (never redelivered), the loop goes on with the next."""
    stream = f"POISON_{prefix}"
    await bus.js.add_stream(StreamConfig(name=stream, subjects=[f"{prefix}.poison"]))
    consumer = DurableConsumer(
        bus.js,
        stream,
        f"{prefix}.poison",
        "poison",
        ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=1, max_deliver=3),
    )
    await consumer.open()
    handled: list[bytes] = []
    drops: list[str] = []

    async def handle(msg: Msg) -> None:
        if msg.data == b"poison":
            raise ValueError("cannot digest")
        handled.append(msg.data)
        await msg.ack()

    for body in (b"poison", b"good"):
        await bus.js.publish(f"{prefix}.poison", body)
    loop = asyncio.create_task(
        consume_forever(consumer, handle, batch=1, wait=0.2, what="test", dropped=drops.append)
    )
    try:
        await wait_for(lambda: handled == [b"good"])

        async def settled() -> ConsumerInfo | None:
            # Nothing pending: terminated and acked both, so nothing comes back after
            # ack_wait (the server may see the ack a moment after the handler returned).
            info = await bus.js.consumer_info(stream, "poison")
            return info if info.num_ack_pending == 0 else None

        info = await wait_for(settled)
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
        await consumer.close()
    assert drops == ["handler_error"] and handled == [b"good"]
    assert info.num_ack_pending == 0 and info.num_redelivered == 0
