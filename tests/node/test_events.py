"""Node actors take in events through one gate: events this agent process published (or an
operator's fault injection) in, typed; everything else dropped, and counted and logged
once per message, not once per actor."""

from __future__ import annotations

import logging
import string
import time
from pathlib import Path
from typing import Any

import pytest
from nats.aio.msg import Msg

from actors.node.events import NodeEvents
from actors.node.metrics import AgentMetrics
from actors.node.session import Session
from schemas import codec, signing
from schemas.events import HEADER_SESSION_SEQ, HEADER_SESSION_TAG, Event, Inject, NodeState
from tests.support.fleet import agent_config

BASE64 = string.ascii_uppercase + string.ascii_lowercase + string.digits + "+/"
STATE = "fleet.evt.n1.state"
INJECT = "fleet.evt.n1.inject"


def message(
    subject: str,
    data: bytes,
    key: signing.KeyPair | None = None,
    headers: dict[str, str] | None = None,
) -> Msg:
    """A message as a client sends it: signed by ``key`` if given, plus ``headers``."""
    signed = {**(key.headers(data) if key is not None else {}), **(headers or {})}
    return Msg(None, subject=subject, data=data, headers=signed or None)  # type: ignore[arg-type]


def tagged(events: NodeEvents, subject: str, data: bytes) -> Msg:
    """A message as this process publishes it: signed by the node key and session-tagged."""
    return Msg(None, subject=subject, data=data, headers=events.headers(subject, data))  # type: ignore[arg-type]


def dropped(metrics: AgentMetrics, reason: str, actor: str = "") -> float:
    """Messages dropped for ``reason``, by ``actor`` (by every actor if "")."""
    return sum(
        sample.value
        for metric in metrics.events_dropped.collect()
        for sample in metric.samples
        if sample.name.endswith("_total")
        and sample.labels["reason"] == reason
        and actor in ("", sample.labels["actor"])
    )


class Seen:
    """What a handler was handed."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    async def handle(self, event: Event) -> None:
        self.events.append(event)


def channel(tmp_path: Path, **settings: Any) -> tuple[NodeEvents, AgentMetrics]:
    metrics = AgentMetrics()
    config = agent_config("nats://unused", "t", tmp_path, **settings)
    return NodeEvents(config, signing.KeyPair.generate(), metrics), metrics


async def test_only_events_this_process_published_reach_the_handler(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """An event this process tagged reaches the handler typed; an unsigned one, one signed
    by another key, one signed by the node key without the process's tag, one whose tag
    is not the process's, one taken before, an operator inject with a broken signature, a
    malformed body and an unknown kind are each logged and counted, and never reach it."""
    operator, stranger = signing.KeyPair.generate(), signing.KeyPair.generate()
    events, metrics = channel(tmp_path, trust_operators=[operator.public_key])
    node = events.key
    seen = Seen()
    handler = events.decoding("test", seen.handle)
    state = NodeState(ts=2.0, schedulability="cordoned", reason="test")
    body = codec.encode(state)
    older = codec.encode(NodeState(ts=1.0, schedulability="schedulable"))
    own = tagged(events, STATE, body)
    await handler(own)
    inject = codec.encode(Inject(ts=time.time(), node_id="n1", fault="clear"))
    with caplog.at_level(logging.DEBUG, logger="actors.node.events"):
        await handler(message(STATE, body))
        await handler(message(STATE, body, stranger))
        await handler(message(STATE, body, node))
        await handler(Msg(None, subject=STATE, data=older, headers=own.headers))  # type: ignore[arg-type]
        await handler(own)
        await handler(Msg(None, subject=INJECT, data=inject, headers=operator.headers(older)))  # type: ignore[arg-type]
        await handler(tagged(events, STATE, b"\xff not json"))
        await handler(tagged(events, "fleet.evt.n1.gossip", body))
    assert seen.events == [state]
    reasons = [
        "unsigned",
        "untrusted_key",
        "no_session",
        "bad_session",
        "replayed",
        "bad_signature",
        "malformed",
    ]
    assert {reason: dropped(metrics, reason) for reason in reasons} == {
        "unsigned": 1,
        "untrusted_key": 1,
        "no_session": 1,
        "bad_session": 1,
        "replayed": 1,
        "bad_signature": 1,
        "malformed": 2,
    }
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [r.reason for r in warned] == reasons  # type: ignore[attr-defined]


async def test_a_tag_binds_its_subject_counter_and_body(tmp_path: Path) -> None:
    """A tag moved to another subject, given another counter, or a counter that is not a
    plain decimal number (too long, signed, not ASCII) is refused as not the process's."""
    events, metrics = channel(tmp_path)
    seen = Seen()
    handler = events.decoding("test", seen.handle)
    body = codec.encode(NodeState(ts=1.0, schedulability="drained", deregistering=True))
    own = tagged(events, STATE, body)
    assert own.headers is not None
    tag = own.headers[HEADER_SESSION_TAG]
    for subject, seq in [
        ("fleet.evt.n1.interruption", own.headers[HEADER_SESSION_SEQ]),
        (STATE, str(int(own.headers[HEADER_SESSION_SEQ]) + 1)),
        (STATE, "9" * 40),
        (STATE, "-1"),
        (STATE, "\u0661"),  # ARABIC-INDIC DIGIT ONE: decimal, not ASCII
    ]:
        await handler(
            message(subject, body, None, {HEADER_SESSION_SEQ: seq, HEADER_SESSION_TAG: tag})
        )
    await handler(
        message(STATE, body, None, {HEADER_SESSION_SEQ: "1", HEADER_SESSION_TAG: "é" * 64})
    )
    assert seen.events == []
    assert dropped(metrics, "bad_session") == 6


