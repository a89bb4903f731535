"""Node actors take in events through one gate: verified, typed events in; unsigned,
foreign and malformed ones dropped and counted."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from nats.aio.msg import Msg

from actors.node.events import NodeEvents
from actors.node.metrics import AgentMetrics
from schemas import codec, signing
from schemas.events import Event, Inject, NodeState
from tests.support.fleet import agent_config


def message(subject: str, data: bytes, key: signing.KeyPair | None = None) -> Msg:
    headers = key.headers(data) if key is not None else None
    return Msg(None, subject=subject, data=data, headers=headers)  # type: ignore[arg-type]


def dropped(metrics: AgentMetrics, reason: str) -> float:
    labels = {"actor": "test", "reason": reason}
    return metrics.registry.get_sample_value("node_agent_events_dropped_total", labels) or 0.0


async def test_only_the_nodes_own_verified_events_reach_the_handler(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """A signed, well-formed event reaches the handler typed; an unsigned one, one signed by
    another key or with a broken signature, a malformed body and an unknown kind are each
    logged and counted, and never reach it."""
    node, stranger = signing.KeyPair.generate(), signing.KeyPair.generate()
    metrics = AgentMetrics()
    events = NodeEvents(agent_config("nats://unused", "t", tmp_path), node, metrics)
    seen: list[Event] = []

    async def handle(event: Event) -> None:
        seen.append(event)

    handler = events.decoding("test", handle)
    subject = "fleet.evt.n1.state"
    state = NodeState(ts=2.0, schedulability="cordoned", reason="test")
    body = codec.encode(state)
    older = codec.encode(NodeState(ts=1.0, schedulability="schedulable"))
    await handler(message(subject, body, node))
    with caplog.at_level(logging.DEBUG, logger="actors.node.events"):
        await handler(message(subject, body))
        await handler(message(subject, body, stranger))
        await handler(Msg(None, subject=subject, data=body, headers={**node.headers(older)}))  # type: ignore[arg-type]
        await handler(message(subject, b"\xff not json", node))
        await handler(message("fleet.evt.n1.gossip", body, node))
    assert seen == [state]
    reasons = ["unsigned", "untrusted_key", "bad_signature", "malformed"]
    assert {reason: dropped(metrics, reason) for reason in reasons} == {
        "unsigned": 1,
        "untrusted_key": 1,
        "bad_signature": 1,
        "malformed": 2,
    }
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [r.reason for r in warned] == reasons  # type: ignore[attr-defined]


async def test_operator_keys_may_sign_injects_only(tmp_path: Path) -> None:
    """A trusted operator key may sign a fault injection, not any other event."""
    node, operator = signing.KeyPair.generate(), signing.KeyPair.generate()
    config = agent_config("nats://unused", "t", tmp_path, trust_operators=[operator.public_key])
    metrics = AgentMetrics()
    seen: list[Event] = []

    async def handle(event: Event) -> None:
        seen.append(event)

    handler = NodeEvents(config, node, metrics).decoding("test", handle)
    inject = Inject(ts=1.0, node_id="n1", fault="clear")
    await handler(message("fleet.evt.n1.inject", codec.encode(inject), operator))
    state = codec.encode(NodeState(ts=1.0, schedulability="drained"))
    await handler(message("fleet.evt.n1.state", state, operator))
    assert seen == [inject]
    assert dropped(metrics, "untrusted_key") == 1


async def test_drop_warnings_are_rate_limited(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """A flood of forged events is one warning per actor and reason a minute, the rest at
    debug level, while the counter counts every one."""
    metrics = AgentMetrics()
    events = NodeEvents(
        agent_config("nats://unused", "t", tmp_path), signing.KeyPair.generate(), metrics
    )

    async def handle(event: Event) -> None:
        raise AssertionError("a forged event got through")

    handler = events.decoding("test", handle)
    body = codec.encode(NodeState(ts=1.0, schedulability="drained"))
    with caplog.at_level(logging.DEBUG, logger="actors.node.events"):
        for _ in range(100):
            await handler(message("fleet.evt.n1.state", body))
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
    assert dropped(metrics, "unsigned") == 100


async def test_an_event_is_verified_once_for_all_actors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same signed bytes reaching several actors cost one Ed25519 verification; other
    bytes under the same key and signature are still verified, and refused."""
    node = signing.KeyPair.generate()
    metrics = AgentMetrics()
    events = NodeEvents(agent_config("nats://unused", "t", tmp_path), node, metrics)
    calls: list[bytes] = []
    verify = signing.verify

    def counting(headers: dict[str, str] | None, body: bytes) -> str:
        calls.append(body)
        return verify(headers, body)

    monkeypatch.setattr(signing, "verify", counting)
    seen: list[Event] = []

    async def handle(event: Event) -> None:
        seen.append(event)

    body = codec.encode(NodeState(ts=1.0, schedulability="cordoned"))
    headers = node.headers(body)
    for actor in ("heartbeat", "commands", "spot", "http_api"):
        handler = events.decoding(actor, handle)
        await handler(Msg(None, subject="fleet.evt.n1.state", data=body, headers=headers))  # type: ignore[arg-type]
    assert len(seen) == 4 and len(calls) == 1
    forged = codec.encode(NodeState(ts=2.0, schedulability="drained"))
    handler = events.decoding("test", handle)
    await handler(Msg(None, subject="fleet.evt.n1.state", data=forged, headers=headers))  # type: ignore[arg-type]
    assert len(seen) == 4 and len(calls) == 2
    assert dropped(metrics, "bad_signature") == 1
