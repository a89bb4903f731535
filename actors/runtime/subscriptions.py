"""Subscriptions that live as long as an actor: subscribed and flushed before it says
it is ready, each handler guarded (what it raises drops its message, logged), and
unsubscribed quietly on the way out."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Mapping

import nats.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.client import JetStreamContext

from actors.runtime.bus import Bus, Handler

log = logging.getLogger(__name__)

UNSUBSCRIBE_TIMEOUT = 2.0


async def unsubscribe_quietly(
    subscription: Subscription | JetStreamContext.PullSubscription,
) -> None:
    """Unsubscribe on the way out; a connection already closed has nothing to undo. Bounded:
    on a connection whose reader died (nats-py's read loop ends when a PONG answers a
    cancelled flush) it never returns, and an actor stopping would wait for it."""
    try:
        async with asyncio.timeout(UNSUBSCRIBE_TIMEOUT):
            await subscription.unsubscribe()
    except (nats.errors.Error, TimeoutError):
        pass


@contextlib.asynccontextmanager
async def listening(
    bus: Bus,
    routes: Mapping[str, Handler],
    ready: Callable[[], None] | None = None,
    *,
    queue: str = "",
) -> AsyncIterator[None]:
    """Subscribe each subject of ``routes`` to its handler, in the mapping's order, and
    flush, so the server has every SUB before the actor says it is ready (a message
    published after ``ready()`` is never missed); then ``ready()``, unless the actor has
    more to set up first and calls it itself. Unsubscribes quietly on the way out. A
    handler that raises drops its message, logged with the traceback (see :func:`guarded`)."""
    subscriptions: list[Subscription] = []
    try:
        for subject, handler in routes.items():
            subscriptions.append(await bus.subscribe(subject, guarded(subject, handler), queue))
        await bus.flush()
        if ready is not None:
            ready()
        yield
    finally:
        for subscription in subscriptions:
            await unsubscribe_quietly(subscription)


def guarded(route: str, handler: Handler) -> Handler:
    """``handler``, with whatever it raises on one message (but cancellation) logged as an
    error and the message dropped: nats-py would hand it to the connection's error
    callback, which logs at debug level and takes it for a connection error."""

    async def on_message(msg: Msg) -> None:
        try:
            await handler(msg)
        except Exception as exc:
            log.error(
                "message broke its handler; dropped",
                exc_info=exc,
                extra={"route": route, "subject": msg.subject, "reason": repr(exc)},
            )

    return on_message
