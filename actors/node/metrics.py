"""The node agent's Prometheus metrics, in a registry of its own so several agents can share
a process (``fleetctl up``).

Names follow the conventions dcgm-exporter and node_exporter users know: base units in
the name (``_celsius``, ``_bytes``, ``_watts``), ``_total`` on counters, and a state as a
labelled 0/1 series per possible value (``node_agent_health_check{check,status}``), so
an alert is ``== 1`` on the bad value. Every series is listed in the README.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Iterator
from typing import get_args

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from actors.runtime.consumer import LOOP_DROP_REASONS
from actors.runtime.prometheus import standard_series
from schemas.base import CheckStatus, HealthStatus, Schedulability
from schemas.events import Engine, Gpu, Health
from schemas.messages import Heartbeat

HEALTH_STATUSES: tuple[HealthStatus, ...] = get_args(HealthStatus)
CHECK_STATUSES: tuple[CheckStatus, ...] = get_args(CheckStatus)
SCHEDULABILITIES: tuple[Schedulability, ...] = get_args(Schedulability)
GPU_LABELS = ["gpu", "uuid"]


def reading(value: float | None, lost: bool) -> float:
    """A GPU reading as exported: NaN when the device cannot give it (lost, or the driver
    does not say), so the series stays but never shows a made-up 0."""
    return math.nan if value is None or lost else float(value)


class GpuCollector(Collector):
    """Every per-GPU series, built from the latest inventory sample at each scrape: a GPU
    that vanished from the sample stops being exported, a lost one keeps its series (NaN
    readings, ``node_agent_gpu_lost 1``) and its XID and ECC counts."""

    def __init__(self) -> None:
        self.gpus: list[Gpu] = []

    def collect(self) -> Iterator[Metric]:
        def gauge(name: str, text: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, text, labels=GPU_LABELS)

        temperature = gauge(
            "node_agent_gpu_temperature_celsius", "GPU temperature in degrees C (NaN: no reading)"
        )
        utilization = gauge(
            "node_agent_gpu_utilization_percent", "GPU utilization in percent (NaN: no reading)"
        )
        used = gauge(
            "node_agent_gpu_memory_used_bytes", "GPU memory in use (NaN once the GPU is lost)"
        )
        total = gauge("node_agent_gpu_memory_total_bytes", "GPU memory in all")
        power = gauge("node_agent_gpu_power_watts", "GPU power draw (NaN: no reading)")
        limit = gauge("node_agent_gpu_power_limit_watts", "GPU power limit (NaN: no reading)")
        lost = gauge("node_agent_gpu_lost", "1 once the GPU stopped answering, else 0")
        ecc = CounterMetricFamily(
            "node_agent_gpu_ecc_errors",
            "ECC errors the driver counted, by type (corrected, uncorrected); absent when "
            "the GPU does not say",
            labels=[*GPU_LABELS, "type"],
        )
        xids = CounterMetricFamily(
            "node_agent_gpu_xid_errors",
            "XID errors seen since the agent started, by code",
            labels=[*GPU_LABELS, "xid"],
        )
        for gpu in self.gpus:
            labels = [str(gpu.index), gpu.uuid]
            temperature.add_metric(labels, reading(gpu.temperature_c, gpu.lost))
            utilization.add_metric(labels, reading(gpu.utilization_pct, gpu.lost))
            used.add_metric(labels, reading(gpu.memory_used, gpu.lost))
            total.add_metric(labels, float(gpu.memory_total))
            power.add_metric(labels, reading(gpu.power_w, gpu.lost))
            limit.add_metric(labels, reading(gpu.power_limit_w, gpu.lost))
            lost.add_metric(labels, 1.0 if gpu.lost else 0.0)
            for kind, count in (
                ("corrected", gpu.ecc_corrected),
                ("uncorrected", gpu.ecc_uncorrected),
            ):
                if count is not None:
                    ecc.add_metric([*labels, kind], float(count))
            for xid in gpu.xids:
                xids.add_metric([*labels, str(xid.code)], float(xid.count))
        yield from (temperature, utilization, used, total, power, limit, lost, ecc, xids)


def one_hot(gauge: Gauge, values: Iterable[str], current: str, *labels: str) -> None:
    """Set ``gauge{labels, value}`` to 1 for ``current`` and 0 for every other value."""
    for value in values:
        gauge.labels(*labels, value).set(1 if value == current else 0)


GATEWAY_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
"""Seconds: a short completion takes a fraction of a second, a long generation minutes."""


class GatewayMetrics:
    """The gateway's series, per model (a model the node does not serve is labelled
    ``unknown``, so a client cannot grow the label set)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "node_agent_gateway_requests",
            "Requests the gateway answered, by model and HTTP status code",
            ["model", "code"],
            registry=registry,
        )
        self.queue_depth = Gauge(
            "node_agent_gateway_queue_depth",
            "Requests waiting for a busy workload, by model",
            ["model"],
            registry=registry,
        )
        self.in_flight = Gauge(
            "node_agent_gateway_in_flight",
            "Requests a workload is answering through the gateway, by model",
            ["model"],
            registry=registry,
        )
        self.latency = Histogram(
            "node_agent_gateway_request_duration_seconds",
            "Seconds from a request's arrival to the end of its answer (a stream's last "
            "chunk), by model",
            ["model"],
            buckets=GATEWAY_LATENCY_BUCKETS,
            registry=registry,
        )


class AgentMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        standard_series(self.registry, "node_agent")
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
            "Messages on the node's event subjects (and its own heartbeat's, which the command "
            "executor reads) that node actors refused, by reason (see docs/node.md); each "
            "message counted once, under the first actor it reached",
            ["actor", "reason"],
            registry=self.registry,
        )
        self.settings_ignored = Counter(
            "node_agent_settings_ignored",
            "Entries of KV fleet_settings the node ignored, by reason (unsigned, bad_signature, "
            "untrusted_key, node_key, malformed, misplaced, replayed); each stored message "
            "counted once",
            ["reason"],
            registry=self.registry,
        )
        self.settings_revision = Gauge(
            "node_agent_settings_revision",
            "The highest revision of the fleet settings entries that reach this node (0: none)",
            registry=self.registry,
        )
        self.settings_refused = Gauge(
            "node_agent_settings_refused",
            "Keys of the fleet's settings this node refuses (heartbeat settings.refused says why)",
            registry=self.registry,
        )
        self.settings_restart = Gauge(
            "node_agent_settings_restart_pending",
            "Fleet settings that take effect at the agent's next start",
            registry=self.registry,
        )
        self.uptime = Gauge(
            "node_agent_uptime_seconds", "Seconds since the agent started", registry=self.registry
        )
        self.uptime.set_function(lambda: time.time() - self.started)
        self.health_score = Gauge(
            "node_agent_health_score",
            "Latest health score (0-100); capped into the status's band (< 50 unhealthy, "
            "< 80 degraded)",
            registry=self.registry,
        )
        self.health_status = Gauge(
            "node_agent_health_status",
            "1 for the node's latest health status, 0 for the others",
            ["status"],
            registry=self.registry,
        )
        self.health_check = Gauge(
            "node_agent_health_check",
            "1 for each hard check's latest status, 0 for its other statuses",
            ["check", "status"],
            registry=self.registry,
        )
        self.health_component = Gauge(
            "node_agent_health_component_points",
            "Points each score component earned (out of its maximum)",
            ["component"],
            registry=self.registry,
        )
        self.engine_healthy = Gauge(
            "node_agent_engine_healthy",
            "1 when the inference engine answered its last probe healthy, else 0",
            ["kind", "url"],
            registry=self.registry,
        )
        # The seed agent's name for the same fact, kept so existing dashboards keep working.
        self.vllm_healthy = Gauge(
            "node_agent_vllm_healthy",
            "Alias of node_agent_engine_healthy for vLLM engines: 1 when healthy, else 0",
            ["url"],
            registry=self.registry,
        )
        self.schedulability = Gauge(
            "node_agent_schedulability",
            "1 for the schedulability the last heartbeat reported, 0 for the others",
            ["schedulability"],
            registry=self.registry,
        )
        self.spot_notice = Gauge(
            "node_agent_spot_notice",
            "1 while the last heartbeat carries a cloud interruption notice",
            ["provider", "kind"],
            registry=self.registry,
        )
        self.spot_deadline = Gauge(
            "node_agent_spot_notice_deadline_timestamp_seconds",
            "When the provider will act on the notice (Unix time), when it says",
            ["provider", "kind"],
            registry=self.registry,
        )
        for reason in LOOP_DROP_REASONS:
            self.dropped.labels(reason)
        self.gpus = GpuCollector()
        self.registry.register(self.gpus)
        self.gateway = GatewayMetrics(self.registry)

    def identify(self, node: str, cluster: str) -> None:
        """``node_agent_node_info{node,cluster} 1``: joins this agent's series (labelled
        by the scrape's ``instance``) to the aggregator's ``fleet_node_*{node}`` ones."""
        Gauge(
            "node_agent_node_info",
            "1, labelled with the node's id and cluster",
            ["node", "cluster"],
            registry=self.registry,
        ).labels(node, cluster).set(1)

    def observe_gpus(self, gpus: list[Gpu]) -> None:
        """The GPUs of the latest sample replace the previous ones at once."""
        self.gpus.gpus = list(gpus)

    def observe_health(self, health: Health) -> None:
        self.health_score.set(health.score)
        one_hot(self.health_status, HEALTH_STATUSES, health.status)
        self.health_check.clear()
        for check in health.checks:
            one_hot(self.health_check, CHECK_STATUSES, check.status, check.name)
        self.health_component.clear()
        for component in health.components:
            self.health_component.labels(component.name).set(component.points)

    def observe_engine(self, engine: Engine) -> None:
        self.engine_healthy.clear()
        self.vllm_healthy.clear()
        for status in engine.engines:
            self.engine_healthy.labels(status.kind, status.url).set(1 if status.healthy else 0)
            if status.kind == "vllm":
                self.vllm_healthy.labels(status.url).set(1 if status.healthy else 0)

    def observe_heartbeat(self, heartbeat: Heartbeat) -> None:
        """Schedulability and the spot notice, as the fleet is told them."""
        one_hot(self.schedulability, SCHEDULABILITIES, heartbeat.schedulability)
        self.spot_notice.clear()
        self.spot_deadline.clear()
        notice = heartbeat.spot.notice if heartbeat.spot else None
        if notice is not None:
            self.spot_notice.labels(notice.provider, notice.kind).set(1)
            if notice.deadline is not None:
                self.spot_deadline.labels(notice.provider, notice.kind).set(notice.deadline)

    def value(self, name: str, labels: dict[str, str] | None = None) -> float | None:
        """The current value of a sample, e.g. ``node_agent_sequence_number``."""
        return self.registry.get_sample_value(name, labels)
