"""``kv.latest_value``: one key's current value by a filtered batched direct get."""

from __future__ import annotations

from nats.js.api import KeyValueConfig

from actors.runtime import kv
from actors.runtime.bus import NatsBus

WAIT = 5.0


async def test_latest_value_reads_one_key_newest_value(bus: NatsBus, prefix: str) -> None:
    """The newest value of that key only (not a key sharing its prefix), None when absent
    or deleted, and no consumer left on the bucket's stream."""
    name = f"one_{prefix}"
    bucket = await bus.js.create_key_value(KeyValueConfig(bucket=name, direct=True, history=5))
    assert await kv.latest_value(bus, name, "n1", WAIT) is None
    for key, value in [("n1", b"1"), ("n10", b"x"), ("n1", b"2"), ("n2", b"y"), ("n1", b"3")]:
        await bucket.put(key, value)
    assert await kv.latest_value(bus, name, "n1", WAIT) == b"3"
    assert await kv.latest_value(bus, name, "n10", WAIT) == b"x"
    assert await kv.latest_value(bus, name, "absent", WAIT) is None
    await bucket.delete("n2")
    assert await kv.latest_value(bus, name, "n2", WAIT) is None
    assert (await bus.js.stream_info(f"KV_{name}")).state.consumer_count == 0
