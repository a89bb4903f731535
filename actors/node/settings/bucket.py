"""The read a node makes of KV ``fleet_settings``: the latest message of the ``fleet``
key, of its cluster's key and of every selector key, in one batched direct get
(``multi_last``: no consumer is created, and it is the one read deploy/nats/auth.conf
lets a node make of the bucket), each judged by :class:`.entries.Held`."""

from __future__ import annotations

from collections import Counter

from actors.node.settings.entries import IGNORE_REASONS, TAKEN, Held
from actors.runtime import direct_get
from actors.runtime.bus import Bus
from schemas.settings import FLEET_KEY, cluster_key
from schemas.subjects import BUCKET_SETTINGS, Subjects


async def take_latest(
    bus: Bus, subjects: Subjects, cluster: str, held: Held, trusted: set[str], timeout: float
) -> Counter[str]:
    """Read the bucket and let ``held`` judge each entry; how many were taken (``taken``)
    and ignored, by reason. Raises nats.errors.Error (BatchError: refused, or no bucket)
    or TimeoutError."""
    bucket = subjects.bucket_name(BUCKET_SETTINGS)
    prefix = f"$KV.{bucket}."
    wanted = [prefix + FLEET_KEY, prefix + cluster_key(cluster), f"{prefix}selector.>"]
    found = await direct_get.last_of(bus, f"KV_{bucket}", wanted, timeout)
    counts: Counter[str] = Counter()
    for stored in found:
        key = stored.subject.removeprefix(prefix)
        verdict = held.take(key, stored.seq, stored.headers, stored.data, trusted)
        if verdict == TAKEN or verdict in IGNORE_REASONS:
            counts[verdict] += 1
    return counts
