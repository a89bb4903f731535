"""How node actors publish and take in the node's events: the one gate every event a node
actor acts on passes through.

Events drive actions (a ``workload_order`` starts a workload, an ``interruption`` drains
and deregisters the node, a ``state`` with ``deregistering`` stops every workload), so an
actor acts on an event only if this agent process published it: its session tag verifies
and is not a replay (:mod:`actors.node.session`). The one exception is a fault injection
(``inject``), which a trusted operator may also sign: taken within max_command_lifetime
(and at most max_skew ahead), addressed to this node, once per actor. A signature by the
node key alone is not enough: a copy of the key may sign from another machine.

Every event is also published signed with the node key (``Fleet-Key``/``Fleet-Sig``):
readers outside this process (``fleetctl watch --events``, the monitor) read it as what the
node claims, as the fleet reads the heartbeat the events are folded into; never as an
instruction.

Anything else is dropped: counted once per message (not once per actor it reached) in
``node_agent_events_dropped_total``, by reason, under the first actor it reached, and
logged (a warning at most once a minute per reason, so a flood cannot flood the log too).
An actor's handler sees only an admitted, typed event to ``match``.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Final

from nats.aio.msg import Msg

from actors.node.config import AgentConfig
from actors.node.metrics import AgentMetrics
from actors.node.session import Replay, Session
from actors.runtime.bounded import remember
from actors.runtime.bus import Bus, Handler
from schemas import codec, signing
from schemas.errors import DecodeError, SignatureError
from schemas.events import (
    HEADER_SESSION_SEQ,
    HEADER_SESSION_TAG,
    Event,
    Inject,
    decode_event,
)
from schemas.signing import KeyPair
from schemas.subjects import EVENT_INJECT, event_kind

log = logging.getLogger(__name__)

EventHandler = Callable[[Event], Awaitable[None]]

DROP_LOG_INTERVAL: Final = 60.0
"""Seconds between two warnings about dropped events for one reason."""
VERIFIED_MEMORY: Final = 64
"""Recently verified operator signatures remembered, so each inject is verified once, not
once per actor."""
REFUSED_MEMORY: Final = 1024
"""Recently refused messages remembered (a mark, and how many of its messages each actor
refused), so a refusal is counted and logged once, not by each actor it reached. A
subscription that falls further behind than this may count a message again."""
MARK_TEXT: Final = 128
"""Characters of the subject and of each signature header, and bytes of each end of the
body, that make a refused message's mark."""
INJECT_MEMORY: Final = 1024
"""Operator-signed injects each actor took (by body digest), so one sent again within its
lifetime is refused; the oldest is forgotten first."""

EVENT_DROP_REASONS: Final = (
    "unsigned",
    "untrusted_key",
    "bad_signature",
    "malformed",
    "no_session",
    "bad_session",
    "replayed",
    "expired",
    "misaddressed",
)
"""Every reason a message is dropped for: no signature at all; signed by a key that may not
send it; an operator's signature that does not verify; a body that does not decode;
signed by the node key but not published by this process (no session tag); a session
tag this process did not make; a message taken before (a tagged one sent again, or an
operator's inject sent again); an operator's inject outside its lifetime; an operator's
inject for another node."""


