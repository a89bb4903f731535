"""Durable JetStream pull consumers that survive their own deletion, and the consume loop
every actor of external input runs.

A durable consumer is server state anyone with the right permission can delete; nats-py
then answers every fetch with 503 (no responders) and the actor would go silent for good.
:class:`DurableConsumer` keeps the consumer's config, notices it is gone and creates it
again, idempotently, with the same config. :func:`consume_forever` settles every message
itself, so one hostile message can never end the loop nor restart the actor.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from actors.runtime.bus import unanswered
from actors.runtime.schedule import stop_if_cancelled

log = logging.getLogger(__name__)

MessageHandler = Callable[[Msg], Awaitable[None]]
DropCounter = Callable[[str], None]
"""Told the reason (a short fixed label) of every message dropped by the loop."""
LOOP_DROP_REASONS = ("handler_error", "transient_error")
"""The reasons the consume loops here tell a :data:`DropCounter`."""

RECREATE_RETRY = 1.0
"""Seconds before the first attempt to create a missing consumer again (its stream may be
gone, or only another may create it); each failed attempt doubles the wait."""
RECREATE_RETRY_MAX = 15.0
"""The longest wait between two looks at a missing consumer, unless its owner says less."""
STREAM_NOT_FOUND = 10059
"""JetStream's error code for a stream that does not exist."""
CONSUMER_OFFLINE = 10119
"""JetStream's error code (with 500) for a consumer every peer of which is down."""
PULL_MAX_WAITING = 4
PULL_MAX_ACK_PENDING = 64
"""What one reader of a :func:`pull_config` consumer may hold: pulls waiting at once,
messages delivered and not yet acknowledged."""


def pull_config(durable: str, subject: str, *, ack_wait: float, max_deliver: int) -> ConsumerConfig:
    """The whole configuration of a durable pull consumer that one reader works through
    (a node's command queue): pull only (no deliver subject), explicit acks, every
    message from the start, bounded redeliveries and pulls. Whoever creates it creates
    exactly this, so the reader and the provider agree and neither can be told
    otherwise."""
    return ConsumerConfig(
        name=durable,
        durable_name=durable,
        filter_subject=subject,
        ack_policy=AckPolicy.EXPLICIT,
        deliver_policy=DeliverPolicy.ALL,
        ack_wait=ack_wait,
        max_deliver=max_deliver,
        max_waiting=PULL_MAX_WAITING,
        max_ack_pending=PULL_MAX_ACK_PENDING,
    )


def without_leader(exc: BaseException) -> bool:
    """Whether a consumer's API call failed because the consumer has no leader to answer
    it: 503 (10008 "JetStream system temporarily unavailable", or no responders) or 500
    10119 "consumer is offline" (every peer of it down)."""
    return isinstance(exc, nats.js.errors.ServiceUnavailableError) or (
        isinstance(exc, nats.js.errors.APIError) and exc.err_code == CONSUMER_OFFLINE
    )


class DurableConsumer:
    """One durable pull consumer of ``stream``, filtered to ``subject``, with ``config``.

    ``missing`` is the reason it cannot be used right now ("" while it works): health
    endpoints report it, so a consumer that cannot be re-created is seen, not silent.
    Without ``create`` it is only bound to, never created: someone else (the provider)
    creates it, and until then every fetch finds it missing and looks again."""

    def __init__(
        self,
        js: JetStreamContext,
        stream: str,
        subject: str,
        durable: str,
        config: ConsumerConfig,
        *,
        create: bool = True,
        retry_max: float = RECREATE_RETRY_MAX,
    ) -> None:
        self.js = js
        self.create = create
        self.retry_max = retry_max
        """The longest wait between two looks at a missing consumer."""
        self.stream = stream
        self.subject = subject
        self.durable = durable
        self.config = config
        self.missing = "not created yet"
        self._opened = False
        """Opened once already: a later open re-creates it (the log says "again")."""
        self._subscription: JetStreamContext.PullSubscription | None = None
        self._retry = min(RECREATE_RETRY, retry_max)

    async def open(self) -> None:
        """Create the consumer if it does not exist (same config: idempotent) and bind;
        without ``create``, bind to it if it exists (else raise NotFoundError)."""
        await self.close()
        if self.create:
            self._subscription = await self.js.pull_subscribe(
                self.subject, durable=self.durable, stream=self.stream, config=self.config
            )
        else:
            await self.js.consumer_info(self.stream, self.durable)
            self._subscription = await self.js.pull_subscribe_bind(
                durable=self.durable, stream=self.stream
            )
        self.missing = ""
        self._opened = True

    async def drop(self) -> None:
        """Delete the consumer, if it is there. A consumer without a leader may be removed
        without an answer (nats-server answers a delete from the consumer's leader, or
        from the meta leader only when every peer of the consumer is offline), so no
        answer counts as done: whoever opens it next finds out."""
        await self.close()
        try:
            await self.js.delete_consumer(self.stream, self.durable)
        except nats.js.errors.NotFoundError:
            pass
        except (nats.errors.Error, TimeoutError) as exc:
            if not unanswered(exc):
                raise

    async def try_open(self) -> bool:
        """:meth:`open`, or False with the reason in ``missing`` when the consumer cannot
        be created (it may be the provider's to create: :meth:`fetch` tries again)."""
        return await self.recreate()

    async def close(self) -> None:
        """Unsubscribe; a connection already closed has nothing to undo."""
        if self._subscription is not None:
            try:
                await self._subscription.unsubscribe()
            except nats.errors.Error:
                pass
            self._subscription = None

    async def fetch(self, batch: int, wait: float) -> list[Msg]:
        """Up to ``batch`` messages within ``wait`` seconds ([] when none came). A deleted
        consumer is created again before this returns; a failure to do so is kept in
        ``missing`` and retried at the next call."""
        if self._subscription is None or self.missing:
            if not await self.recreate():
                await asyncio.sleep(self._retry)
                self._retry = min(2 * self._retry, self.retry_max)
                return []
            self._retry = min(RECREATE_RETRY, self.retry_max)
        assert self._subscription is not None
        try:
            return await self._subscription.fetch(batch, timeout=wait)
        except (nats.errors.TimeoutError, TimeoutError):
            return []
        except nats.js.errors.APIError as exc:
            # nats-py 2.16 answers a fetch on a deleted consumer with 503 (no responders);
            # a pending pull may end with 404 or 409 "consumer deleted". Ask the server.
            if await self.exists():
                raise
            self.missing = f"consumer {self.durable} was deleted ({exc.description or exc})"
            log.warning(
                "durable consumer missing; creating it again",
                extra={"consumer": self.durable, "stream": self.stream},
            )
            return []

    async def exists(self) -> bool:
        try:
            await self.js.consumer_info(self.stream, self.durable)
        except nats.js.errors.NotFoundError:
            return False
        return True

    async def recreate(self) -> bool:
        """Open the consumer; on failure say why in ``missing``, and in the log once per
        cause, not at every retry (an agent started before any aggregator created the
        fleet's streams waits quietly, however long)."""
        again = self._opened
        try:
            await self.open()
        except (nats.errors.TimeoutError, TimeoutError, nats.js.errors.APIError) as exc:
            if getattr(exc, "err_code", None) == STREAM_NOT_FOUND:
                what = "stream does not exist yet; waiting for an aggregator to create it"
                missing = f"stream {self.stream} does not exist yet: start an aggregator"
            else:
                why = (
                    "cannot be created" if self.create else "is not there (its provider creates it)"
                )
                what, missing = f"durable consumer {why}", f"consumer {self.durable} {why}: {exc}"
            if missing != self.missing:
                log.warning(what, extra={"consumer": self.durable, "reason": str(exc)})
            self.missing = missing
            return False
        what = "durable consumer created again" if again else "durable consumer opened"
        log.info(what, extra={"consumer": self.durable})
        return True


