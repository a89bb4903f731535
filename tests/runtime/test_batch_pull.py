"""The aggregator's pull loop against a real server: a caught-up consumer takes what the
stream holds in one no_wait burst and waits the linger between bursts; a deleted consumer
is seen and created again."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, StreamConfig

from actors.runtime import batch_pull
from actors.runtime.batch_pull import (
    CAUGHT_UP_KEPT,
    BatchHandler,
    BatchPuller,
    CaughtUp,
    Chain,
    consume_in_batches,
)
from actors.runtime.bus import NatsBus
from actors.runtime.consumer import DurableConsumer
from tests.support.fleet import wait_for


async def consumer_of(bus: NatsBus, prefix: str) -> DurableConsumer:
    stream = f"PULL_{prefix}"
    await bus.js.add_stream(StreamConfig(name=stream, subjects=[f"{prefix}.pull.>"]))
    consumer = DurableConsumer(
        bus.js,
        stream,
        f"{prefix}.pull.>",
        "puller",
        ConsumerConfig(ack_policy=AckPolicy.ALL, ack_wait=30),
    )
    await consumer.open()
    return consumer


def start_loop(
    puller: BatchPuller, handle: BatchHandler, batch: int, wait: float, linger: float
) -> asyncio.Task[None]:
    """The consume loop over ``puller`` as a task of its own (the test cancels it)."""
    return asyncio.create_task(
        consume_in_batches(
            puller,
            handle,
            batch=batch,
            wait=wait,
            what="test",
            dropped=lambda reason: None,
            linger=linger,
        )
    )


async def test_a_no_wait_fetch_answers_at_once_with_what_is_there(
    bus: NatsBus, prefix: str
) -> None:
    """Five messages stored: a no-wait fetch of three returns three; one of ten returns
    the other two in order at once (the server's 404 ends it, not a timeout). Only the
    second tells the puller it read the stream to its end. Again with nothing there: []
    at once, and the consumer is not taken for deleted. Deleted for real, the next fetch
    says so and the one after creates it again (reading from where its config says)."""
    consumer = await consumer_of(bus, prefix)
    for n in range(5):
        await bus.js.publish(f"{prefix}.pull.{n}", str(n).encode())
    puller = BatchPuller(bus, consumer)
    try:
        started = time.monotonic()
        asked = time.time()
        assert not puller.caught_up.within(asked - 60, asked + 60)
        assert len(await puller.fetch(3, 0.0)) == 3  # as many as asked: more may be there
        assert not puller.caught_up.within(asked - 60, asked + 60)
        first = await puller.fetch(10, 0.0)
        assert [m.data for m in first] == [b"3", b"4"]
        assert puller.caught_up.within(asked, time.time())  # "no messages": read to the end
        await first[-1].ack()
        assert await puller.fetch(10, 0.0) == []
        assert time.monotonic() - started < 1.0
        assert consumer.missing == ""
        await bus.js.delete_consumer(consumer.stream, consumer.durable)
        assert await puller.fetch(10, 0.0) == []
        assert consumer.missing
        await bus.js.publish(f"{prefix}.pull.5", b"5")
        again = await puller.fetch(10, 0.0) or await puller.fetch(10, 0.0)
        # Created again with its config: the stream is read again from its start.
        assert [m.data for m in again] == [str(n).encode() for n in range(6)]
        assert consumer.missing == ""
    finally:
        await puller.close()
        await consumer.close()


async def test_a_long_poll_is_caught_up_only_until_the_server_answered(
    bus: NatsBus, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long poll filled by the first of two stored messages was never caught up after
    the second was stored (it is unread: the batch ended before it), however late the
    process looks; one that expired empty was caught up until its expiry, not until a busy
    process got round to the answer 5 s later (a beat stored meanwhile is unread)."""
    consumer = await consumer_of(bus, prefix)
    puller = BatchPuller(bus, consumer)
    try:
        await bus.js.publish(f"{prefix}.pull.a", b"a")
        await bus.js.publish(f"{prefix}.pull.b", b"b")
        second_stored = time.time()
        assert [m.data for m in await puller.fetch(1, 1.0)] == [b"a"]
        assert not puller.caught_up.within(second_stored, time.time() + 60)
        assert [m.data for m in await puller.fetch(1, 1.0)] == [b"b"]
        looks = iter([0.0])  # the pull leaves at once; its answer is looked at 5 s late

        def busy_clock() -> float:
            return time.time() + next(looks, 5.0)

        monkeypatch.setattr(
            batch_pull, "time", SimpleNamespace(time=busy_clock, monotonic=time.monotonic)
        )
        expires = 0.3
        asked = time.time()
        assert await puller.fetch(5, expires) == []
        assert puller.caught_up.within(asked, asked + expires)
        assert not puller.caught_up.within(asked + expires + 0.1, asked + 60)
    finally:
        await puller.close()
        await consumer.close()


async def test_a_caught_up_loop_takes_a_burst_per_linger(bus: NatsBus, prefix: str) -> None:
    """A message published to an idle consumer is handled well before the long pull's
    wait ends; messages stored while the loop works and lingers come in one batch, acked
    once."""
    consumer = await consumer_of(bus, prefix)
    batches: list[list[bytes]] = []
    working = asyncio.Event()

    async def handle(messages: list[Msg]) -> list[Chain]:
        batches.append([m.data for m in messages])
        await working.wait()
        return []

    loop = start_loop(BatchPuller(bus, consumer), handle, batch=100, wait=5.0, linger=0.5)
    try:

        async def pulling() -> bool:  # idle: the loop waits in a long pull
            info = await bus.js.consumer_info(f"PULL_{prefix}", "puller")
            return (info.num_waiting or 0) >= 1

        await wait_for(pulling)
        started = time.monotonic()
        await bus.js.publish(f"{prefix}.pull.a", b"a")
        await wait_for(lambda: [b"a"] in batches)
        assert time.monotonic() - started < 2.0
        for n in range(20):  # while the loop still works on "a": then one burst
            await bus.js.publish(f"{prefix}.pull.{n}", str(n).encode())
        working.set()
        await wait_for(lambda: sum(len(b) for b in batches) == 21)
        assert batches[1:] == [[str(n).encode() for n in range(20)]]
        await wait_for_acked(bus, consumer)
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
        await consumer.close()


async def wait_for_acked(bus: NatsBus, consumer: DurableConsumer) -> None:
    async def acked() -> bool:
        info = await bus.js.consumer_info(consumer.stream, consumer.durable)
        return bool(info.num_ack_pending == 0 and info.num_pending == 0)

    await wait_for(acked)


async def test_a_cancel_lost_while_handling_still_stops_the_loop(bus: NatsBus, prefix: str) -> None:
    """Python 3.11's ``asyncio.wait_for``, with which nats-py awaits every request (an
    alert's publish, a KV read), returns the answer instead of raising when its task is
    cancelled in the turn the answer came: the cancel is lost. The loop still stops
    before its next fetch, so a released partition's work ends before its lease passes."""
    consumer = await consumer_of(bus, prefix)
    await bus.js.publish(f"{prefix}.pull.a", b"a")
    handling = asyncio.Event()
    answer = asyncio.Event()
    fetches_after: list[int] = []

    async def handle(messages: list[Msg]) -> list[Chain]:
        handling.set()
        await asyncio.wait_for(answer.wait(), 5)  # as nats-py awaits a request's answer
        return []

    class Counting(BatchPuller):
        async def fetch(self, batch: int, expires: float) -> list[Msg]:
            if answer.is_set():
                fetches_after.append(batch)
            return await super().fetch(batch, expires)

    loop = start_loop(Counting(bus, consumer), handle, batch=10, wait=1.0, linger=0.0)
    try:
        await handling.wait()
        answer.set()
        loop.cancel()  # in the same turn as the answer: wait_for returns it
        done, _ = await asyncio.wait({loop}, timeout=3)
        assert loop in done and loop.cancelled()
        assert fetches_after == []
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
        await consumer.close()


def test_caught_up_spans_answer_whether_a_window_held_one() -> None:
    """Points and spans in time order; a window holds one if they overlap; a span that
    touches the last is merged into it; only the newest spans are kept."""
    caught = CaughtUp()
    assert not caught.within(0, 100)
    caught.add(10, 10)
    caught.add(20, 25)
    caught.add(24, 30)  # touches (20, 25): one span (20, 30)
    assert caught.within(9, 11) and caught.within(5, 10.5)
    assert not caught.within(11, 19) and not caught.within(10, 10)
    assert caught.within(29, 40) and caught.within(12, 21)
    assert not caught.within(30, 40) and not caught.within(0, 10)
    for n in range(3 * CAUGHT_UP_KEPT):
        caught.add(100 + n, 100 + n)
    assert caught.within(98 + 3 * CAUGHT_UP_KEPT, 100 + 3 * CAUGHT_UP_KEPT)  # the last
    assert not caught.within(15, 35)  # forgotten: no knowledge is no catch-up


async def test_loops_given_one_share_judge_at_most_that_many_fetches_at_once(
    bus: NatsBus, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three loops over backlogs, sharing a semaphore of two: at most two of them have a
    batch between its fetch's request and the end of its judging at any moment (what
    the connection holds ahead of another reply is two fetches, not one per loop), two
    do at once, and every message is handled all the same."""
    stream = f"PULL_{prefix}"
    await bus.js.add_stream(StreamConfig(name=stream, subjects=[f"{prefix}.pull.>"]))
    consumers = []
    for part in range(3):
        consumer = DurableConsumer(
            bus.js,
            stream,
            f"{prefix}.pull.{part}",
            f"puller{part}",
            ConsumerConfig(ack_policy=AckPolicy.ALL, ack_wait=30),
        )
        await consumer.open()
        consumers.append(consumer)
        for n in range(30):
            await bus.js.publish(f"{prefix}.pull.{part}", str(n).encode())
    inside = peak = handled = 0
    batches: set[int] = set()
    """The batches of no-wait fetches (by their first message), in flight until judged."""
    fetch = BatchPuller.fetch

    async def counted_fetch(puller: BatchPuller, batch: int, wait: float) -> list[Msg]:
        nonlocal inside, peak
        if wait:
            return await fetch(puller, batch, wait)
        inside += 1
        peak = max(peak, inside)
        messages = await fetch(puller, batch, wait)
        if messages:
            batches.add(id(messages[0]))
        else:
            inside -= 1
        return messages

    async def handle(messages: list[Msg]) -> list[Chain]:
        nonlocal inside, handled
        for _ in range(3):  # the other loops run meanwhile
            await asyncio.sleep(0)
        if id(messages[0]) in batches:
            batches.discard(id(messages[0]))
            inside -= 1
        handled += len(messages)
        return []

    monkeypatch.setattr(BatchPuller, "fetch", counted_fetch)
    share = asyncio.Semaphore(2)
    pullers = [BatchPuller(bus, consumer) for consumer in consumers]
    loops = [
        asyncio.create_task(
            consume_in_batches(
                puller,
                handle,
                batch=5,
                wait=0.5,
                what="test",
                dropped=lambda reason: None,
                share=share,
            )
        )
        for puller in pullers
    ]
    try:
        await wait_for(lambda: handled == 90)
    finally:
        for loop in loops:
            loop.cancel()
        await asyncio.gather(*loops, return_exceptions=True)
        for puller, consumer in zip(pullers, consumers, strict=True):
            await puller.close()
            await consumer.close()
    assert peak == 2
