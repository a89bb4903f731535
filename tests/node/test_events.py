"""Node actors take in events through one decoder: typed events in, malformed ones dropped."""

from __future__ import annotations

import logging

import pytest
from nats.aio.msg import Msg

from actors.node.events import decoding
from schemas import codec
from schemas.events import Event, NodeState


async def test_decoding_hands_on_typed_events_and_drops_malformed_ones(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A well-formed event reaches the handler typed; a malformed body or an unknown kind is
    logged with its subject and never reaches it."""
    seen: list[Event] = []

    async def handle(event: Event) -> None:
        seen.append(event)

    handler = decoding(handle)
    state = NodeState(ts=1.0, schedulability="cordoned", reason="test")
    await handler(Msg(None, subject="fleet.evt.n1.state", data=codec.encode(state)))  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING, logger="actors.node.events"):
        await handler(Msg(None, subject="fleet.evt.n1.state", data=b"\xff not json"))  # type: ignore[arg-type]
        await handler(Msg(None, subject="fleet.evt.n1.gossip", data=codec.encode(state)))  # type: ignore[arg-type]
    assert seen == [state]
    subjects = [record.subject for record in caplog.records]  # type: ignore[attr-defined]
    assert subjects == ["fleet.evt.n1.state", "fleet.evt.n1.gossip"]
