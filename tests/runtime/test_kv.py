"""The KV layer against a real bucket: what a missing, deleted or unreadable value reads
as, and what the one watch loop delivers."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

import msgspec
import nats
import pytest
from nats.aio.msg import Msg
from nats.js.api import KeyValueConfig
from nats.js.kv import KeyValue

from actors.runtime import kv
from actors.runtime.bus import NatsBus
from actors.runtime.embedded import NatsServer
from schemas import codec
from schemas.errors import DecodeError
from tests.support.fleet import subscriptions_at_server

WAIT = 5.0
CAUGHT_UP = ("<caught up>", None)
"""What the watch's ``on_current`` puts on the queue, among the (key, value) changes."""


class Item(msgspec.Struct, frozen=True):
    n: int


Change = tuple[str, Item | None]
Follow = Callable[[], asyncio.Queue[Change]]


@pytest.fixture
async def bucket(bus: NatsBus, prefix: str) -> KeyValue:
    """A bucket of this test's own."""
    return await bus.js.create_key_value(KeyValueConfig(bucket=f"kv_{prefix}"))


@pytest.fixture
async def follow(bucket: KeyValue) -> AsyncIterator[Follow]:
    """Start ``kv.follow`` on the bucket; its changes arrive on the returned queue. The
    watch is cancelled at teardown."""
    tasks: list[asyncio.Task[None]] = []

    def start() -> asyncio.Queue[Change]:
        changes: asyncio.Queue[Change] = asyncio.Queue()
        tasks.append(
            asyncio.create_task(
                kv.follow(
                    bucket,
                    Item,
                    lambda key, value: changes.put_nowait((key, value)),
                    lambda: changes.put_nowait(CAUGHT_UP),
                )
            )
        )
        return changes

    yield start
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def next_changes(changes: asyncio.Queue[Change], count: int) -> list[Change]:
    return [await asyncio.wait_for(changes.get(), WAIT) for _ in range(count)]


async def test_missing_key_reads_as_none(bucket: KeyValue) -> None:
    """A key never written reads as None, with no revision to compare against."""
    assert await kv.read(bucket, "nobody", Item) is None
    assert await kv.read_with_revision(bucket, "nobody", Item) == (None, None)


async def test_deleted_and_purged_keys_read_as_none(bucket: KeyValue) -> None:
    """A deleted or purged key reads as None, with no revision (the writer creates it)."""
    await bucket.put("gone", codec.encode(Item(n=1)))
    await bucket.delete("gone")
    await bucket.put("purged", codec.encode(Item(n=2)))
    await bucket.purge("purged")
    assert await kv.read(bucket, "gone", Item) is None
    assert await kv.read_with_revision(bucket, "purged", Item) == (None, None)


async def test_read_with_revision_names_the_revision_written(bucket: KeyValue) -> None:
    """The typed get with revision returns the value and the revision its put got."""
    revision = await bucket.put("a", codec.encode(Item(n=7)))
    assert await kv.read_with_revision(bucket, "a", Item) == (Item(n=7), revision)


async def test_unreadable_value_raises_decode_error(bucket: KeyValue) -> None:
    """A value that does not decode as the kind raises DecodeError naming its key."""
    await bucket.put("bad", b"not json")
    with pytest.raises(DecodeError, match="key bad"):
        await kv.read(bucket, "bad", Item)


async def test_follow_delivers_current_entries_then_changes(
    bucket: KeyValue, follow: Follow
) -> None:
    """The watch delivers every current entry, calls on_current once, then delivers each
    change, a deletion and a purge as None."""
    await bucket.put("a", codec.encode(Item(n=1)))
    await bucket.put("b", codec.encode(Item(n=2)))
    changes = follow()
    assert await next_changes(changes, 3) == [("a", Item(n=1)), ("b", Item(n=2)), CAUGHT_UP]
    await bucket.put("a", codec.encode(Item(n=3)))
    await bucket.delete("b")
    await bucket.purge("a")
    assert await next_changes(changes, 3) == [("a", Item(n=3)), ("b", None), ("a", None)]
    assert changes.empty()  # on_current was not called again


async def test_follow_calls_on_current_for_an_empty_bucket(
    bucket: KeyValue, follow: Follow
) -> None:
    """An empty bucket is caught up at once; a first entry then arrives as a change."""
    changes = follow()
    assert await next_changes(changes, 1) == [CAUGHT_UP]
    await bucket.put("a", codec.encode(Item(n=1)))
    assert await next_changes(changes, 1) == [("a", Item(n=1))]


class EarlyMarker:
    """A watch as nats-py 2.16 gives it when the server sent every entry before the
    process read one (a busy process; nats-io/nats.py#842): its end-of-data marker
    first, then the entries."""

    def __init__(self, watcher: KeyValue.KeyWatcher) -> None:
        self.watcher = watcher
        self.marked = False

    def __aiter__(self) -> EarlyMarker:
        return self

    async def __anext__(self) -> KeyValue.Entry | None:
        if not self.marked:
            self.marked = True
            return None
        # nats-py leaves its iterator untyped; its own marker, in its place, is skipped.
        while True:
            entry: KeyValue.Entry | None = await self.watcher.__anext__()  # type: ignore[no-untyped-call]
            if entry is not None:
                return entry

    async def stop(self) -> None:
        await self.watcher.stop()  # type: ignore[no-untyped-call]  # nats-py leaves it untyped


