"""How node actors take in the node's events: each message is decoded through the wire
contract's one table (:func:`schemas.events.decode_event`) where it arrives, and a malformed
one is logged and dropped there, so an actor's handler sees only a typed event to ``match``.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from nats.aio.msg import Msg

from actors.runtime.bus import Handler
from schemas.errors import DecodeError
from schemas.events import Event, decode_event

log = logging.getLogger(__name__)

EventHandler = Callable[[Event], Awaitable[None]]


def decoding(handle: EventHandler) -> Handler:
    """A bus handler that decodes each node event and passes it to ``handle``."""

    async def on_message(msg: Msg) -> None:
        try:
            event = decode_event(msg.subject, msg.data)
        except DecodeError as exc:
            log.warning(
                "ignoring malformed event", extra={"subject": msg.subject, "reason": str(exc)}
            )
            return
        await handle(event)

    return on_message
