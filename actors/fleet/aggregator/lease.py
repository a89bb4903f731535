"""The lease that makes one aggregator at a time the owner of a partition of ``FLEET_HB``.

The owner keeps every node's acceptance state in memory, which is exact only while no
other aggregator judges the same nodes. So aggregators take turns through one KV key per
partition (``fleet_leases``, key ``hb.<P>``), by compare-and-set on its revision:

- **claim**: ``create`` the key if nobody holds it; else watch its revision, and once it
  has not changed for ``ttl`` seconds of this aggregator's own clock, ``update`` it with
  ``last=`` that revision (two claimants: one wins, the other's update is refused).
- **renew**: the holder ``update``s it with ``last=`` its own revision every ``ttl / 3``.
  A refused renewal means someone else holds it: the holder stops at once.
- **fence**: the holder also stops on its own once ``ttl - margin`` has passed since it
  *sent* its last successful renewal. A claimant waits ``ttl`` from the moment it first
  saw that renewal's revision, which is after it was sent: the old holder has stopped
  ``margin`` seconds before anyone can take over (only clock *rates* matter, not clocks).

What a holder does while it holds a lease is its work; it is cancelled, and waited for,
before the lease can pass on (:mod:`actors.fleet.aggregator.partitions`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import socket
import time

import nats.errors
import nats.js.errors
from nats.js.kv import KeyValue

from schemas import codec
from schemas.messages import AggregatorLease

log = logging.getLogger(__name__)

MARGIN_FRACTION = 0.25
"""The fence falls this fraction of ``ttl`` before a claimant may take over."""


def holder_id() -> str:
    """This process's holder id: host and a random suffix (a restart is a new holder). A
    KV key token (``member.<holder>``): a host name's dots and other characters become -."""
    host = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname()[:40]) or "aggregator"
    return f"{host}-{os.urandom(4).hex()}"


class Lease:
    """One aggregator's side of one lease key (``hb.<P>``: a partition of FLEET_HB).

    The rules are written once, as steps: :meth:`expired` and :meth:`take` (a claim on
    the key as just read), :meth:`renew` (one renewal), :meth:`fenced`, :meth:`release`;
    :mod:`actors.fleet.aggregator.partitions` drives one per partition from one scan of the
    bucket."""

    def __init__(self, bucket: KeyValue, holder: str, ttl: float, key: str) -> None:
        self.bucket = bucket
        self.holder = holder
        self.ttl = ttl
        self.key = key
        self.held = False
        self.took_over_at = 0.0
        """Monotonic time this aggregator last took the lease."""
        self._revision = 0
        self._seen = -1
        self._since = 0.0
        self._sent_ok = 0.0
        """Monotonic time the last successful renewal (or the claim) was sent."""
        self._renewing = asyncio.Lock()
        """Held through a renewal: a release waits for the one in flight, whose revision
        it must delete by (with the one before, the delete would be refused and the key
        left to expire: a ttl without an owner)."""

    def _value(self) -> bytes:
        return codec.encode(AggregatorLease(holder=self.holder, ttl=self.ttl, renewed=time.time()))

    def expired(self, revision: int) -> bool:
        """Whether the key, last read at ``revision``, has not changed for ``ttl`` of this
        aggregator's clock (0: absent, free at once). Each call is an observation."""
        now = time.monotonic()
        if revision == 0:
            return True
        if revision != self._seen:
            self._seen, self._since = revision, now
            return False
        return now - self._since >= self.ttl

    async def take(self, lease: AggregatorLease | None, revision: int) -> bool:
        """Create the key (``revision`` 0) or update it with ``last=revision`` (one that
        :meth:`expired` said is free). Another claimant winning the same round is not an
        error: it just is not held."""
        sent = time.monotonic()
        try:
            if revision == 0:
                async with asyncio.timeout(self.ttl / 3):
                    self._revision = await self.bucket.create(self.key, self._value())
            else:
                async with asyncio.timeout(self.ttl / 3):
                    self._revision = await self.bucket.update(
                        self.key, self._value(), last=revision
                    )
                log.warning(
                    "heartbeat lease taken over",
                    extra={
                        "from": lease.holder if lease else "?",
                        "holder": self.holder,
                        "key": self.key,
                    },
                )
        except (nats.js.errors.KeyWrongLastSequenceError, nats.js.errors.APIError):
            self._seen = -1  # another claimant won this round
            return False
        self.held = True
        self._seen = -1
        self._sent_ok = sent
        self.took_over_at = time.monotonic()
        log.info("heartbeat lease held", extra={"holder": self.holder, "key": self.key})
        return True

    def fence_at(self) -> float:
        """Monotonic time the fence falls unless a renewal succeeds before."""
        return self._sent_ok + self.ttl * (1 - MARGIN_FRACTION)

    def fenced(self) -> bool:
        """Whether ``ttl - margin`` has passed since the last successful renewal was sent:
        the holder must have stopped its work by now."""
        return time.monotonic() >= self.fence_at()

    def renewal_due(self) -> bool:
        return time.monotonic() - self._sent_ok >= self.ttl / 3

    async def renew(self) -> bool:
        """One renewal, bounded by the fence; False when the lease is lost (refused: held
        by another) or fenced. A transient failure returns True (retried next time; the
        fence ends it if it goes on)."""
        async with self._renewing:
            return await self._renew()

    async def _renew(self) -> bool:
        if not self.held:
            return False  # released while this renewal waited for its turn
        if self.fenced():
            log.error("lease not renewed in time; stopping", extra={"key": self.key})
            self.held = False
            return False
        sent = time.monotonic()
        left = self.fence_at() - sent
        try:
            async with asyncio.timeout(max(0.05, left)):
                self._revision = await self.bucket.update(
                    self.key, self._value(), last=self._revision
                )
            self._sent_ok = sent
        except (nats.js.errors.KeyWrongLastSequenceError, nats.js.errors.APIError):
            log.error(
                "lease lost to another aggregator", extra={"holder": self.holder, "key": self.key}
            )
            self.held = False
            return False
        except (nats.errors.Error, TimeoutError) as exc:
            log.warning("lease renewal failed; retrying", extra={"reason": str(exc)})
            if self.fenced():  # the attempt ran into the fence: stop now, not next round
                self.held = False
                return False
        return True

    async def release(self) -> None:
        """Give the lease up (a clean stop), so another aggregator takes over at once.
        Compare-and-set on this holder's revision: a lease taken over stays so."""
        self.held = False
        async with self._renewing:
            pass  # a renewal in flight moves the revision this delete names
        with contextlib.suppress(nats.errors.Error, TimeoutError):
            async with asyncio.timeout(self.ttl / 3):
                await self.bucket.delete(self.key, last=self._revision)
