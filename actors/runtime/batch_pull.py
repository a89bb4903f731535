"""Reading a JetStream consumer in batches: :class:`BatchPuller` sends the pull requests
itself and collects a batch in one wake-up, :func:`consume_in_batches` judges each batch
in memory and runs the I/O left (chains of steps) concurrently, acknowledging the fetch
once its work is done. What the aggregator's heartbeat partitions read with; the
consumer it pulls from is a :class:`~actors.runtime.consumer.DurableConsumer`, made again
when it is deleted or left without a leader.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable

import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from actors.runtime.bus import Bus
from actors.runtime.consumer import (
    RECREATE_RETRY,
    DropCounter,
    DurableConsumer,
    terminate,
)
from actors.runtime.schedule import stop_if_cancelled
from actors.runtime.subscriptions import unsubscribe_quietly

log = logging.getLogger(__name__)

Step = Callable[[], Awaitable[None]]
"""One piece of work on one message, run by :func:`consume_in_batches`."""
Chain = list[tuple[Msg, Step]]
BatchHandler = Callable[[list[Msg]], Awaitable[list[Chain]]]
"""Judges a fetch's messages (in memory) and returns the I/O left to do, as chains of
steps, each chain run in order and the chains concurrently."""
TRANSIENT_ATTEMPTS = 3


Delivery = tuple[int, float, int]
"""(stream sequence, stored at in epoch seconds, messages pending behind it)."""


def delivery(msg: Msg) -> Delivery:
    """(stream sequence, when the stream stored it in epoch seconds, messages pending
    behind it) of a JetStream delivery, read from its ack subject without nats-py's
    ``metadata`` (which builds datetimes: a tenth of a signature check per message)."""
    tokens = (msg.reply or "").split(".")
    if len(tokens) == 9 and tokens[1] == "ACK":  # $JS.ACK.<stream>.<consumer>.<n>.<s>.<c>.<ts>.<p>
        return int(tokens[5]), int(tokens[7]) / 1e9, int(tokens[8])
    metadata = msg.metadata
    return metadata.sequence.stream, metadata.timestamp.timestamp(), metadata.num_pending


class CaughtUp:
    """The spans of wall-clock time through which a consumer had read its stream to the
    end: a message stored within one was delivered, never replaced unread by a later one
    of its subject (a stream keeping one message per subject replaces the older). The
    last :data:`CAUGHT_UP_KEPT` spans are kept, in time order."""

    def __init__(self) -> None:
        self._starts: list[float] = []
        self._ends: list[float] = []

    def add(self, start: float, end: float) -> None:
        if self._ends and start <= self._ends[-1]:  # touches the last span: one span
            self._ends[-1] = max(self._ends[-1], end)
            return
        self._starts.append(start)
        self._ends.append(end)
        if len(self._starts) > 2 * CAUGHT_UP_KEPT:
            del self._starts[:CAUGHT_UP_KEPT], self._ends[:CAUGHT_UP_KEPT]

    def within(self, after: float, before: float) -> bool:
        """Whether the consumer was caught up at some moment between the two times."""
        last = bisect.bisect_left(self._starts, before) - 1
        return last >= 0 and self._ends[last] > after


CAUGHT_UP_KEPT = 4096
"""Spans a :class:`CaughtUp` keeps at least: minutes of a partition's fetches."""


