"""How node actors publish and take in the node's events.

Events drive actions (an ``interruption`` drains and deregisters the node) and are folded
into the node's signed heartbeat, so an event counts only if the node said it: every event
is published signed with the node key, and every consumer verifies it here, the one place
where events are decoded. A fault injection (``inject``) may also be signed by a trusted
operator key. Anything else is dropped, counted by reason in
``node_agent_events_dropped_total`` and logged (a warning at most once a minute per actor
and reason, so a flood cannot flood the log too). An actor's handler sees only a verified,
typed event to ``match``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Final

from nats.aio.msg import Msg

from actors.node.config import AgentConfig
from actors.node.metrics import AgentMetrics
from actors.runtime.bus import Bus, Handler, publish_signed_event
from schemas import signing
from schemas.errors import DecodeError, SignatureError
from schemas.events import Event, decode_event
from schemas.signing import KeyPair
from schemas.subjects import EVENT_INJECT, event_kind

log = logging.getLogger(__name__)

EventHandler = Callable[[Event], Awaitable[None]]

DROP_LOG_INTERVAL: Final = 60.0
"""Seconds between two warnings about dropped events for one actor and reason."""
VERIFIED_MEMORY: Final = 64
"""Recently verified events remembered, so each is verified once, not once per actor."""


EVENT_DROP_REASONS: Final = ("unsigned", "untrusted_key", "bad_signature", "malformed")
"""Every reason an event is dropped for (:meth:`NodeEvents._refusal`, a decode failure)."""


class NodeEvents:
    """The node's event channel as its actors share it: the node key that signs what they
    publish, the keys a received event may be signed by, and the drop counter."""

    def __init__(self, config: AgentConfig, key: KeyPair, metrics: AgentMetrics) -> None:
        self.config = config
        self.key = key
        self.metrics = metrics
        self._last_warning: dict[tuple[str, str], float] = {}
        self._suppressed: dict[tuple[str, str], int] = {}
        self._verified: dict[tuple[str, str], bytes] = {}

    async def publish(self, bus: Bus, subject: str, event: Event) -> None:
        """Publish ``event`` signed with the node key; raises nats.errors.Error."""
        await publish_signed_event(bus, subject, event, self.key)

    def decoding(self, actor: str, handle: EventHandler) -> Handler:
        """A bus handler for ``actor`` that verifies and decodes each node event and passes
        it to ``handle``; the actor's drop counters are exported at 0 from now on."""
        for reason in EVENT_DROP_REASONS:
            self.metrics.events_dropped.labels(actor, reason)

        async def on_message(msg: Msg) -> None:
            reason = self._refusal(event_kind(msg.subject), msg)
            if reason:
                self._drop(actor, reason, msg.subject)
                return
            try:
                event = decode_event(msg.subject, msg.data)
            except DecodeError:
                self._drop(actor, "malformed", msg.subject)
                return
            await handle(event)

        return on_message

    def _refusal(self, kind: str, msg: Msg) -> str:
        """Why ``msg`` is not the node's own (or an operator's inject); "" if it is. The
        claimed signer is checked first, so a flood under foreign keys costs no Ed25519."""
        headers = msg.headers or {}
        if signing.HEADER_KEY not in headers or signing.HEADER_SIG not in headers:
            return "unsigned"
        signer = headers[signing.HEADER_KEY]
        if signer != self.key.public_key and not (
            kind == EVENT_INJECT and signer in self.config.operator_keys()
        ):
            return "untrusted_key"
        mark = (signer, headers[signing.HEADER_SIG])
        if self._verified.get(mark) == msg.data:
            return ""
        try:
            signing.verify(headers, msg.data)
        except SignatureError:
            return "bad_signature"
        # Each event reaches up to five of this node's actors, each through a subscription
        # of its own; remembering the exact bytes that verified under this key and
        # signature verifies it once. Oldest first out.
        if len(self._verified) >= VERIFIED_MEMORY:
            del self._verified[next(iter(self._verified))]
        self._verified[mark] = msg.data
        return ""

    def _drop(self, actor: str, reason: str, subject: str) -> None:
        self.metrics.events_dropped.labels(actor, reason).inc()
        now = time.monotonic()
        key = (actor, reason)
        if now - self._last_warning.get(key, -DROP_LOG_INTERVAL) < DROP_LOG_INTERVAL:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            log.debug("node event dropped", extra={"actor": actor, "reason": reason})
            return
        self._last_warning[key] = now
        log.warning(
            "node event dropped",
            extra={
                "actor": actor,
                "reason": reason,
                "subject": subject,
                "dropped_since_last_warning": self._suppressed.pop(key, 0),
            },
        )