class NodeEvents:
    """The node's event channel as its actors share it: the node key that signs what they
    publish, this process's session, the operator keys an inject may be signed by, and
    the drop counter."""

    def __init__(self, config: AgentConfig, key: KeyPair, metrics: AgentMetrics) -> None:
        self.config = config
        self.key = key
        self.metrics = metrics
        self.session = Session()
        self._last_warning: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}
        self._verified: dict[tuple[str, str], bytes] = {}
        self._refused: dict[bytes, dict[str, int]] = {}
        self._injects: dict[tuple[str, bytes], None] = {}

    async def publish(self, bus: Bus, subject: str, event: Event) -> None:
        """Publish ``event`` signed with the node key and tagged by this process; raises
        nats.errors.Error."""
        body = codec.encode(event)
        await bus.publish(subject, body, headers=self.headers(subject, body))

    def headers(self, subject: str, body: bytes) -> dict[str, str]:
        """The node key's signature and this process's session tag for ``body`` on
        ``subject``: what this process publishes for its own actors (events, heartbeats).
        Publish at once: tags are numbered in the order they are made."""
        return {**self.key.headers(body), **self.session.headers(subject, body)}

    def decoding(self, actor: str, handle: EventHandler) -> Handler:
        """A bus handler for ``actor`` that admits and decodes each node event and passes
        it to ``handle``; call it once per subscription, when it is made (it remembers what
        that subscription took). The actor's drop counters are exported at 0 from now on."""
        self._export(actor)
        replay = self.session.replay_guard()

        async def on_message(msg: Msg) -> None:
            admitted = self._admit(actor, msg, replay)
            if isinstance(admitted, str):
                self._drop(actor, admitted, msg)
                return
            await handle(admitted)

        return on_message

    def own(self, actor: str, handle: Handler) -> Handler:
        """A bus handler for ``actor`` that passes on only messages this process published
        (its heartbeats, seen on their subject): tagged by this session, never replayed.
        Call it once per subscription, when it is made."""
        self._export(actor)
        replay = self.session.replay_guard()

        async def on_message(msg: Msg) -> None:
            headers = msg.headers or {}
            reason = self.session.check(msg.subject, headers, msg.data, replay)
            if reason == "no_session":
                reason = self._untagged(headers) or reason
            if reason:
                self._drop(actor, reason, msg)
                return
            await handle(msg)

        return on_message

    def _export(self, actor: str) -> None:
        for reason in EVENT_DROP_REASONS:
            self.metrics.events_dropped.labels(actor, reason)

    def _admit(self, actor: str, msg: Msg, replay: Replay) -> Event | str:
        """The event if ``actor`` may act on ``msg``, else why not."""
        headers = msg.headers or {}
        tagged = HEADER_SESSION_SEQ in headers or HEADER_SESSION_TAG in headers
        if tagged:
            reason = self.session.check(msg.subject, headers, msg.data, replay)
        else:
            reason = self._untagged_refusal(event_kind(msg.subject), headers, msg.data)
        if reason:
            return reason
        try:
            event = decode_event(msg.subject, msg.data)
        except DecodeError:
            return "malformed"
        if not tagged and isinstance(event, Inject):  # an operator's: admitted once, in time
            return self._inject_refusal(actor, event, msg.data) or event
        return event

    def _untagged(self, headers: Mapping[str, str]) -> str:
        """Why a message without a session tag, and not an operator's inject, is refused:
        unsigned, signed by a key that may not send it, or (signed by the node key) not
        this process's."""
        if signing.HEADER_KEY not in headers or signing.HEADER_SIG not in headers:
            return "unsigned"
        if headers[signing.HEADER_KEY] != self.key.public_key:
            return "untrusted_key"
        return "no_session"

    def _untagged_refusal(self, kind: str, headers: Mapping[str, str], body: bytes) -> str:
        """Why a message without a session tag is refused; nothing ("") for an inject a
        trusted operator signed. The claimed signer is checked first, so a flood under
        other keys costs no Ed25519."""
        signer = headers.get(signing.HEADER_KEY)
        if kind != EVENT_INJECT or signer not in self.config.operator_keys():
            return self._untagged(headers)
        mark = (signer, headers.get(signing.HEADER_SIG, ""))
        if self._verified.get(mark) == body:
            return ""
        try:
            signing.verify(headers, body)
        except SignatureError:
            return "bad_signature"
        # An inject reaches three of this node's actors, each through a subscription of
        # its own: remembering the exact bytes that verified under this key and signature
        # verifies it once. Oldest first out.
        remember(self._verified, mark, body, VERIFIED_MEMORY)
        return ""

    def _inject_refusal(self, actor: str, inject: Inject, body: bytes) -> str:
        """Why ``actor`` must not take an operator-signed ``inject`` ("" if it may): for
        another node, outside its lifetime, or taken before (by body, which the signature
        covers: a signature written another way is the same inject)."""
        if inject.node_id != self.config.node_id:
            return "misaddressed"
        now = time.time()
        age = now - inject.ts
        if age > self.config.max_command_lifetime or -age > self.config.max_skew:
            return "expired"
        taken = (actor, hashlib.sha256(body).digest())
        if taken in self._injects:
            return "replayed"
        remember(self._injects, taken, None, INJECT_MEMORY)
        return ""

    def _drop(self, actor: str, reason: str, msg: Msg) -> None:
        if not self._new_refusal(actor, msg):
            return
        self.metrics.events_dropped.labels(actor, reason).inc()
        now = time.monotonic()
        if now - self._last_warning.get(reason, -DROP_LOG_INTERVAL) < DROP_LOG_INTERVAL:
            self._suppressed[reason] = self._suppressed.get(reason, 0) + 1
            log.debug("node event dropped", extra={"actor": actor, "reason": reason})
            return
        self._last_warning[reason] = now
        log.warning(
            "node event dropped",
            extra={
                "actor": actor,
                "reason": reason,
                "subject": msg.subject,
                "dropped_since_last_warning": self._suppressed.pop(reason, 0),
            },
        )

    def _new_refusal(self, actor: str, msg: Msg) -> bool:
        """Whether ``actor`` refusing ``msg`` is a message no actor refused yet: each
        subscription gets every message once, in order, so a message is new when this
        actor has now refused more messages of its mark than any other actor has.

        The mark need not tell messages apart: two that share one are counted as two, as
        the same bytes sent twice are (so a flood costs no hash of whole bodies)."""
        headers = msg.headers or {}
        names = (signing.HEADER_KEY, signing.HEADER_SIG, HEADER_SESSION_SEQ, HEADER_SESSION_TAG)
        values = [(headers.get(name) or "")[:MARK_TEXT] for name in names]
        about = repr((msg.subject[:MARK_TEXT], *values, len(msg.data))).encode()
        ends = msg.data[:MARK_TEXT] + msg.data[-MARK_TEXT:]
        mark = hashlib.blake2b(about + ends, digest_size=16).digest()
        copies = self._refused.get(mark)
        if copies is None:
            copies = {}
            remember(self._refused, mark, copies, REFUSED_MEMORY)
        count = copies.get(actor, 0) + 1
        copies[actor] = count
        return all(count > n for other, n in copies.items() if other != actor)
