"""Batched direct gets give up on a page whose answers never come after PAGE_TIMEOUT,
not at the end of the whole read's time."""

from __future__ import annotations

import time

import pytest
from nats.aio.msg import Msg

from actors.runtime import direct_get
from actors.runtime.bus import NatsBus


async def test_a_page_never_answered_fails_the_read_after_page_timeout(
    bus: NatsBus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A direct get taken by a responder that never answers (as a request lost to a frozen
    server or a cut link is) fails the read after PAGE_TIMEOUT, though the read was given
    a minute: an aggregator paused during a load held no partition for 100 s."""
    monkeypatch.setattr(direct_get, "PAGE_TIMEOUT", 0.3)
    asked: list[str] = []

    async def silent(msg: Msg) -> None:
        asked.append(msg.subject)

    await bus.subscribe(f"{bus.js_api_prefix}.DIRECT.GET.SILENT", silent)
    await bus.flush()
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        async for _ in direct_get.pages(bus, "SILENT", "silent.>", timeout=60.0):
            pass
    assert asked == [f"{bus.js_api_prefix}.DIRECT.GET.SILENT"]
    assert time.monotonic() - started < 10.0