async def test_each_subscription_takes_a_tagged_event_once_and_none_from_before_it(
    tmp_path: Path,
) -> None:
    """Every subscription takes a tagged event once, in order (a copy sent again, or an
    older counter after a newer one, is replayed), and a subscription made after an event
    was published refuses it: an actor restarted cannot be fed a captured event."""
    events, metrics = channel(tmp_path)
    first, second, later = Seen(), Seen(), Seen()
    handlers = [events.decoding("a", first.handle), events.decoding("b", second.handle)]
    older = NodeState(ts=1.0, schedulability="cordoned")
    newer = NodeState(ts=2.0, schedulability="schedulable")
    old_msg = tagged(events, STATE, codec.encode(older))
    new_msg = tagged(events, STATE, codec.encode(newer))
    for handler in handlers:
        await handler(old_msg)
        await handler(new_msg)
        await handler(old_msg)
        await handler(new_msg)
    assert first.events == second.events == [older, newer]
    restarted = events.decoding("a", later.handle)
    await restarted(new_msg)
    assert later.events == []
    assert dropped(metrics, "replayed") == 3  # each copy once, whichever actor refused it


async def test_operator_injects_are_taken_once_within_their_lifetime_for_this_node(
    tmp_path: Path,
) -> None:
    """A trusted operator may sign a fault injection, not any other event; each actor takes
    one injection once (the same bytes again, or the same signature written another way,
    are replayed), not one for another node, nor one older than max_command_lifetime or
    further ahead than max_skew."""
    operator = signing.KeyPair.generate()
    events, metrics = channel(
        tmp_path, trust_operators=[operator.public_key], max_command_lifetime=60.0, max_skew=5.0
    )
    seen, other = Seen(), Seen()
    handler, other_handler = (
        events.decoding("test", seen.handle),
        events.decoding("o", other.handle),
    )
    inject = Inject(ts=time.time(), node_id="n1", fault="clear")
    body = codec.encode(inject)
    await handler(message(INJECT, body, operator))
    await other_handler(message(INJECT, body, operator))
    await handler(message(INJECT, body, operator))
    # The last base64 letter before "==" carries 4 bits no byte uses: flipping one spells
    # the same signature another way, which still verifies.
    signature = operator.headers(body)[signing.HEADER_SIG]
    respelt = signature[:-3] + BASE64[BASE64.index(signature[-3]) ^ 1] + signature[-2:]
    headers = {**operator.headers(body), signing.HEADER_SIG: respelt}
    assert signing.verify(headers, body) == operator.public_key
    await handler(Msg(None, subject=INJECT, data=body, headers=headers))  # type: ignore[arg-type]
    state = codec.encode(NodeState(ts=1.0, schedulability="drained"))
    await handler(message(STATE, state, operator))
    for stale in (
        Inject(ts=time.time(), node_id="n2", fault="clear"),
        Inject(ts=time.time() - 120, node_id="n1", fault="clear"),
        Inject(ts=time.time() + 60, node_id="n1", fault="clear"),
    ):
        await handler(message(INJECT, codec.encode(stale), operator))
    assert seen.events == other.events == [inject]
    assert dropped(metrics, "untrusted_key") == 1
    assert dropped(metrics, "misaddressed") == 1
    assert dropped(metrics, "expired") == 2
    assert dropped(metrics, "replayed") == 2


