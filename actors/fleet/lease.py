"""The lease that makes one aggregator at a time the owner of ``FLEET_HB``'s heartbeats.

The owner keeps every node's acceptance state in memory, which is exact only while no
other aggregator judges the same nodes. So aggregators take turns through one KV key
(``fleet_leases``, key ``hb``), by compare-and-set on its revision:

- **claim**: ``create`` the key if nobody holds it; else watch its revision, and once it
  has not changed for ``ttl`` seconds of this aggregator's own clock, ``update`` it with
  ``last=`` that revision (two claimants: one wins, the other's update is refused).
- **renew**: the holder ``update``s it with ``last=`` its own revision every ``ttl / 3``.
  A refused renewal means someone else holds it: the holder stops at once.
- **fence**: the holder also stops on its own once ``ttl - margin`` has passed since it
  *sent* its last successful renewal. A claimant waits ``ttl`` from the moment it first
  saw that renewal's revision, which is after it was sent: the old holder has stopped
  ``margin`` seconds before anyone can take over (only clock *rates* matter, not clocks).

What a holder does while it holds the lease is its ``work``; it is cancelled, and waited
for, before the lease can pass on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable, Coroutine
from typing import Any

import msgspec
import nats.errors
import nats.js.errors
from nats.js.kv import KeyValue

from actors.runtime.bus import Bus
from schemas import codec
from schemas.errors import DecodeError
from schemas.messages import AggregatorLease
from schemas.subjects import BUCKET_LEASES, STREAM_HEARTBEATS, Subjects

log = logging.getLogger(__name__)

KEY = "hb"
MARGIN_FRACTION = 0.25
"""The fence falls this fraction of ``ttl`` before a claimant may take over."""


def holder_id() -> str:
    """This process's holder id: host and a random suffix (a restart is a new holder)."""
    return f"{socket.gethostname()[:40]}-{os.urandom(4).hex()}"


class Lease:
    """One aggregator's side of the ``hb`` lease."""

    def __init__(self, bucket: KeyValue, holder: str, ttl: float) -> None:
        self.bucket = bucket
        self.holder = holder
        self.ttl = ttl
        self.held = False
        self.took_over_at = 0.0
        """Monotonic time this aggregator last took the lease."""
        self._revision = 0

    def _value(self) -> bytes:
        return codec.encode(AggregatorLease(holder=self.holder, ttl=self.ttl, renewed=time.time()))

    async def _read(self) -> tuple[AggregatorLease | None, int]:
        """The lease and its revision; (None, 0) if the key is absent or deleted."""
        try:
            entry = await asyncio.wait_for(self.bucket.get(KEY), self.ttl / 3)
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
            return None, 0
        try:
            lease = codec.decode(entry.value or b"", AggregatorLease, KEY)
        except DecodeError:
            lease = None  # unreadable: taken over like an expired one
        return lease, entry.revision or 0

    async def claim(self) -> None:
        """Return once this aggregator holds the lease."""
        seen, since = -1, time.monotonic()
        while True:
            try:
                lease, revision = await self._read()
                if revision == 0:
                    self._revision = await asyncio.wait_for(
                        self.bucket.create(KEY, self._value()), self.ttl / 3
                    )
                    break
                if revision != seen:
                    seen, since = revision, time.monotonic()
                elif time.monotonic() - since >= self.ttl:
                    self._revision = await asyncio.wait_for(
                        self.bucket.update(KEY, self._value(), last=revision), self.ttl / 3
                    )
                    log.warning(
                        "heartbeat lease taken over",
                        extra={"from": lease.holder if lease else "?", "holder": self.holder},
                    )
                    break
            except (nats.js.errors.KeyWrongLastSequenceError, nats.js.errors.APIError):
                seen, since = -1, time.monotonic()  # another claimant won this round
            except (nats.errors.Error, TimeoutError) as exc:
                log.warning("lease unreadable; retrying", extra={"reason": str(exc)})
            await asyncio.sleep(self.ttl / 8)
        self.held = True
        self.took_over_at = time.monotonic()
        log.info("heartbeat lease held", extra={"holder": self.holder})

    async def keep(self) -> None:
        """Renew until the lease is lost or the fence falls; then return."""
        sent_ok = time.monotonic()
        fence = self.ttl * (1 - MARGIN_FRACTION)
        try:
            while True:
                await asyncio.sleep(min(self.ttl / 3, max(0.0, sent_ok + fence - time.monotonic())))
                if time.monotonic() - sent_ok >= fence:
                    log.error("lease not renewed in time; stopping", extra={"holder": self.holder})
                    return
                sent = time.monotonic()
                try:
                    self._revision = await asyncio.wait_for(
                        self.bucket.update(KEY, self._value(), last=self._revision),
                        max(0.05, sent_ok + fence - sent),
                    )
                    sent_ok = sent
                except (nats.js.errors.KeyWrongLastSequenceError, nats.js.errors.APIError):
                    log.error("lease lost to another aggregator", extra={"holder": self.holder})
                    return
                except (nats.errors.Error, TimeoutError) as exc:
                    log.warning("lease renewal failed; retrying", extra={"reason": str(exc)})
        finally:
            self.held = False

    async def release(self) -> None:
        """Give the lease up (a clean stop), so another aggregator takes over at once."""
        with contextlib.suppress(nats.errors.Error, TimeoutError):
            await asyncio.wait_for(self.bucket.delete(KEY, last=self._revision), self.ttl / 3)


