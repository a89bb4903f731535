"""Logs an operator can follow: every line an agent's actors log carries ``node`` as a
structured field (not text), and at debug each heartbeat sent and acknowledged is one line
with its seq, the stream's seq, its size and the node's health score."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest

from actors.runtime import logs
from tests.support.fleet import Fleet, wait_for


@pytest.fixture
def json_lines() -> Iterator[io.StringIO]:
    """Log records as the agent's JSON lines, at debug, captured for the test."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logs.JsonFormatter())
    handler.addFilter(logs.BoundFields())
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        yield stream
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


def records(stream: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in stream.getvalue().splitlines() if line.strip()]


async def test_two_agents_in_one_process_tag_their_own_lines(
    fleet: Fleet, json_lines: io.StringIO
) -> None:
    """Two agents in one process: each one's heartbeat lines carry its own node field,
    with seq, stream_seq and bytes, and the message text does not name the node."""
    await fleet.start_aggregator()
    first = await fleet.start_agent(fleet.config("n1"))
    await fleet.start_agent(fleet.config("n2"))

    def beats() -> list[dict[str, object]]:
        return [
            entry
            for entry in records(json_lines)
            if entry["msg"] == "heartbeat sent and acknowledged"
        ]

    await wait_for(lambda: {entry.get("node") for entry in beats()} >= {"n1", "n2"})
    for entry in beats():
        assert entry["logger"] == "actors.node.heartbeat.actor" and entry["level"] == "debug"
        assert isinstance(entry["seq"], int) and isinstance(entry["stream_seq"], int)
        assert isinstance(entry["bytes"], int) and entry["bytes"] > 100
        assert "n1" not in str(entry["msg"]) and "n2" not in str(entry["msg"])
    await first.stop()  # its stop's lines (the shutdown drain's) carry its node too
    stopping = [entry for entry in records(json_lines) if entry["msg"] == "drained before shutdown"]
    assert [entry.get("node") for entry in stopping] == ["n1"]
    agent_lines = [
        entry for entry in records(json_lines) if str(entry["logger"]).startswith("actors.node")
    ]
    assert agent_lines and all(entry.get("node") in ("n1", "n2") for entry in agent_lines)


async def test_heartbeat_lines_carry_the_health_score(
    fleet: Fleet, json_lines: io.StringIO
) -> None:
    """Once the health actor has reported, each heartbeat line names the node's health
    status and score as that heartbeat carries them (null before the first report)."""
    await fleet.start_aggregator()
    await fleet.start_agent(fleet.config("n1"))

    def scored() -> list[dict[str, object]]:
        return [
            entry
            for entry in records(json_lines)
            if entry["msg"] == "heartbeat sent and acknowledged"
            and entry.get("health_score") is not None
        ]

    await wait_for(lambda: len(scored()) >= 2)
    for entry in scored():
        score = entry["health_score"]
        assert isinstance(score, int) and 0 <= score <= 100
        assert entry["health"] in ("healthy", "degraded", "unhealthy")


def test_bound_fields_yield_to_the_records_own() -> None:
    """A field the record sets itself wins over the bound one; outside the block, none."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logs.JsonFormatter())
    handler.addFilter(logs.BoundFields())
    logger = logging.getLogger("tests.bound")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        with logs.bound(node="a"):
            logger.info("one")
            logger.info("two", extra={"node": "b"})
        logger.info("three")
    finally:
        logger.removeHandler(handler)
    lines = records(stream)
    assert [entry.get("node") for entry in lines] == ["a", "b", None]
