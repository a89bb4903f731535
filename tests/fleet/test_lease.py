"""One lease key's rules against a real server: a release hands the key over at once, even
when a renewal of it is still in flight."""

from __future__ import annotations

import asyncio

import nats.js.errors
import pytest

from actors.fleet.aggregator.lease import Lease
from actors.runtime.bus import NatsBus
from schemas.subjects import BUCKET_LEASES, Subjects, lease_key


async def test_a_release_during_a_renewal_deletes_the_key(bus: NatsBus, prefix: str) -> None:
    """Renewal sent, release asked before its answer: the delete names the renewal's
    revision, so the key is gone (the next claimant creates it at once) rather than left
    to expire a ttl later. A renewal that comes after the release does not renew."""
    bucket = await bus.kv(Subjects(prefix).bucket_name(BUCKET_LEASES))
    key = lease_key(0)
    lease = Lease(bucket, "holder-a", 30.0, key)
    assert await lease.take(None, 0)
    renewed = lease._revision

    renewal = asyncio.create_task(lease.renew())
    await asyncio.sleep(0)  # the renewal's update is on its way
    await lease.release()
    assert await renewal
    assert lease._revision > renewed
    with pytest.raises(nats.js.errors.KeyNotFoundError):  # deleted (a marker), not expiring
        await bucket.get(key)
    other = Lease(bucket, "holder-b", 30.0, key)
    assert other.expired(0)
    assert await other.take(None, 0)  # created over the delete marker: free at once

    assert not await lease.renew()  # released: not renewed any more
    entry = await bucket.get(key)
    assert entry.value is not None and b"holder-b" in entry.value
