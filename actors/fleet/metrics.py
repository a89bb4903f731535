"""The aggregator's Prometheus metrics, in a registry of its own so an aggregator can share a
process with agents (``fleetctl up``)."""

from __future__ import annotations

import math
import time

from prometheus_client import CollectorRegistry, Counter, Gauge


class AggregatorMetrics:
    """Counters the aggregator keeps and the fleet HTTP actor serves."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.accepted = Counter(
            "fleet_heartbeats_accepted", "Heartbeats accepted", registry=self.registry
        )
        self.refused = Counter(
            "fleet_heartbeats_refused",
            "Heartbeats refused, by alert kind",
            ["kind"],
            registry=self.registry,
        )
        self.dropped = Counter(
            "fleet_messages_dropped",
            "Messages of FLEET_HB or fleet.register dropped unhandled, by reason",
            ["reason"],
            registry=self.registry,
        )
        self.markers = Counter(
            "fleet_ttl_markers",
            "TTL delete markers taken as the server's (the others count as forged_marker)",
            registry=self.registry,
        )
        self.records_unreadable = Counter(
            "fleet_records_unreadable",
            "Records in fleet_nodes skipped because they could not be decoded",
            registry=self.registry,
        )
        self.nodes = Gauge(
            "fleet_nodes", "Nodes in fleet_nodes by state", ["state"], registry=self.registry
        )
        self.cluster_nodes = Gauge(
            "fleet_cluster_nodes",
            "Nodes in fleet_nodes by cluster and state",
            ["cluster", "state"],
            registry=self.registry,
        )
        self.record_writes = Counter(
            "fleet_record_writes",
            "Records written to fleet_nodes by this aggregator: state transitions and "
            "periodic checkpoints (a heartbeat that changes nothing is not written at once)",
            registry=self.registry,
        )
        self.owner = Gauge(
            "fleet_aggregator_owner",
            "1 while this aggregator holds the heartbeat lease and consumes FLEET_HB, else 0",
            registry=self.registry,
        )
        self.newest_stored: float | None = None
        """When FLEET_HB stored the newest heartbeat this aggregator processed."""
        self.lag = Gauge(
            "fleet_aggregator_lag_seconds",
            "Seconds since FLEET_HB stored the newest heartbeat this aggregator processed "
            "(NaN before the first); about one heartbeat interval when it keeps up",
            registry=self.registry,
        )
        self.lag.set_function(self._lag)
        self.behind = Gauge(
            "fleet_aggregator_pending_heartbeats",
            "Heartbeats in FLEET_HB not yet delivered to the aggregators' consumer, as of "
            "the last one this aggregator processed",
            registry=self.registry,
        )

        self.pending_now = 0
        self.oldest = Gauge(
            "fleet_aggregator_oldest_unprocessed_seconds",
            "Age of the oldest heartbeat in FLEET_HB this aggregator has not processed yet "
            "(bounded above by the time since the newest processed one was stored; 0 when "
            "nothing is pending)",
            registry=self.registry,
        )
        self.oldest.set_function(self.oldest_unprocessed)

    def oldest_unprocessed(self) -> float:
        """Seconds the oldest unprocessed heartbeat has waited, at most (0: none)."""
        if self.pending_now == 0 or self.newest_stored is None:
            return 0.0
        return max(0.0, time.time() - self.newest_stored)

    def _lag(self) -> float:
        return math.nan if self.newest_stored is None else time.time() - self.newest_stored

    def processed(self, stored: float, pending: int) -> None:
        """A message of FLEET_HB stored at ``stored`` was processed, ``pending`` behind it."""
        if self.newest_stored is None or stored > self.newest_stored:
            self.newest_stored = stored
        self.behind.set(pending)
        self.pending_now = pending
