"""Workload reconciler actor: keeps every workload of ``fleet_workloads`` running.

Every ``interval``, and as soon as a node a placed workload runs on (or left a copy on)
is written (a workload turning ready or failed, a drain, the node going stale: the
aggregators write such changes at once), it reads every placed workload with its
revision, takes the nodes' records from the process's live feed
(:class:`actors.fleet.live.feed.NodeFeed`: memory, never a read of ``fleet_nodes`` per
round; every node's only when a replica needs a node chosen), decides for each
(:func:`actors.fleet.placement.reconcile.decide`), writes the new record by
compare-and-set and only then sends the deploys and stops, signed with its operator key
(``workloads_key_file``: the nodes must trust that key), for the workloads whose spec an
operator it trusts signed (``workloads_operators``, and its own key): one signed by
anyone else is left alone and logged. A write that loses (another aggregator's
reconciler, or ``fleetctl``, wrote first) sends nothing; the next round decides again
from what the winner wrote. So any number of aggregators may run it, and each replica is
moved once. No round decides while the feed is not complete (starting, or a watch
starting again): a node missing for a moment is never taken for one gone.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import nats.errors
import nats.js.errors

from actors.fleet.live.feed import NodeFeed, followed
from actors.fleet.metrics import AggregatorMetrics
from actors.fleet.placement import store
from actors.fleet.placement.choose import taken_by
from actors.fleet.placement.reconcile import Timing, decide, needs_choice
from actors.fleet.storage.placed import read_all
from actors.fleet.storage.windows import MaintenanceWindows
from actors.runtime.bus import Bus
from actors.runtime.schedule import jittered
from schemas import codec, signing
from schemas.errors import FleetError, SignatureError
from schemas.messages import NodeRecord
from schemas.placement import PlacedWorkload, spec_matches
from schemas.signing import load_key_file
from schemas.subjects import BUCKET_WORKLOADS, Subjects
from schemas.workloads import Deploy

log = logging.getLogger(__name__)

REFUSALS_REMEMBERED = 1024
"""Untrusted (workload, revision) pairs remembered, so each is logged once."""
ROUND_GAP = 0.5
"""Seconds at least between two rounds woken by node writes (a checkpoint of a watched
node wakes it too: at most two rounds a second, however many nodes are written)."""


class ReconcilerActor:
    """Reads the live feed and fleet_workloads; writes fleet_workloads; sends signed
    Deploy and Stop commands."""

    name = "reconciler"

    def __init__(
        self,
        bus: Bus,
        prefix: str,
        key_file: str,
        interval: float = 5.0,
        timing: Timing | None = None,
        operators: Iterable[str] = (),
        metrics: AggregatorMetrics | None = None,
        feed: NodeFeed | None = None,
    ) -> None:
        self.bus = bus
        self.subjects = Subjects(prefix)
        self._own_feed = feed is None
        self.feed = feed or NodeFeed(bus, self.subjects, metrics=metrics)
        """The nodes' records: the process's live feed, or one of its own."""
        self.windows = MaintenanceWindows(bus, self.subjects)
        self.watched: set[str] = set()
        """The nodes the placed workloads run on or left copies on, as of the last round:
        a write of one wakes the next round."""
        self.key = load_key_file(Path(key_file))
        self.interval = interval
        self.timing = timing or Timing()
        self.metrics = metrics or AggregatorMetrics()
        self.operators = {*operators, self.key.public_key}
        """Keys whose signed workloads this reconciler keeps running."""
        self._refused: set[tuple[str, int]] = set()
        self.rounds = 0
        self.sent = 0
        """Commands this reconciler sent after winning the write (deploys and stops)."""

    async def run(self, ready: Callable[[], None]) -> None:
        await self.bus.kv(self.subjects.bucket_name(BUCKET_WORKLOADS))
        async with followed(self.feed, self._own_feed) as following:
            ready()
            loop = asyncio.get_running_loop()
            while True:
                if following.done():
                    following.result()  # its own feed's watch failed: restarted with it
                started, seen, decided = loop.time(), self.feed.writes, False
                try:
                    decided = await self.round()
                except (nats.errors.Error, TimeoutError, FleetError) as exc:
                    log.warning("reconciler round failed", extra={"reason": str(exc)})
                await asyncio.sleep(max(0.0, started + ROUND_GAP - loop.time()))
                if decided:
                    # A round skipped (the feed not complete yet) knows no nodes to
                    # watch: the next comes after ROUND_GAP, not an interval later.
                    await self.feed.changed(self.watched, jittered(self.interval), seen)

    async def round(self) -> bool:
        """Decide once for every placed workload; False (nothing decided) while the feed
        is not complete."""
        placed = await read_all(self.bus, self.subjects)
        if not placed:
            self.watched = set()
            self.rounds += 1
            return True
        await self.read_windows()
        # Checked after the last await before the records are read, in the same step:
        # a feed that lost nodes meanwhile (the aggregator beside it let partitions go)
        # would show a replica's node as gone and move it at once.
        if not self.feed.complete:
            log.debug("reconciler waits for the live feed to be complete")
            return False
        now = time.time()
        trusted = {
            name: (workload, revision)
            for name, (workload, revision) in placed.items()
            if self.trusted(name, workload, revision)
        }
        self.metrics.workload_untrusted.set(len(placed) - len(trusted))
        records = self.feed.whole(self.nodes_of(workload for workload, _ in trusted.values()))
        maintenance, evacuate = self.in_maintenance(records, now)
        if any(needs_choice(w, records, now, self.timing, evacuate) for w, _ in trusted.values()):
            records = self.feed.whole()
            maintenance, evacuate = self.in_maintenance(records, now)
        taken = taken_by(workload for workload, _ in trusted.values())
        bucket = await self.bus.kv(self.subjects.bucket_name(BUCKET_WORKLOADS))
        by = self.key.public_key
        for name, (workload, revision) in trusted.items():
            decision = decide(workload, records, taken, now, self.timing, by, maintenance, evacuate)
            if decision.workload == workload:
                continue
            try:
                await bucket.update(name, codec.encode(decision.workload), last=revision)
            except nats.js.errors.KeyWrongLastSequenceError:
                log.info("another writer changed the workload first", extra={"workload": name})
                continue
            for note in decision.notes:
                log.warning("workload reconciled", extra={"workload": name, "decision": note})
            await store.send(self.bus, self.subjects, self.key, decision.orders)
            self.sent += len(decision.orders)
            for order in decision.orders:
                kind = "deploy" if isinstance(order.action, Deploy) else "stop"
                self.metrics.workload_commands.labels(kind).inc()
            trusted[name] = (decision.workload, revision)
        self.watched = self.nodes_of(workload for workload, _ in trusted.values())
        self.metrics.workload_replicas.clear()
        for name, (workload, _) in trusted.items():
            placed_count = sum(1 for replica in workload.replicas if replica.node)
            self.metrics.workload_replicas.labels(name, "placed").set(placed_count)
            pending = len(workload.replicas) - placed_count
            self.metrics.workload_replicas.labels(name, "pending").set(pending)
        self.rounds += 1
        return True

    @staticmethod
    def nodes_of(placed: Iterable[PlacedWorkload]) -> set[str]:
        """The nodes the workloads run on or left copies on: a round that chooses no node
        decodes no other record."""
        nodes: set[str] = set()
        for workload in placed:
            nodes |= {replica.node for replica in workload.replicas if replica.node}
            nodes |= {leftover.node for leftover in workload.leftovers}
        return nodes

    async def read_windows(self) -> None:
        """Read the maintenance windows afresh (a few small values); where they cannot be
        read, the last ones read stay (logged)."""
        try:
            await self.windows.refresh()
        except (nats.errors.Error, TimeoutError, FleetError) as exc:
            log.warning("maintenance windows not read", extra={"reason": str(exc)})

    def in_maintenance(
        self, records: dict[str, NodeRecord], now: float
    ) -> tuple[dict[str, str], dict[str, str]]:
        """(the window covering each node in one, the same for the windows started with
        ``--drain``: their nodes' replicas move off them)."""
        covered = {
            node: window
            for node, record in records.items()
            if (window := self.windows.covering(record, now)) is not None
        }
        every = {node: window.id for node, window in covered.items()}
        return every, {node: window.id for node, window in covered.items() if window.drain}

    def trusted(self, name: str, workload: PlacedWorkload, revision: int) -> bool:
        """Whether an operator this reconciler trusts signed the workload's spec; a
        refusal is logged once per revision."""
        headers = {signing.HEADER_KEY: workload.created_by, signing.HEADER_SIG: workload.spec_sig}
        try:
            signer = signing.verify(headers, workload.spec.encode())
        except SignatureError as exc:
            why = f"spec signature: {exc}"
        else:
            if signer not in self.operators:
                why = f"signed by {signer}, not a workloads operator"
            elif not spec_matches(workload):
                why = "the record says other than its signed spec"
            else:
                return True
        if (name, revision) not in self._refused:
            self._refused.add((name, revision))
            log.error(
                "placed workload not trusted: left alone", extra={"workload": name, "reason": why}
            )
        return False
