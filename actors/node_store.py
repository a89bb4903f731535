"""The fleet's KV buckets as the aggregators use them: node records and approved keys.

Records are changed by read-modify-write with compare-and-set on the KV revision, so any
number of aggregators can write concurrently without losing an update.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import nats.js.errors
from nats.js.kv import KeyValue

from actors.bus import Bus
from schemas import codec
from schemas import subjects as names
from schemas.errors import DecodeError
from schemas.messages import NodeRecord, TrustEntry
from schemas.subjects import Subjects

log = logging.getLogger(__name__)

CAS_ATTEMPTS = 8

Change = Callable[[NodeRecord | None], NodeRecord | None]


class NodeStore:
    def __init__(self, nodes: KeyValue, trust: KeyValue) -> None:
        self.nodes = nodes
        self.trust = trust

    @classmethod
    async def open(cls, bus: Bus, subjects: Subjects) -> NodeStore:
        return cls(
            await bus.kv(subjects.bucket_name(names.BUCKET_NODES)),
            await bus.kv(subjects.bucket_name(names.BUCKET_TRUST)),
        )

    async def trusted_key(self, node: str) -> str | None:
        """The node's approved public key; None if unknown, revoked or unreadable."""
        try:
            entry = await self.trust.get(node)
        except nats.js.errors.KeyNotFoundError:
            return None
        if entry.value is None:
            return None
        try:
            trust = codec.decode(entry.value, TrustEntry, f"trust record {node}")
        except DecodeError as exc:
            log.error("unreadable trust entry", extra={"node": node, "reason": str(exc)})
            return None
        return None if trust.revoked else trust.public_key

    async def node_ids(self) -> list[str]:
        try:
            return list(await self.nodes.keys())
        except nats.js.errors.NoKeysError:
            return []

    async def read(self, node: str) -> tuple[NodeRecord | None, int | None]:
        """The record and its KV revision (None, None when there is none)."""
        try:
            entry = await self.nodes.get(node)
        except nats.js.errors.KeyNotFoundError:
            return None, None
        if entry.value is None:
            return None, entry.revision
        return codec.decode(entry.value, NodeRecord, f"node record {node}"), entry.revision

    async def update(
        self, node: str, change: Change
    ) -> tuple[NodeRecord | None, NodeRecord | None]:
        """Apply ``change`` to the current record and write the result if nobody wrote in
        between, else read again and retry. Returns (before, written); ``change`` returning
        None writes nothing (written is None). ``change`` may run more than once, so it
        must not have effects beyond its return value."""
        for _ in range(CAS_ATTEMPTS):
            current, revision = await self.read(node)
            updated = change(current)
            if updated is None:
                return current, None
            body = codec.encode(updated)
            try:
                if revision is None:
                    await self.nodes.create(node, body)
                else:
                    await self.nodes.update(node, body, last=revision)
                return current, updated
            except (nats.js.errors.KeyWrongLastSequenceError, nats.js.errors.APIError) as exc:
                log.debug(
                    "record changed underneath; retrying", extra={"node": node, "reason": str(exc)}
                )
        raise RuntimeError(f"could not update record of {node} after {CAS_ATTEMPTS} attempts")
