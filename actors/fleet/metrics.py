"""The aggregator's Prometheus metrics, in a registry of its own so an aggregator can share a
process with agents (``fleetctl up``)."""

from __future__ import annotations

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
