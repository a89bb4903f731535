"""The fleet's KV buckets as the aggregators use them: node records and approved keys.

Records are changed by read-modify-write with compare-and-set on the KV revision, so any
number of aggregators can write concurrently without losing an update. A record this
version cannot decode (damaged, or written by a newer aggregator during a rolling upgrade)
is never overwritten: that node is skipped, counted and logged, and stays as it is until a
reader that understands it (or an operator deleting the key) takes over. Approved keys are
read through :mod:`actors.fleet.storage.registry`, the one reader of ``fleet_trust``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from collections.abc import Callable

import nats.js.errors
from nats.js.kv import KeyValue

from actors.fleet.metrics import AggregatorMetrics
from actors.fleet.storage import registry
from actors.runtime import kv
from actors.runtime.bus import Bus
from schemas import codec
from schemas.errors import DecodeError
from schemas.messages import NodeRecord, TrustEntry
from schemas.subjects import BUCKET_NODES, BUCKET_TRUST, Subjects

log = logging.getLogger(__name__)

CAS_ATTEMPTS = 8

Change = Callable[[NodeRecord | None], NodeRecord | None]
Condition = Callable[[NodeRecord], bool]


class NodeStore:
    """The buckets are looked up on first use (the bus keeps them), so a store can be made
    before an aggregator has provisioned them."""

    def __init__(
        self, bus: Bus, subjects: Subjects, metrics: AggregatorMetrics | None = None
    ) -> None:
        self.bus = bus
        self.subjects = subjects
        self.metrics = metrics or AggregatorMetrics()
        self._trusted: dict[str, str] | None = None
        """Approved keys from the trust watch; None until it has caught up."""
        self.trust_backlog = 0
        """Entries of ``fleet_trust`` the trust watch has still to take in (as the server
        counted when it sent the last one taken)."""
        self._trust_current = asyncio.Event()
        self._trust_current.set()

    async def _nodes(self) -> KeyValue:
        return await self.bus.kv(self.subjects.bucket_name(BUCKET_NODES))

    async def trusted_key(self, node: str, fresh: bool = False) -> str | None:
        """The node's approved public key; None if unknown, revoked or unreadable. From
        the trust watch's copy unless ``fresh`` (or the copy is not complete yet)."""
        if self._trusted is not None and not fresh:
            return self._trusted.get(node)
        key, _ = await self.fresh_standing(node)
        return key

    async def fresh_standing(self, node: str) -> tuple[str | None, bool]:
        """(the node's approved key, whether it has a trust entry that is revoked), read
        afresh; (None, False) when there is none or it is unreadable."""
        try:
            entry = await registry.trust_entry(self.bus, self.subjects, node)
        except DecodeError as exc:
            log.error("unreadable trust entry", extra={"node": node, "reason": str(exc)})
            return None, False
        return registry.approved_key(entry), entry is not None and entry.revoked

    def cached_key(self, node: str) -> str | None:
        """The node's approved key from the trust watch's copy, without a round trip;
        None if unknown there or the copy is not complete yet (then read it afresh)."""
        return self._trusted.get(node) if self._trusted is not None else None

    async def follow_trust(self, changed: Callable[[str], None] | None = None) -> None:
        """Keep the approved keys in memory from a KV watch, so verifying a heartbeat costs
        no round trip. An approval or revocation applies as soon as the watch delivers it
        (milliseconds); until the watch has caught up, keys are read one by one.
        ``changed(node)`` is told of every change after the watch has caught up."""
        trusted: dict[str, str] = {}

        def on_change(node: str, entry: TrustEntry | None) -> None:
            key = registry.approved_key(entry)
            if key is None:
                trusted.pop(node, None)
            else:
                # Interned: the owner's records hold the same name and key (hot_state.slim).
                trusted[sys.intern(node)] = sys.intern(key)
            if changed is not None and self._trusted is trusted:
                changed(node)

        def settled() -> None:
            if self.trust_backlog == 0 and self._trusted is not None:
                self._trust_current.set()
            else:
                self._trust_current.clear()

        def on_current() -> None:
            self._trusted = trusted
            settled()

        def on_behind(entries: int) -> None:
            self.trust_backlog = entries
            settled()

        self._trust_current.clear()
        try:
            trust = await self.bus.kv(self.subjects.bucket_name(BUCKET_TRUST))
            await kv.follow(trust, TrustEntry, on_change, on_current, on_behind=on_behind)
        finally:
            self._trusted = None
            self.trust_backlog = 0
            self._trust_current.set()  # no watch: nothing to wait for (keys read afresh)

    async def trust_caught_up(self, limit: float) -> None:
        """Return once the trust watch has taken in every entry the server had for it, or
        after ``limit`` seconds. A heartbeat of a node whose approval the watch has not
        taken in yet is judged by reading its key and record afresh (two round trips):
        after an enrollment of thousands of nodes, judging their first heartbeats before
        the watch has their keys costs more than waiting for it, and takes from the watch
        the time it needs to catch up."""
        if self._trust_current.is_set():
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(limit):
                await self._trust_current.wait()

    async def update(
        self, node: str, change: Change
    ) -> tuple[NodeRecord | None, NodeRecord | None, int | None]:
        """Apply ``change`` to the current record and write the result if nobody wrote in
        between, else read again and retry. Returns (before, written, revision): the
        revision written (or read, when nothing was); ``change`` returning None writes
        nothing (written is None). ``change`` may run more than once, so it must not have
        effects beyond its return value. An unreadable record returns (None, None, None)
        without calling ``change``: writing over it blindly could undo what a newer
        aggregator knows. (The partition owner's writes over a record it knows go out
        without a read first: ``RecordWrites._write_known``.)"""
        nodes = await self._nodes()
        for _ in range(CAS_ATTEMPTS):
            try:
                current, revision = await kv.read_with_revision(nodes, node, NodeRecord)
            except DecodeError as exc:
                self.metrics.records_unreadable.inc()
                log.error("unreadable record skipped", extra={"node": node, "reason": str(exc)})
                return None, None, None
            updated = change(current)
            if updated is None:
                return current, None, revision
            body = codec.encode(updated)
            try:
                if revision is None:
                    written = await nodes.create(node, body)
                else:
                    written = await nodes.update(node, body, last=revision)
                return current, updated, written
            except (nats.js.errors.KeyWrongLastSequenceError, nats.js.errors.APIError) as exc:
                log.debug(
                    "record changed underneath; retrying", extra={"node": node, "reason": str(exc)}
                )
        raise RuntimeError(f"could not update record of {node} after {CAS_ATTEMPTS} attempts")

    async def delete_if(self, node: str, condition: Condition) -> bool:
        """Delete the record of ``node`` if it meets ``condition``, unless somebody wrote
        it in between (compare-and-set on the revision): a pending record approved and
        beating a moment ago is kept. True if deleted."""
        nodes = await self._nodes()
        current, revision = await kv.read_with_revision(nodes, node, NodeRecord)
        if current is None or revision is None or not condition(current):
            return False
        try:
            await nodes.delete(node, last=revision)
        except (nats.js.errors.KeyWrongLastSequenceError, nats.js.errors.APIError) as exc:
            log.debug("record changed underneath; kept", extra={"node": node, "reason": str(exc)})
            return False
        return True
