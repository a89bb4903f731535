"""Automatic retirement: a node offline longer than ``retire_offline_after`` is forgotten
as ``fleetctl forget`` forgets one, by the owner of its partition, in a full sweep.

What it does: the record becomes ``deregistered`` by ``retirement`` with the reason,
the node's approved key is revoked and the commands still queued for it are purged
(:func:`actors.fleet.storage.registry.withdraw`), and a ``forgotten`` alert says so
(details ``by: retirement``). The node's heartbeats are refused from then on; ``fleetctl
approve NODE`` admits it again.

Never on a silence the fleet caused. A node's silence counts only from the latest of:
its going offline (``offline_since``); this aggregator starting to consume the node's
partition (:meth:`Ownership.watched_since`); the last moment this aggregator could not
see the fleet (not connected, a partition's consumer missing or behind ``max_lag``, a
sweep that failed); and the last moment the fleet looked silent around the node: more
than ``retire_hold_fraction`` of the nodes this aggregator owns stale or offline, or of
those of the node's cluster (when it owns two or more of it). An outage, a restart, a
lost lease make retirement later, never earlier. With several aggregators only a node's
owner sweeps it, the record is written by compare-and-set (an operator's change meanwhile
is kept), and the alert's id names the node's ``offline_since``, so they raise one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from actors.fleet import record_state
from actors.fleet.aggregator.hot_state import NodeState
from actors.fleet.aggregator.ledger import Ledger
from actors.fleet.aggregator.ownership import Ownership
from actors.fleet.aggregator.writes import RecordWrites
from actors.fleet.alerts.publisher import AlertPublisher
from actors.fleet.config import AggregatorConfig
from actors.fleet.metrics import AggregatorMetrics
from actors.fleet.storage import registry
from actors.runtime.bus import Bus
from actors.runtime.spans import span
from schemas.errors import DecodeError
from schemas.messages import NodeRecord
from schemas.subjects import Subjects

log = logging.getLogger(__name__)

RETIRED_BY = "retirement"
"""``deregistered_by`` of a retired node (an operator's forget names the operator's key)."""


def counted(record: NodeRecord) -> bool:
    """A node the fleet expects to hear from: enrolled, not forgotten, not stopped on
    request (a goodbye makes its silence expected)."""
    return not record.deregistered and record.state != "pending" and record.stopped_since is None


def silent(record: NodeRecord) -> bool:
    return record.stale_since is not None or record.offline_since is not None


def silent_shares(records: Iterable[NodeRecord]) -> tuple[float, dict[str, float]]:
    """The share of counted nodes that are silent: of them all, and per cluster of two
    or more (a lone node's cluster says nothing its own silence does not)."""
    totals: dict[str, list[int]] = {}
    for record in records:
        if counted(record):
            tally = totals.setdefault(record.cluster, [0, 0])
            tally[0] += silent(record)
            tally[1] += 1
    quiet = sum(tally[0] for tally in totals.values())
    every = sum(tally[1] for tally in totals.values())
    clusters = {name: tally[0] / tally[1] for name, tally in totals.items() if tally[1] >= 2}
    return (quiet / every if every else 0.0), clusters


def retirable(record: NodeRecord, now: float, counted_from: float, after: float) -> bool:
    """An offline node whose silence, counted from the later of its going offline and
    ``counted_from``, has lasted ``after``."""
    if record.offline_since is None or not counted(record):
        return False
    return now - max(record.offline_since, counted_from) >= after


class Retirement:
    """The retirement of the nodes in ``ledger`` (``ownership`` says whose), and the
    clocks that keep it from acting on a silence the fleet caused."""

    def __init__(
        self,
        config: AggregatorConfig,
        bus: Bus,
        subjects: Subjects,
        ledger: Ledger,
        ownership: Ownership,
        writes: RecordWrites,
        alerts: AlertPublisher,
        metrics: AggregatorMetrics,
    ) -> None:
        self.config = config
        self.bus = bus
        self.subjects = subjects
        self.ledger = ledger
        self.ownership = ownership
        self.writes = writes
        self.alerts = alerts
        self.metrics = metrics
        self.clear_since = time.time()
        """Since when this aggregator has seen the fleet without interruption and the
        fleet has not looked silent as a whole."""
        self.cluster_clear: dict[str, float] = {}
        """Per cluster, the last moment it looked silent."""
        self.holding = ""
        """Why retirement holds now ("" when it does not): logged when it changes."""

    def interrupted(self, now: float, why: str) -> None:
        """This aggregator could not see the fleet at ``now``: counting starts again."""
        self.clear_since = now
        if why != self.holding:
            log.warning("retirement held", extra={"reason": why})
        self.holding = why

    async def sweep(self, now: float) -> None:
        """Retire every node of the ledger whose silence has lasted retire_offline_after
        (see the module's docstring); nothing while retire_offline_after is 0."""
        after = self.config.retire_offline_after
        if not after:
            return
        problem = "not connected to NATS" if not self.bus.connected else self.ownership.problem()
        if problem:
            self.interrupted(now, problem)
            return
        nodes = self.ledger.nodes
        overall, clusters = silent_shares(state.record for state in nodes.values())
        fraction = self.config.retire_hold_fraction
        if overall > fraction:
            self.interrupted(now, f"{overall:.0%} of the nodes here are stale or offline")
            return
        if self.holding:
            log.info("retirement counts again", extra={"held": self.holding})
            self.holding = ""
        for cluster, share in clusters.items():
            if share > fraction:
                self.cluster_clear[cluster] = now
        for cluster in set(self.cluster_clear) - set(clusters):
            del self.cluster_clear[cluster]  # no nodes of it here any more
        for node, state in list(nodes.items()):
            since = self.ownership.watched_since(node)
            if since is None:
                continue
            cluster_clear = self.cluster_clear.get(state.record.cluster, 0.0)
            counted_from = max(self.clear_since, since, cluster_clear)
            if retirable(state.record, now, counted_from, after):
                await self._retire(node, state, now)

    async def _retire(self, node: str, state: NodeState, now: float) -> None:
        """Forget ``node``: its in-memory record first (a heartbeat judged meanwhile is
        refused as a deregistered node's), then written, its key revoked, its commands
        purged, and the alert."""
        before = state.record
        reason = f"offline for more than {span(self.config.retire_offline_after)}"
        state.keep(
            record_state.with_state(
                before,
                deregistered=True,
                deregistered_by=RETIRED_BY,
                deregistered_reason=reason,
                deregistered_at=now,
            )
        )
        state.dirty = True
        await self.writes.write(node)
        try:
            entry = await registry.trust_entry(self.bus, self.subjects, node)
        except DecodeError:
            entry = None  # unreadable: nothing to revoke that anyone could read either
        revoked, purged = await registry.withdraw(self.bus, self.subjects, node, entry)
        offline_since = before.offline_since or now
        await self.alerts.publish(
            "forgotten",
            before.cluster,
            node,
            f"retired: {reason} (retire_offline_after)",
            f"retired-{offline_since:.0f}",
            {"by": RETIRED_BY, "reason": reason, "revoked": str(revoked).lower()},
        )
        self.metrics.retired.inc()
        log.warning(
            "node retired",
            extra={"node": node, "reason": reason, "revoked": revoked, "purged": purged},
        )
