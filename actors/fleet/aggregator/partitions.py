"""Which partitions of ``FLEET_HB`` this aggregator consumes, and the balance between
aggregators.

Each partition ``P`` has its own lease, key ``hb.<P>`` of ``fleet_leases``, claimed,
renewed and fenced by :class:`actors.fleet.aggregator.lease.Lease`'s rules. Each aggregator also
renews a membership key ``member.<holder>`` with its leases; a member whose key has not
changed for ``ttl`` of this aggregator's clock is gone. Balance: an aggregator's share is
``ceil(N / live members)``; above it, it releases its highest partitions (work stopped
first, then the key deleted by revision, so the next claimant takes it at once); below
it, it claims free keys at once and expired ones once they have not changed for ``ttl``.

Two loops: the *keeper* renews what is held (and the membership) every ``ttl / 8`` and
stops a partition's work the moment its lease is lost or fenced; the *balancer* reads the
whole bucket with one batched direct get per round and claims or releases. Loading a
gained partition's records may take seconds at fleet size: it never delays a renewal.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable

import nats.errors
from nats.js.kv import KeyValue

from actors.fleet.aggregator.lease import Lease
from actors.fleet.storage.leases import decode_lease
from actors.runtime import kv
from actors.runtime.bus import Bus, unanswered
from actors.runtime.schedule import stop_if_cancelled
from schemas import codec
from schemas.messages import AggregatorLease
from schemas.subjects import lease_key, member_key

log = logging.getLogger(__name__)

Change = Callable[[set[int]], Awaitable[None]]
MEMBER_FORGET_TTLS = 10
"""A member key unchanged for this many ttls is deleted (a killed aggregator's)."""
MAX_LEASE_KEYS = 4096
"""Keys read per round at most: N leases and the members' keys."""


class Partitions:
    """One aggregator's leases on the N partitions of FLEET_HB. ``gain`` is awaited with
    the partitions claimed in one round (their work starts); ``lose`` with those lost,
    fenced or released (their work must have stopped when it returns)."""

    def __init__(
        self,
        bus: Bus,
        bucket: KeyValue,
        bucket_name: str,
        holder: str,
        ttl: float,
        count: int,
        gain: Change,
        lose: Change,
    ) -> None:
        self.bus = bus
        self.bucket = bucket
        self.bucket_name = bucket_name
        self.holder = holder
        self.ttl = ttl
        self.count = count
        self.leases = {p: Lease(bucket, holder, ttl, lease_key(p)) for p in range(count)}
        self._gain = gain
        self._lose = lose
        self.held: set[int] = set()
        """Partitions whose lease this aggregator holds (their work runs or is starting)."""
        self.members: dict[str, tuple[int, float]] = {}
        """Other aggregators' member keys: (revision, monotonic time it was first seen)."""
        self.alive = 1
        self._member = member_key(holder)
        self._member_sent = 0.0

    def holds(self, partition: int) -> bool:
        return partition in self.held

    @property
    def share(self) -> int:
        return math.ceil(self.count / max(1, self.alive))

    async def run(self) -> None:
        """Keep and balance until cancelled; then stop every partition's work, release
        every lease and delete the membership key (a clean stop hands over at once)."""
        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(self._keep_forever())
                group.create_task(self._balance_forever())
        finally:
            await self._stop()

    async def _stop(self) -> None:
        held = set(self.held)
        self.held.clear()
        if held:
            await self._lose(held)
        await asyncio.gather(*(self.leases[p].release() for p in held))
        with contextlib.suppress(nats.errors.Error, TimeoutError):
            async with asyncio.timeout(self.ttl / 3):
                await self.bucket.delete(self._member)

    # Keeper -------------------------------------------------------------------------------

    async def _keep_forever(self) -> None:
        while True:
            stop_if_cancelled()
            await self.keep()
            # Wake at the next fence at the latest, so a fenced partition stops on time.
            fences = [self.leases[p].fence_at() for p in self.held]
            wake = min([time.monotonic() + self.ttl / 8, *fences])
            await asyncio.sleep(max(0.0, wake - time.monotonic()))

    async def keep(self) -> None:
        """Renew the membership and every held lease that is due, concurrently (each
        renewal bounded by its fence); stop the work of those lost or fenced."""
        due = [p for p in self.held if self.leases[p].renewal_due() or self.leases[p].fenced()]
        _, *renewed = await asyncio.gather(
            self._renew_membership(), *(self.leases[p].renew() for p in due)
        )
        lost = {p for p, ok in zip(due, renewed, strict=True) if not ok}
        if lost:
            await self._drop(lost)

    async def _renew_membership(self) -> None:
        if time.monotonic() - self._member_sent < self.ttl / 3:
            return
        sent = time.monotonic()
        value = codec.encode(AggregatorLease(holder=self.holder, ttl=self.ttl, renewed=time.time()))
        try:
            async with asyncio.timeout(self.ttl / 3):
                await self.bucket.put(self._member, value)
            self._member_sent = sent
            self.bus.jetstream_answered(True)
        except nats.errors.ConnectionClosedError:
            raise
        except (nats.errors.Error, TimeoutError) as exc:
            # The renewal is this aggregator's steady JetStream call: its timeouts move
            # the connection off a server that lost its quorum (Bus.jetstream_answered).
            if unanswered(exc):
                self.bus.jetstream_answered(False)
            log.warning("membership not renewed", extra={"reason": str(exc) or repr(exc)})

    async def _drop(self, lost: set[int]) -> None:
        lost &= self.held
        if not lost:
            return
        self.held -= lost
        log.warning("partitions lost", extra={"partitions": sorted(lost), "holder": self.holder})
        await self._lose(lost)

    # Balancer -----------------------------------------------------------------------------

    async def _balance_forever(self) -> None:
        while True:
            stop_if_cancelled()
            try:
                await self.balance()
            except nats.errors.ConnectionClosedError:
                raise  # the actor ends and is restarted, as its consume loops would
            except (nats.errors.Error, TimeoutError) as exc:
                log.warning("leases unreadable; retrying", extra={"reason": str(exc)})
            await asyncio.sleep(self.ttl / 8)

    async def balance(self) -> None:
        """One round: read every lease and member key (one batched direct get), count the
        live members, release partitions above this aggregator's share or claim up to it."""
        entries = await kv.latest_entries(
            self.bus, self.bucket_name, MAX_LEASE_KEYS, max(1.0, self.ttl / 2)
        )
        for key, revision in self._count_members(entries):
            # A killed aggregator's key: nobody else removes it (by revision: one that
            # came back to life is kept).
            with contextlib.suppress(nats.errors.Error, TimeoutError):
                async with asyncio.timeout(self.ttl / 3):
                    await self.bucket.delete(key, last=revision)
        share = self.share
        if len(self.held) > share:
            extra = set(sorted(self.held)[share:])
            await self.release(extra)
            return
        wanted = share - len(self.held)
        ready: list[tuple[int, int, AggregatorLease | None]] = []
        for p, lease in self.leases.items():
            if p in self.held:
                continue
            value, revision = entries.get(lease.key, (b"", 0))
            if lease.expired(revision):
                ready.append((revision, p, decode_lease(lease.key, value) if value else None))
        # Free keys first (revision 0), then the longest expired.
        ready.sort()
        gained: set[int] = set()
        for revision, p, current in ready[:wanted]:
            if await self.leases[p].take(current, revision):
                gained.add(p)
        if gained:
            self.held |= gained
            log.info(
                "partitions claimed",
                extra={"partitions": sorted(gained), "share": share, "alive": self.alive},
            )
            await self._gain(gained)

    def _count_members(self, entries: dict[str, tuple[bytes, int]]) -> list[tuple[str, int]]:
        """Count the live members (this one included); return the keys of long-gone ones."""
        now = time.monotonic()
        gone: list[tuple[str, int]] = []
        seen: dict[str, tuple[int, float]] = {}
        alive = 1
        for key, (value, revision) in entries.items():
            if not key.startswith("member.") or key == self._member:
                continue
            before = self.members.get(key)
            if before is None:
                # First sight (this aggregator just started): a key its holder renewed
                # more than a ttl ago by its own clock counts as gone already, so a
                # newcomer does not wait a ttl to take its share. Only the share depends
                # on it; a lease is still taken over by watching its revision.
                member = decode_lease(key, value)
                age = time.time() - member.renewed if member is not None else self.ttl
                since = now - self.ttl if age >= self.ttl else now
            else:
                since = before[1] if before[0] == revision else now
            seen[key] = (revision, since)
            if now - since < self.ttl:
                alive += 1
            elif now - since >= MEMBER_FORGET_TTLS * self.ttl:
                gone.append((key, revision))
        self.members = seen
        self.alive = alive
        return gone

    async def release(self, partitions: set[int]) -> None:
        """Stop the work of ``partitions``, then delete their keys (by revision), so the
        aggregator below its share takes them at once."""
        self.held -= partitions
        log.info(
            "partitions released",
            extra={"partitions": sorted(partitions), "share": self.share, "alive": self.alive},
        )
        await self._lose(partitions)
        await asyncio.gather(*(self.leases[p].release() for p in partitions))