async def test_follow_is_current_only_once_every_entry_came_whatever_nats_py_says(
    bucket: KeyValue, follow: Follow, monkeypatch: pytest.MonkeyPatch
) -> None:
    """nats-py's end-of-data marker sent before the entries (as it does when the process
    is busy) does not make the watch current: on_current comes after the last current
    entry, as without the race. (It came first, and the trust watch then held no key of
    2,000 approved nodes: tests/fleet/test_trust.py, on a busy machine.)"""
    await bucket.put("a", codec.encode(Item(n=1)))
    await bucket.put("b", codec.encode(Item(n=2)))
    watch = bucket.watchall

    async def early_marker() -> EarlyMarker:
        return EarlyMarker(await watch())

    monkeypatch.setattr(bucket, "watchall", early_marker)
    changes = follow()
    assert await next_changes(changes, 3) == [("a", Item(n=1)), ("b", Item(n=2)), CAUGHT_UP]
    await bucket.put("a", codec.encode(Item(n=3)))
    assert await next_changes(changes, 1) == [("a", Item(n=3))]
    assert changes.empty()


async def test_follow_delivers_unreadable_value_as_none_and_goes_on(
    bucket: KeyValue, follow: Follow, caplog: pytest.LogCaptureFixture
) -> None:
    """An unreadable value arrives as None, is logged with its key, and the watch goes on."""
    await bucket.put("bad", codec.encode(Item(n=1)))
    changes = follow()
    assert await next_changes(changes, 2) == [("bad", Item(n=1)), CAUGHT_UP]
    with caplog.at_level(logging.WARNING, logger="actors.runtime.kv"):
        await bucket.put("bad", b"not json")
        assert await next_changes(changes, 1) == [("bad", None)]
    logged = [r for r in caplog.records if r.name == "actors.runtime.kv"]
    assert [getattr(r, "key", None) for r in logged] == ["bad"]
    await bucket.put("good", codec.encode(Item(n=2)))
    assert await next_changes(changes, 1) == [("good", Item(n=2))]


