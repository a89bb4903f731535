"""The attacker's side: plain nats-py connections and hand-built messages, none of the
project's publishing helpers, so the tests show what any client on the server can do."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import nats
from nats.aio.client import Client
from prometheus_client import CollectorRegistry

from actors.runtime.supervisor import Supervisor
from schemas.messages import NodeRecord


@asynccontextmanager
async def attacker(url: str) -> AsyncIterator[Client]:
    """A plain nats-py connection, closed on the way out."""
    nc = await nats.connect(url, name="attacker")
    try:
        yield nc
    finally:
        await nc.close()


def counted(registry: CollectorRegistry, name: str, **labels: str) -> float:
    """The value of counter ``name`` (its ``_total`` sample) with ``labels``; 0 if unset."""
    return registry.get_sample_value(f"{name}_total", labels) or 0.0


def count_is(registry: CollectorRegistry, name: str, value: float, **labels: str) -> bool:
    """Whether counter ``name`` with ``labels`` is at ``value`` (a condition to wait for)."""
    return counted(registry, name, **labels) == value


def seq_is(seq: int, record: NodeRecord) -> bool:
    """Whether ``record`` last accepted heartbeat ``seq`` (a record to wait for)."""
    return record.last_seq == seq


def restarts(supervisor: Supervisor) -> dict[str, int]:
    return {name: status.restarts for name, status in supervisor.status.items()}


async def http_status(url: str) -> int:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        return response.status
