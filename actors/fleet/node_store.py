"""The fleet's KV buckets as the aggregators use them: node records and approved keys.

Records are changed by read-modify-write with compare-and-set on the KV revision, so any
number of aggregators can write concurrently without losing an update.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import nats.js.errors
from nats.js.kv import KV_DEL, KV_PURGE, KeyValue

from actors.runtime.bus import Bus, stop_watcher
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
        self._trusted: dict[str, str] | None = None
        """Approved keys from the trust watch; None until it has caught up."""

    @classmethod
    async def open(cls, bus: Bus, subjects: Subjects) -> NodeStore:
        return cls(
            await bus.kv(subjects.bucket_name(names.BUCKET_NODES)),
            await bus.kv(subjects.bucket_name(names.BUCKET_TRUST)),
        )

    async def trusted_key(self, node: str, fresh: bool = False) -> str | None:
        """The node's approved public key; None if unknown, revoked or unreadable. From
        the trust watch's copy unless ``fresh`` (or the copy is not complete yet)."""
        if self._trusted is not None and not fresh:
            return self._trusted.get(node)
        try:
            entry = await self.trust.get(node)
        except nats.js.errors.KeyNotFoundError:
            return None
        return _approved_key(node, entry.value)

    async def follow_trust(self) -> None:
        """Keep the approved keys in memory from a KV watch, so verifying a heartbeat costs
        no round trip. An approval or revocation applies as soon as the watch delivers it
        (milliseconds); until the watch has caught up, keys are read one by one."""
        watcher = await self.trust.watchall()
        trusted: dict[str, str] = {}
        try:
            async for entry in watcher:
                if entry is None:  # every current entry delivered: the copy is complete
                    self._trusted = trusted
                    continue
                key = _approved_key(entry.key, entry.value)
                if entry.operation in (KV_DEL, KV_PURGE) or key is None:
                    trusted.pop(entry.key, None)
                else:
                    trusted[entry.key] = key
        finally:
            self._trusted = None
            await stop_watcher(watcher)

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


def _approved_key(node: str, value: bytes | None) -> str | None:
    if not value:
        return None
    try:
        trust = codec.decode(value, TrustEntry, f"trust record {node}")
    except DecodeError as exc:
        log.error("unreadable trust entry", extra={"node": node, "reason": str(exc)})
        return None
    return None if trust.revoked else trust.public_key