async def test_latest_values_reads_every_key_without_a_consumer(
    bus: NatsBus, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """One batched direct get: the current value of each live key (not deleted or purged
    ones), nothing for an empty bucket, at most ``limit`` keys (logged when there are more),
    and no consumer left on the bucket's stream."""
    name = f"direct_{prefix}"
    direct = await bus.js.create_key_value(KeyValueConfig(bucket=name, direct=True))
    assert await kv.latest_values(bus, name, 10, WAIT) == {}
    for key, n in [("a", 1), ("b", 2), ("a", 3), ("gone", 4), ("purged", 5)]:
        await direct.put(key, codec.encode(Item(n=n)))
    await direct.delete("gone")
    await direct.purge("purged")
    values = await kv.latest_values(bus, name, 10, WAIT)
    assert {key: codec.decode(v, Item, key) for key, v in values.items()} == {
        "a": Item(n=3),
        "b": Item(n=2),
    }
    with caplog.at_level(logging.WARNING, logger="actors.runtime.kv"):
        assert len(await kv.latest_values(bus, name, 1, WAIT)) <= 1
    assert [r.getMessage() for r in caplog.records] == ["kv bucket read in part"]
    assert (await bus.js.stream_info(f"KV_{name}")).state.consumer_count == 0


async def test_latest_values_pages_past_the_servers_multi_last_cap(
    bus: NatsBus, prefix: str
) -> None:
    """2,500 keys (the server refuses a ``multi_last`` batch above 1,024, and one page holds
    PAGE_KEYS): every key once, with its newest value, rewritten ones included."""
    name = f"many_{prefix}"
    many = await bus.js.create_key_value(KeyValueConfig(bucket=name, direct=True))
    for first in range(0, 2500, 250):
        await asyncio.gather(
            *(many.put(f"k{i:05d}", codec.encode(Item(n=i))) for i in range(first, first + 250))
        )
    await many.put("k00000", codec.encode(Item(n=-1)))
    await many.delete("k00001")
    values = await kv.latest_values(bus, name, 10_000, WAIT)
    assert len(values) == 2499
    assert codec.decode(values["k00000"], Item, "k00000") == Item(n=-1)
    assert codec.decode(values["k02499"], Item, "k02499") == Item(n=2499)


async def test_latest_pages_asks_for_the_next_page_before_handing_one_over(
    bus: NatsBus, prefix: str, nats_server: NatsServer
) -> None:
    """The request for the second page is at the server before the first page is handed
    over (the server reads it while the caller takes the first in: a cold start's load);
    a caller that stops after the first page leaves no subscription behind for the
    second's answers. Seen by a plain client subscribed to the direct get's subject."""
    name = f"ahead_{prefix}"
    many = await bus.js.create_key_value(KeyValueConfig(bucket=name, direct=True))
    for first in range(0, 1500, 250):
        await asyncio.gather(
            *(many.put(f"k{i:05d}", codec.encode(Item(n=i))) for i in range(first, first + 250))
        )
    monitor = await nats.connect(nats_server.url)
    asked: list[str] = []
    second = asyncio.Event()

    async def seen(msg: Msg) -> None:
        asked.append(msg.reply)
        if len(asked) == 2:
            second.set()

    try:
        await monitor.subscribe(f"{bus.js_api_prefix}.DIRECT.GET.KV_{name}", cb=seen)
        await subscriptions_at_server(monitor, bus, f"probe_{prefix}")
        pages = kv.latest_pages(bus, name, WAIT)
        try:
            assert len(await anext(pages)) == kv.PAGE_KEYS
            async with asyncio.timeout(WAIT):
                await second.wait()
        finally:
            await pages.aclose()
        # The unsubscribe leaves on the bus's connection, the request below on another: the
        # server has it once a round trip of the bus's own comes back.
        await bus.flush()
        with pytest.raises(nats.errors.NoRespondersError):
            await monitor.request(asked[1], b"", timeout=WAIT)
    finally:
        await monitor.close()


async def test_update_many_writes_what_is_at_its_revision_and_refuses_the_rest(
    bus: NatsBus, prefix: str, bucket: KeyValue
) -> None:
    """Checkpoints' batched compare-and-set: a key still at the revision named is written
    (its new revision returned, the value readable), and so is a key never written named
    at revision 0; a key moved on since, a key never written named at a revision, a key
    deleted and a key that exists named at 0 are refused (None) and left as they are; an
    empty batch is nothing."""
    first = await bucket.put("a", codec.encode(Item(1)))
    moved = await bucket.put("b", codec.encode(Item(1)))
    await bucket.put("b", codec.encode(Item(2)))
    gone = await bucket.put("d", codec.encode(Item(1)))
    await bucket.delete("d")
    writes = [
        ("a", codec.encode(Item(10)), first),
        ("b", codec.encode(Item(20)), moved),
        ("c", codec.encode(Item(30)), 99),
        ("d", codec.encode(Item(40)), gone),
        ("e", codec.encode(Item(50)), 0),
        ("a", codec.encode(Item(60)), 0),
    ]
    revisions = await kv.update_many(bus, f"kv_{prefix}", writes, WAIT)
    assert revisions[0] is not None and revisions[0] > first
    assert revisions[1:4] == [None, None, None] and revisions[5] is None
    assert revisions[4] is not None
    assert await kv.read(bucket, "e", Item) == Item(50)
    assert await kv.read_with_revision(bucket, "a", Item) == (Item(10), revisions[0])
    assert await kv.read(bucket, "b", Item) == Item(2)
    assert await kv.read(bucket, "c", Item) is None
    assert await kv.read(bucket, "d", Item) is None
    assert await kv.update_many(bus, f"kv_{prefix}", [], WAIT) == []


async def test_update_many_gives_up_on_answers_that_never_come(bus: NatsBus, prefix: str) -> None:
    """A bucket that does not exist answers nothing (no stream takes the subject): every
    write reads as not done once the timeout ran out, and nothing hangs."""
    revisions = await kv.update_many(bus, f"none_{prefix}", [("a", b"{}", 1)], 0.5)
    assert revisions == [None]


async def test_update_many_takes_no_answer_but_a_well_formed_one_for_its_own_write(
    bus: NatsBus, prefix: str, nats_server: NatsServer
) -> None:
    """A plain client answering in the server's place (a bucket with no stream behind its
    subjects): a body that is not JSON, an error, a sequence of 0, answers naming another
    or no write, and a second answer to a write already answered. Only the one
    well-formed answer counts; every other write reads as not done, and nothing hangs."""
    responder = await nats.connect(nats_server.url)
    inbox_of: dict[str, str] = {}

    async def answer(msg: Msg) -> None:
        key = msg.subject.rpartition(".")[2]
        inbox, _, _ = msg.reply.rpartition(".")
        inbox_of[key] = inbox
        await responder.publish(f"{inbox}.99", b'{"seq": 7}')  # no such write
        await responder.publish(f"{inbox}.x", b'{"seq": 7}')
        replies = {
            "garbled": b"{not json",
            "refused": b'{"error": {"code": 400, "err_code": 10071, "description": "wrong"}}',
            "zero": b'{"seq": 0}',
            "good": b'{"stream": "KV_x", "seq": 42}',
        }
        await responder.publish(msg.reply, replies[key])
        await responder.publish(msg.reply, b'{"seq": 43}')  # answered already

    await responder.subscribe(f"$KV.fake_{prefix}.>", cb=answer)
    try:
        await subscriptions_at_server(responder, bus, f"probe_{prefix}")
        writes = [(key, b"{}", 1) for key in ("garbled", "refused", "zero", "good")]
        revisions = await kv.update_many(bus, f"fake_{prefix}", writes, WAIT)
    finally:
        await responder.close()
    assert revisions == [None, None, None, 42]
    assert len(set(inbox_of.values())) == 1
