"""Workload reconciler actor: keeps every workload of ``fleet_workloads`` running.

Every ``interval`` it reads every placed workload with its revision and the records of
the nodes they run on (every node's record only when a replica needs a node chosen),
decides for each (:func:`actors.fleet.placement.reconcile.decide`), writes the
new record by compare-and-set and only then sends the deploys and stops, signed with its
operator key (``workloads_key_file``: the nodes must trust that key), for the workloads
whose spec an operator it trusts signed (``workloads_operators``, and its own key): one
signed by anyone else is left alone and logged. A write that loses
(another aggregator's reconciler, or ``fleetctl``, wrote first) sends nothing; the next
round decides again from what the winner wrote. So any number of aggregators may run it,
and each replica is moved once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import nats.errors
import nats.js.errors

from actors.fleet.metrics import AggregatorMetrics
from actors.fleet.placement import store
from actors.fleet.placement.choose import taken_by
from actors.fleet.placement.reconcile import Timing, decide, needs_choice
from actors.fleet.storage import registry
from actors.fleet.storage.placed import read_all
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


class ReconcilerActor:
    """Reads fleet_nodes and fleet_workloads; writes fleet_workloads; sends signed Deploy
    and Stop commands."""

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
    ) -> None:
        self.bus = bus
        self.subjects = Subjects(prefix)
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
        ready()
        while True:
            try:
                await self.round()
            except (nats.errors.Error, TimeoutError, FleetError) as exc:
                log.warning("reconciler round failed", extra={"reason": str(exc)})
            await asyncio.sleep(jittered(self.interval))

    async def round(self) -> None:
        """Decide once for every placed workload."""
        placed = await read_all(self.bus, self.subjects)
        if not placed:
            self.rounds += 1
            return
        now = time.time()
        trusted = {
            name: (workload, revision)
            for name, (workload, revision) in placed.items()
            if self.trusted(name, workload, revision)
        }
        self.metrics.workload_untrusted.set(len(placed) - len(trusted))
        records = await self.records_of(trusted.values())
        if any(needs_choice(w, records, now, self.timing) for w, _ in trusted.values()):
            records = {r.node_id: r for r in await registry.read_records(self.bus, self.subjects)}
        taken = taken_by(workload for workload, _ in trusted.values())
        bucket = await self.bus.kv(self.subjects.bucket_name(BUCKET_WORKLOADS))
        for name, (workload, revision) in trusted.items():
            decision = decide(workload, records, taken, now, self.timing, self.key.public_key)
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
        self.metrics.workload_replicas.clear()
        for name, (workload, _) in trusted.items():
            placed_count = sum(1 for replica in workload.replicas if replica.node)
            self.metrics.workload_replicas.labels(name, "placed").set(placed_count)
            pending = len(workload.replicas) - placed_count
            self.metrics.workload_replicas.labels(name, "pending").set(pending)
        self.rounds += 1

    async def records_of(
        self, placed: Iterable[tuple[PlacedWorkload, int]]
    ) -> dict[str, NodeRecord]:
        """The records of the nodes the workloads run on (or left copies on), each read by
        key: a round that chooses no node reads no other record."""
        nodes = set()
        for workload, _ in placed:
            nodes |= {replica.node for replica in workload.replicas if replica.node}
            nodes |= {leftover.node for leftover in workload.leftovers}
        records = {}
        for node in sorted(nodes):
            try:
                records[node] = await registry.read_record(self.bus, self.subjects, node)
            except registry.NotFound:
                continue
        return records

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
