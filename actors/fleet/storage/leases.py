"""The lease bucket (``fleet_leases``) as its readers see it: a lease's value, and every
partition's holder and consumer figures (``fleetctl aggregators`` and the dashboard). The
lease itself, claimed, renewed and fenced by its holder: :mod:`actors.fleet.aggregator.lease`."""

from __future__ import annotations

import asyncio
import time

import msgspec
import nats.js.errors

from actors.fleet.storage.streams import heartbeat_partitions
from actors.runtime import kv
from actors.runtime.bus import Bus
from schemas import codec
from schemas.errors import DecodeError
from schemas.messages import AggregatorLease
from schemas.subjects import BUCKET_LEASES, MAX_PARTITIONS, STREAM_HEARTBEATS, Subjects, lease_key

STATUS_TIMEOUT = 5.0
"""Seconds one read of the lease bucket may take."""


def decode_lease(key: str, value: bytes) -> AggregatorLease | None:
    """A lease value; None when unreadable (taken over like an expired one)."""
    try:
        return codec.decode(value, AggregatorLease, key)
    except DecodeError:
        return None


class PartitionStatus(msgspec.Struct, frozen=True, kw_only=True):
    """What ``fleetctl aggregators`` shows of one partition: its lease and its consumer."""

    partition: str
    holder: str
    """"" when nobody holds the lease."""
    renewed_ago: float
    ttl: float
    pending: int
    """Heartbeats of the partition in FLEET_HB not yet delivered to its consumer."""
    unacked: int
    """Heartbeats delivered to the holder and not yet settled."""
    delivered: int
    """Heartbeats of the partition delivered to its consumer so far (the consumer's own
    sequence; the stream's counts every partition's): read twice, with ``pending``, the
    partition's rate."""


async def partition_status(bus: Bus, subjects: Subjects, durable: str) -> list[PartitionStatus]:
    """Every partition's lease holder and its consumer's figures (zeros without one):
    one read of the lease bucket, one consumer info per partition."""
    count = await heartbeat_partitions(bus.js, subjects)
    entries = await kv.latest_entries(
        bus, subjects.bucket_name(BUCKET_LEASES), 4 * MAX_PARTITIONS + 1024, STATUS_TIMEOUT
    )
    stream = subjects.stream_name(STREAM_HEARTBEATS)

    async def one(partition: int) -> PartitionStatus:
        value, _ = entries.get(lease_key(partition), (b"", 0))
        current = decode_lease(lease_key(partition), value) if value else None
        pending = unacked = delivered = 0
        try:
            info = await bus.js.consumer_info(
                stream, subjects.partition_consumer(durable, partition)
            )
            pending, unacked = info.num_pending or 0, info.num_ack_pending or 0
            delivered = info.delivered.consumer_seq if info.delivered else 0
        except nats.js.errors.NotFoundError:
            pass
        return PartitionStatus(
            partition=str(partition),
            holder=current.holder if current else "",
            renewed_ago=max(0.0, time.time() - current.renewed) if current else 0.0,
            ttl=current.ttl if current else 0.0,
            pending=pending,
            unacked=unacked,
            delivered=delivered or 0,
        )

    return list(await asyncio.gather(*(one(p) for p in range(count))))
