"""A command result the stream does not acknowledge is sent again, under its own
``Nats-Msg-Id``, until it is stored once (RESULT_TRIES), never logged and dropped at the
first timeout: the node's one result publisher (actors/node/results.py), so the commands
actor's results and the workload actor's alike."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from actors.fleet.storage.streams import provision
from actors.node import results
from actors.node.results import ResultPublisher
from actors.runtime.bus import NatsBus
from schemas import signing
from schemas.subjects import STREAM_EVENTS, Subjects
from tests.support.fleet import TEST_LIMITS, agent_config, wait_for


async def test_a_result_not_acknowledged_is_sent_again_until_stored_once(
    bus: NatsBus,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """With no FLEET_EVENTS to store it, the result's first try fails; once the stream is
    there, a later try stores it, and the stream holds it once."""
    monkeypatch.setattr(results, "RESULT_RETRY_AFTER", 0.2)
    prefix = "resultsretry"  # no streams until the test makes them
    config = agent_config("", prefix, tmp_path)  # no connection of its own: the bus is given
    publisher = ResultPublisher(config, bus, signing.KeyPair.generate())
    with caplog.at_level(logging.WARNING, logger="actors.node.results"):
        sending = asyncio.create_task(
            publisher.publish("c1", "accepted", "cordon", digest="d1", schedulability="schedulable")
        )
        await wait_for(
            lambda: any(
                r.message.startswith("command result not acknowledged") for r in caplog.records
            )
        )
        subjects = Subjects(prefix)
        await provision(bus.js, subjects, limits=TEST_LIMITS)
        await sending
    info = await bus.js.stream_info(subjects.stream_name(STREAM_EVENTS))
    assert info.state.messages == 1
    assert not [r for r in caplog.records if r.message == "command result not published"]