class BatchPuller:
    """Pulls from a :class:`DurableConsumer` by sending the pull requests itself and
    collecting the answers in a subscription callback. nats-py's ``fetch`` awaits each
    message through ``wait_for`` (a task per message), which costs about as much as an
    Ed25519 verify; here a batch costs one request and one wake-up."""

    def __init__(
        self,
        bus: Bus,
        consumer: DurableConsumer,
        *,
        replace_after: float = 0.0,
        may_replace: Callable[[], bool] = lambda: True,
    ) -> None:
        self.bus = bus
        self.consumer = consumer
        self.replace_after = replace_after
        """Seconds of pulls the consumer leaves unanswered before it is deleted and
        created again from :attr:`next_seq` (0: never), if ``may_replace()`` (its reader
        still owns it) then. Only for a consumer that reads from a start sequence and
        whose acks keep no state of their own: nats-server can leave a consumer without
        a leader for good after a crash (its raft group stalled while its stream and the
        cluster are well), and the documented repair is to make it again
        (nats-server#2356)."""
        self.may_replace = may_replace
        self.next_seq = consumer.config.opt_start_seq or 1
        """The stream sequence after the last message this puller handed out: where a
        consumer made again starts, so nothing is read twice or skipped."""
        self._silent_since: float | None = None
        """When the pulls the consumer has left unanswered since its last answer began:
        measured from a pull, so a reader that was itself paused replaces nothing."""
        self._subscription: Subscription | None = None
        self._inbox = ""
        self._batch: list[Msg] = []
        self._wanted = 0
        self._status = ""
        self._done = asyncio.Event()
        self.caught_up = CaughtUp()
        """When this puller had read its consumer's stream to the end."""

    async def _on_message(self, msg: Msg) -> None:
        # The server's own status answers have no reply subject; every delivered message
        # has one (its ack subject), whatever headers its publisher put on it.
        status = msg.headers.get("Status", "") if msg.headers and not msg.reply else ""
        if status:
            if status != "100":  # idle heartbeats are not an answer
                self._status = status
                self._done.set()
            return
        self._batch.append(msg)
        if len(self._batch) >= self._wanted:
            self._done.set()

    async def close(self) -> None:
        if self._subscription is not None:
            await unsubscribe_quietly(self._subscription)
            self._subscription = None

    async def fetch(self, batch: int, expires: float) -> list[Msg]:
        """Up to ``batch`` messages: what is there and what arrives within ``expires``
        seconds, or with ``expires`` 0 only what is there now (a ``no_wait`` pull: the
        server sends it in one burst and ends with a 404 status). A deleted consumer is
        created again, as :meth:`DurableConsumer.fetch`."""
        consumer = self.consumer
        if consumer.missing:
            if not await consumer.recreate():
                await asyncio.sleep(RECREATE_RETRY)
                return []
        if self._subscription is None:
            self._inbox = self.bus.new_inbox()
            self._subscription = await self.bus.subscribe(self._inbox, self._on_message)
        self._batch, self._wanted, self._status = [], batch, ""
        self._done.clear()
        request: dict[str, object] = {"batch": batch}
        if expires:
            request["expires"] = int(expires * 1e9)
        else:
            request["no_wait"] = True
        subject = f"{self.bus.js_api_prefix}.CONSUMER.MSG.NEXT.{consumer.stream}.{consumer.durable}"
        asked = time.time()
        await self.bus.publish(subject, json.dumps(request).encode(), reply=self._inbox)
        try:
            async with asyncio.timeout(expires + PULL_GRACE):
                await self._done.wait()
        except TimeoutError:
            pass
        messages, self._batch = self._batch, []
        if messages:
            self.next_seq = max(self.next_seq, delivery(messages[-1])[0] + 1)
        if messages or self._status not in ("", "503"):
            self._silent_since = None
        else:
            now = time.monotonic()
            since = self._silent_since = self._silent_since or now
            if self.replace_after and now - since > self.replace_after and self.may_replace():
                await self._replace(now - since)
                return []
        if expires and self._status == "408":
            # Expired short of the batch: every message stored until the server gave up
            # was handed over. Not until this process looked (time.time()): a beat
            # stored while it was busy is unread, and may be replaced before the next.
            self.caught_up.add(asked, min(time.time(), asked + expires))
        elif expires and messages:
            # The batch filled: caught up as the last of it was stored (everything
            # before it came with it), not after; what came next is not read yet.
            last = delivery(messages[-1])[1]
            self.caught_up.add(min(asked, last), last)
        elif not expires and self._status == "404":
            # Less than asked, then "no messages": what was stored before is all here.
            self.caught_up.add(asked, asked)
        # 503: no responders (consumer gone); 409: consumer deleted under the pull; 404
        # ends every no_wait pull that found less than asked, a long poll only if gone.
        gone = self._status in ("503", "409") or (
            self._status == "404" and expires > 0 and not messages
        )
        if gone and not await consumer.exists():
            consumer.missing = f"consumer {consumer.durable} was deleted ({self._status})"
            if self.replace_after:
                consumer.config = consumer.config.evolve(opt_start_seq=self.next_seq)
            log.warning(
                "durable consumer missing; creating it again",
                extra={"consumer": consumer.durable, "stream": consumer.stream},
            )
        return messages

    async def _replace(self, silent: float) -> None:
        """Delete the consumer that has not answered for :attr:`replace_after` and mark
        it missing, to be created again from :attr:`next_seq` (by the next
        :meth:`fetch`). A delete the cluster cannot take now raises; the next try comes
        after another :attr:`replace_after` of silence."""
        consumer = self.consumer
        log.warning(
            "durable consumer not answering; making it again",
            extra={
                "consumer": consumer.durable,
                "stream": consumer.stream,
                "silent_s": round(silent, 1),
                "from_seq": self.next_seq,
            },
        )
        self._silent_since = None
        await consumer.drop()
        consumer.config = consumer.config.evolve(opt_start_seq=self.next_seq)
        consumer.missing = f"consumer {consumer.durable} did not answer (no leader); made again"


PULL_GRACE = 2.0
"""Seconds past a pull request's expiry to wait for its end before giving up on it."""