async def while_held(lease: Lease, work: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Forever: claim the lease, run ``work`` while it is held, cancel it (and wait for
    it) when the lease is lost or fenced, claim again. ``work`` raising releases the
    lease and raises; so does this being cancelled (a clean stop hands over at once)."""
    while True:
        await lease.claim()
        worker = asyncio.create_task(work(), name="lease-work")
        keeper = asyncio.create_task(lease.keep(), name="lease-keep")
        try:
            done, _ = await asyncio.wait({worker, keeper}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (worker, keeper):
                task.cancel()
            await asyncio.gather(worker, keeper, return_exceptions=True)
            # Compare-and-set on our own revision: a lease already taken over stays so.
            await lease.release()
        if worker in done:
            failure = worker.exception()
            if failure is not None:
                raise failure
            return
        log.warning("heartbeat work stopped: lease lost", extra={"holder": lease.holder})


class OwnerStatus(msgspec.Struct, frozen=True, kw_only=True):
    """What ``fleetctl aggregators`` shows: the lease and the heartbeat consumer."""

    partition: str
    holder: str
    """"" when nobody holds the lease."""
    renewed_ago: float
    ttl: float
    pending: int
    """Heartbeats in FLEET_HB not yet delivered to the owner."""
    unacked: int
    """Heartbeats delivered to the owner and not yet settled."""
    delivered_seq: int
    """The stream sequence last delivered: read twice, its difference is the rate."""


async def owner_status(bus: Bus, subjects: Subjects, durable: str) -> OwnerStatus:
    """The heartbeat lease's holder and its consumer's figures (zeros without one)."""
    bucket = await bus.kv(subjects.bucket_name(BUCKET_LEASES))
    lease = Lease(bucket, "", 5.0)
    current, _ = await lease._read()
    pending = unacked = delivered = 0
    try:
        info = await bus.js.consumer_info(
            subjects.stream_name(STREAM_HEARTBEATS), subjects.stream_name(durable)
        )
        pending, unacked = info.num_pending or 0, info.num_ack_pending or 0
        delivered = info.delivered.stream_seq if info.delivered else 0
    except nats.js.errors.NotFoundError:
        pass
    return OwnerStatus(
        partition=KEY,
        holder=current.holder if current else "",
        renewed_ago=max(0.0, time.time() - current.renewed) if current else 0.0,
        ttl=current.ttl if current else 0.0,
        pending=pending,
        unacked=unacked,
        delivered_seq=delivered or 0,
    )