async def consume_forever(
    consumer: DurableConsumer,
    handle: MessageHandler,
    *,
    batch: int,
    wait: float,
    what: str,
    dropped: DropCounter,
) -> None:
    """Fetch up to ``batch`` messages at a time and hand each to ``handle``, until
    cancelled. Messages of one subject are handled in order, subjects concurrently (for
    a heartbeat stream: nodes are independent). ``handle`` acks or terminates what it
    was given; see :func:`settle` for what happens when it raises. An empty fetch or a
    transient fetch error is retried; a closed connection raises, so the owning actor is
    restarted."""
    while True:
        stop_if_cancelled()
        try:
            messages = await consumer.fetch(batch, wait)
        except nats.errors.ConnectionClosedError:
            raise
        except nats.errors.Error as exc:
            log.warning("fetch failed; retrying", extra={"consumer": what, "reason": str(exc)})
            await asyncio.sleep(1.0)
            continue
        by_subject: dict[str, list[Msg]] = {}
        for msg in messages:
            by_subject.setdefault(msg.subject, []).append(msg)

        async def in_order(group: list[Msg]) -> None:
            for msg in group:
                await settle(msg, handle, what, dropped)

        await asyncio.gather(*(in_order(group) for group in by_subject.values()))


async def settle(msg: Msg, handle: MessageHandler, what: str, dropped: DropCounter) -> None:
    """Run ``handle`` on one message. A handler that raises never ends the loop: on a
    bus or OS error (a KV round trip timed out, a full disk) the message is given back
    for another try, bounded by the consumer's ``max_deliver``; on any other error the
    message itself is the likely cause, so it is terminated (AckTerm: never redelivered).
    Both are counted and logged. Only a closed connection propagates."""
    try:
        await handle(msg)
    except nats.errors.ConnectionClosedError:
        raise
    except nats.errors.MsgAlreadyAckdError:
        pass  # the handler settled it before it raised: settling it again cannot help
    except (nats.errors.Error, OSError) as exc:  # TimeoutError is an OSError
        dropped("transient_error")
        log.warning(
            "message not handled; redelivering",
            extra={"consumer": what, "subject": msg.subject, "reason": str(exc)},
        )
        await _quietly(msg.nak(delay=1.0))
    except Exception as exc:
        await terminate(msg, exc, what, dropped)


async def terminate(msg: Msg, exc: Exception, what: str, dropped: DropCounter) -> None:
    """The message broke its handler, so it is the likely cause: count, log with the
    traceback, and terminate it (AckTerm: never redelivered)."""
    dropped("handler_error")
    log.error(
        "message broke its handler; terminated",
        exc_info=exc,
        extra={"consumer": what, "subject": msg.subject, "reason": repr(exc)},
    )
    await _quietly(msg.term())


async def _quietly(settling: Awaitable[None]) -> None:
    try:
        await settling
    except nats.errors.Error as exc:
        log.warning("cannot settle message", extra={"reason": str(exc)})