async def test_drop_warnings_are_rate_limited(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """A flood of forged events is one warning per reason a minute, the rest at debug
    level, while the counter counts every one."""
    events, metrics = channel(tmp_path)

    async def handle(event: Event) -> None:
        raise AssertionError("a forged event got through")

    handler = events.decoding("test", handle)
    body = codec.encode(NodeState(ts=1.0, schedulability="drained"))
    with caplog.at_level(logging.DEBUG, logger="actors.node.events"):
        for _ in range(100):
            await handler(message(STATE, body))
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
    assert dropped(metrics, "unsigned") == 100


async def test_a_refusal_is_counted_and_logged_once_for_all_actors(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """A forged message reaching nine actors is one refusal (one count, one warning) under
    the first actor it reached; the same bytes sent three times are three, however the
    actors' copies interleave, and so are two bodies alike but in the middle."""
    events, metrics = channel(tmp_path)
    handlers = [events.decoding(f"actor{n}", Seen().handle) for n in range(9)]
    body = codec.encode(NodeState(ts=1.0, schedulability="drained", deregistering=True))
    forged = message(STATE, body, events.key)
    with caplog.at_level(logging.WARNING, logger="actors.node.events"):
        for handler in handlers:
            await handler(forged)
    assert dropped(metrics, "no_session") == 1 == dropped(metrics, "no_session", "actor0")
    assert len(caplog.records) == 1
    # Copies 2 and 3: actor0 runs ahead of the others, which then catch up.
    await handlers[0](forged)
    await handlers[0](forged)
    for handler in handlers[1:]:
        await handler(forged)
        await handler(forged)
    assert dropped(metrics, "no_session") == 3
    # Two bodies alike but in the middle (one mark): two messages, whatever the order.
    alike = [b"a" * 200 + middle + b"a" * 200 for middle in (b"x", b"y")]
    for handler in handlers:
        for body in alike:
            await handler(message(STATE, body))
    assert dropped(metrics, "unsigned") == 2


async def test_own_passes_only_this_process_s_messages(tmp_path: Path) -> None:
    """``own`` hands a handler the raw messages this process tagged, each once; a copy
    signed by the node key from elsewhere, an unsigned one and a replay are dropped."""
    events, metrics = channel(tmp_path)
    passed: list[Msg] = []

    async def handle(msg: Msg) -> None:
        passed.append(msg)

    handler = events.own("commands", handle)
    subject, body = "fleet.hb.c1.n1", b'{"deregistering":true,"workloads":[]}'
    own = tagged(events, subject, body)
    for msg in (own, message(subject, body, events.key), message(subject, body), own):
        await handler(msg)
    assert passed == [own]
    assert [dropped(metrics, r) for r in ("no_session", "unsigned", "replayed")] == [1, 1, 1]


async def test_an_operator_inject_is_verified_once_for_all_actors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same operator-signed inject reaching several actors costs one Ed25519
    verification; other bytes under the same key and signature are still verified, and
    refused. A tagged event costs none."""
    operator = signing.KeyPair.generate()
    events, metrics = channel(tmp_path, trust_operators=[operator.public_key])
    calls: list[bytes] = []
    verify = signing.verify

    def counting(headers: dict[str, str] | None, body: bytes) -> str:
        calls.append(body)
        return verify(headers, body)

    monkeypatch.setattr(signing, "verify", counting)
    seen = Seen()
    body = codec.encode(Inject(ts=time.time(), node_id="n1", fault="clear"))
    headers = operator.headers(body)
    for actor in ("inventory", "heartbeat", "http_api", "commands"):
        handler = events.decoding(actor, seen.handle)
        await handler(Msg(None, subject=INJECT, data=body, headers=headers))  # type: ignore[arg-type]
    assert len(seen.events) == 4 and len(calls) == 1
    forged = codec.encode(Inject(ts=time.time(), node_id="n1", fault="gpu-lost"))
    handler = events.decoding("test", seen.handle)
    await handler(Msg(None, subject=INJECT, data=forged, headers=headers))  # type: ignore[arg-type]
    assert len(seen.events) == 4 and len(calls) == 2
    assert dropped(metrics, "bad_signature") == 1
    await handler(tagged(events, STATE, codec.encode(NodeState(ts=1.0, schedulability="drained"))))
    assert len(seen.events) == 5 and len(calls) == 2


async def test_a_tagged_event_is_checked_once_for_all_actors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same tagged bytes reaching several actors cost one HMAC; other bytes under the
    same counter and tag are checked again, and refused."""
    events, metrics = channel(tmp_path)
    calls: list[bytes] = []
    tag = Session._tag

    def counting(session: Session, subject: str, seq: str, body: bytes) -> str:
        calls.append(body)
        return tag(session, subject, seq, body)

    monkeypatch.setattr(Session, "_tag", counting)
    seen = Seen()
    handlers = [events.decoding(actor, seen.handle) for actor in ("heartbeat", "spot", "gateway")]
    own = tagged(events, STATE, codec.encode(NodeState(ts=1.0, schedulability="cordoned")))
    calls.clear()  # the tagging itself
    for handler in handlers:
        await handler(own)
    assert len(seen.events) == 3 and len(calls) == 1
    forged = codec.encode(NodeState(ts=2.0, schedulability="drained"))
    await handlers[0](Msg(None, subject=STATE, data=forged, headers=own.headers))  # type: ignore[arg-type]
    assert len(seen.events) == 3 and len(calls) == 2
    assert dropped(metrics, "bad_session") == 1
