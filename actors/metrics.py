"""Per-agent Prometheus metrics; one registry per agent so several agents share a process."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge


class AgentMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.started = time.time()
        self.heartbeats = Counter(
            "node_agent_heartbeat", "Heartbeats acknowledged by JetStream", registry=self.registry
        )
        self.heartbeat_failures = Counter(
            "node_agent_heartbeat_failures",
            "Heartbeats that could not be published or were not acknowledged",
            registry=self.registry,
        )
        self.sequence = Gauge(
            "node_agent_sequence_number",
            "Sequence number of the last heartbeat",
            registry=self.registry,
        )