async def consume_in_batches(
    consumer: BatchPuller,
    handle: BatchHandler,
    *,
    batch: int,
    wait: float,
    what: str,
    dropped: DropCounter,
    linger: float = 0.0,
    share: asyncio.Semaphore | None = None,
) -> None:
    """Like :func:`consume_forever`, for a consumer with ``AckPolicy.ALL``: one ack, on
    the last message of a fetch, settles the whole fetch once every message of it is
    handled. A step that breaks on its message's content is terminated on its own
    (AckTerm) and the rest goes on, so one poison message neither stalls the consumer
    nor is redelivered forever (nor ends the loop: see :func:`_judge`, :func:`_ack_fetch`
    and :func:`settle`); a bus error is retried in place (TRANSIENT_ATTEMPTS),
    then raised: nothing of the fetch is acked, so the restarted actor (or another
    owner) gets it all again after ``ack_wait``. A consumer that caught up waits
    ``linger`` seconds before its next fetch, so it still handles and acks many messages
    at once: a fetch and an ack cost about as much as a signature check, and would
    otherwise be paid per message.

    Loops given one ``share`` hold it from a batch's fetch until it is judged: at most
    that many batches are on their way or waiting in the process at once, so what the
    connection holds ahead of another reply (a lease renewal's) stays that small."""
    gate: contextlib.AbstractAsyncContextManager[object] = share or contextlib.nullcontext()
    while True:
        stop_if_cancelled()
        async with gate:
            # What the stream holds now, in one burst: a pull that gathered messages as
            # they arrived would wake this process once per message, a burst once per
            # read. Nothing there: wait (up to ``wait``) for the next message, outside
            # the share (a waiting fetch brings one message).
            messages = await _fetched(consumer, batch, 0.0, what)
            chains = await _judge(handle, messages, what, dropped) if messages else []
        if messages == []:
            messages = await _fetched(consumer, 1, wait, what)
            chains = await _judge(handle, messages, what, dropped) if messages else []
        if messages is None:
            await asyncio.sleep(1.0)
            continue
        if messages:
            if chains:
                await asyncio.gather(*(run_chain(chain, what, dropped) for chain in chains))
            await _ack_fetch(messages[-1], what)
        if len(messages) < batch and linger:
            # Caught up: let the next messages gather, so a fetch and an ack are paid per
            # batch. Every loop wakes on the same beat of the clock: the fetches of all of
            # an aggregator's partitions leave in one socket write, and come back together.
            await asyncio.sleep(linger - asyncio.get_running_loop().time() % linger)


async def _fetched(consumer: BatchPuller, batch: int, wait: float, what: str) -> list[Msg] | None:
    """One fetch; None when it failed (logged: the caller waits and fetches again)."""
    try:
        return await consumer.fetch(batch, wait)
    except nats.errors.ConnectionClosedError:
        raise
    except nats.errors.Error as exc:
        log.warning("fetch failed; retrying", extra={"consumer": what, "reason": str(exc)})
        return None


async def _judge(
    handle: BatchHandler, messages: list[Msg], what: str, dropped: DropCounter
) -> list[Chain]:
    """``handle``'s chains for a fetch. A handler that breaks on the fetch (it should not:
    it terminates a message that breaks it itself) is given the messages again one at a
    time, and a message it still breaks on is terminated alone: one message can neither
    end the loop nor take the rest of its fetch with it."""
    try:
        return await handle(messages)
    except nats.errors.ConnectionClosedError:
        raise
    except (nats.errors.Error, OSError):
        raise  # a bus error: nothing is acked, the restarted actor reads the fetch again
    except Exception:
        log.exception("batch broke its handler; judging its messages one by one")
    chains: list[Chain] = []
    for msg in messages:
        try:
            chains += await handle([msg])
        except nats.errors.ConnectionClosedError:
            raise
        except (nats.errors.Error, OSError):
            raise
        except Exception as exc:
            await terminate(msg, exc, what, dropped)
    return chains


async def _ack_fetch(last: Msg, what: str) -> None:
    """The one ack that settles a fetch (``AckPolicy.ALL``), on its last message. That
    message may be settled already: a step that broke on it terminated it, and the
    server takes a termination under ``AckPolicy.ALL`` as the ack of every message before
    it too (nats-py then refuses a second settling with MsgAlreadyAckdError, which once
    ended every partition of an aggregator). Any other failure is logged: the fetch is
    delivered again after ``ack_wait``, and judging it again changes nothing."""
    try:
        await last.ack()
    except nats.errors.MsgAlreadyAckdError:
        pass
    except nats.errors.ConnectionClosedError:
        raise
    except nats.errors.Error as exc:
        log.warning("fetch not acknowledged", extra={"consumer": what, "reason": str(exc)})


async def run_chain(chain: Chain, what: str, dropped: DropCounter) -> None:
    """Run the steps of ``chain`` in order; see :func:`consume_in_batches` for what a
    failure does."""
    for msg, step in chain:
        for attempt in range(TRANSIENT_ATTEMPTS):
            try:
                await step()
                break
            except nats.errors.ConnectionClosedError:
                raise
            except nats.errors.MsgAlreadyAckdError:
                break  # settled already (terminated by an earlier step): nothing to retry
            except (nats.errors.Error, OSError) as exc:  # TimeoutError is an OSError
                dropped("transient_error")
                log.warning(
                    "message not handled; retrying",
                    extra={"consumer": what, "subject": msg.subject, "reason": str(exc)},
                )
                if attempt == TRANSIENT_ATTEMPTS - 1:
                    raise
                await asyncio.sleep(0.5 * (attempt + 1))
            except Exception as exc:
                await terminate(msg, exc, what, dropped)
                break
