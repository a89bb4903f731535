"""The node agent's Prometheus metrics, in a registry of its own so several agents can share
a process (``fleetctl up``)."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge

from schemas.events import Engine, Gpu, Health


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
        self.dropped = Counter(
            "node_agent_messages_dropped",
            "Messages of FLEET_CMD dropped unhandled, by reason",
            ["reason"],
            registry=self.registry,
        )
        self.sequence = Gauge(
            "node_agent_sequence_number",
            "Sequence number of the last heartbeat",
            registry=self.registry,
        )
        self.events_dropped = Counter(
            "node_agent_events_dropped",
            "Node events a consuming actor refused (unsigned, bad_signature, untrusted_key, "
            "malformed); each consuming actor counts its own",
            ["actor", "reason"],
            registry=self.registry,
        )
        self.uptime = Gauge(
            "node_agent_uptime_seconds", "Seconds since the agent started", registry=self.registry
        )
        self.uptime.set_function(lambda: time.time() - self.started)
        self.health_score = Gauge(
            "node_agent_health_score", "Latest health score (0-100)", registry=self.registry
        )
        self.engine_healthy = Gauge(
            "node_agent_engine_healthy",
            "1 when the inference engine answered its last probe healthy, else 0",
            ["kind", "url"],
            registry=self.registry,
        )
        self.gpu_temperature = Gauge(
            "node_agent_gpu_temperature_celsius",
            "GPU temperature",
            ["gpu", "uuid"],
            registry=self.registry,
        )
        self.gpu_utilization = Gauge(
            "node_agent_gpu_utilization_percent",
            "GPU utilization",
            ["gpu", "uuid"],
            registry=self.registry,
        )
        self.gpu_memory_used = Gauge(
            "node_agent_gpu_memory_used_bytes",
            "GPU memory in use",
            ["gpu", "uuid"],
            registry=self.registry,
        )

    def observe_gpus(self, gpus: list[Gpu]) -> None:
        """Replace every per-GPU series, so a GPU that vanished stops being exported."""
        gauges = (self.gpu_temperature, self.gpu_utilization, self.gpu_memory_used)
        for gauge in gauges:
            gauge.clear()
        for gpu in gpus:
            labels = (str(gpu.index), gpu.uuid)
            if gpu.temperature_c is not None:
                self.gpu_temperature.labels(*labels).set(gpu.temperature_c)
            if gpu.utilization_pct is not None:
                self.gpu_utilization.labels(*labels).set(gpu.utilization_pct)
            self.gpu_memory_used.labels(*labels).set(gpu.memory_used)

    def observe_health(self, health: Health) -> None:
        self.health_score.set(health.score)

    def observe_engine(self, engine: Engine) -> None:
        self.engine_healthy.clear()
        for status in engine.engines:
            self.engine_healthy.labels(status.kind, status.url).set(1 if status.healthy else 0)

    def value(self, name: str) -> float | None:
        """The current value of an unlabelled sample, e.g. ``node_agent_sequence_number``."""
        return self.registry.get_sample_value(name)
