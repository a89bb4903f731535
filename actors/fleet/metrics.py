"""The aggregator's Prometheus metrics, in a registry of its own so an aggregator can share a
process with agents (``fleetctl up``): its own counters, and the fleet as series, one
set per node it holds (:func:`node_series`)."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterable
from functools import partial

from prometheus_client import CollectorRegistry, Counter, Gauge

from actors.runtime.consumer import LOOP_DROP_REASONS
from actors.runtime.prometheus import standard_series
from schemas.messages import REFUSALS, NodeRecord

DROP_REASONS = (
    *LOOP_DROP_REASONS,
    "malformed_subject",
    "late_delivery",
    "forged_marker",
    "registration_rejected",
)
"""Every reason the aggregator counts a dropped message under: each is exported at 0 from
the start, so ``increase()`` and ``rate()`` see the first drop."""
NODE_FAMILIES = (
    (
        "fleet_node_state",
        "1 for the node's state in fleet_nodes, by node, cluster and state",
    ),
    (
        "fleet_node_health_score",
        "The node's last reported health score (0-100); absent before its first report",
    ),
    ("fleet_node_gpus", "GPUs the node reported in its last heartbeat"),
    (
        "fleet_node_last_heartbeat_timestamp_seconds",
        "When the node's last accepted heartbeat was stored (Unix time); its age is time() - this",
    ),
)


def _label(value: str) -> str:
    """``value`` escaped for the text exposition format."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def node_series(records: Iterable[NodeRecord]) -> bytes:
    """The nodes this aggregator holds as Prometheus text: ``fleet_node_state{node,
    cluster,state} 1`` (one series a node: a state change ends one series and starts
    another, as kube-state-metrics' phase series do), its health score, GPUs and last
    heartbeat time. Only the holder of a node's partition exports it, so a fleet's
    aggregators together export each node once. Written here rather than through
    prometheus_client's collectors, which format a sample in about 8 µs: at 100,000
    nodes that is 3 s of the aggregator's loop per scrape; this takes about a tenth
    (docs/metrics.md has the figures)."""
    state: list[str] = []
    score: list[str] = []
    gpus: list[str] = []
    seen: list[str] = []
    for record in records:
        labels = f'node="{_label(record.node_id)}",cluster="{_label(record.cluster)}"'
        state.append(f'fleet_node_state{{{labels},state="{_label(record.state)}"}} 1\n')
        if record.health_score is not None:
            score.append(f"fleet_node_health_score{{{labels}}} {record.health_score}\n")
        gpus.append(f"fleet_node_gpus{{{labels}}} {record.gpus_total}\n")
        stored = record.last_stored or record.last_seen
        seen.append(f"fleet_node_last_heartbeat_timestamp_seconds{{{labels}}} {stored!r}\n")
    parts: list[str] = []
    for (name, text), lines in zip(NODE_FAMILIES, (state, score, gpus, seen), strict=True):
        parts.append(f"# HELP {name} {text}\n# TYPE {name} gauge\n")
        parts.extend(lines)
    return "".join(parts).encode()


class AggregatorMetrics:
    """Counters the aggregator keeps and the fleet HTTP actor serves."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        standard_series(self.registry, "fleet_aggregator")
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
        for reason in DROP_REASONS:
            self.dropped.labels(reason)
        for kind in sorted(REFUSALS):
            self.refused.labels(kind)
        self.markers = Counter(
            "fleet_ttl_markers",
            "TTL delete markers taken as the server's (the others count as forged_marker)",
            registry=self.registry,
        )
        self.retired = Counter(
            "fleet_nodes_retired",
            "Nodes this aggregator forgot for being offline longer than retire_offline_after",
            registry=self.registry,
        )
        self.records_unreadable = Counter(
            "fleet_records_unreadable",
            "Records in fleet_nodes skipped because they could not be decoded",
            registry=self.registry,
        )
        self.nodes = Gauge(
            "fleet_nodes",
            "Nodes in fleet_nodes by state, every state listed",
            ["state"],
            registry=self.registry,
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
        self.partitions = Gauge(
            "fleet_partitions",
            "Partitions FLEET_HB is split into (each aggregator says; compare with "
            "count(fleet_aggregator_owner == 1) to find partitions nobody consumes)",
            registry=self.registry,
        )
        self.owner = Gauge(
            "fleet_aggregator_owner",
            "1 while this aggregator holds a partition's lease and consumes it (by partition)",
            ["partition"],
            registry=self.registry,
        )
        self._newest: dict[str, float] = {}
        """Per partition: when FLEET_HB stored the newest heartbeat processed."""
        self._pending: dict[str, int] = {}
        self.lag = Gauge(
            "fleet_aggregator_lag_seconds",
            "Seconds since FLEET_HB stored the newest heartbeat this aggregator processed, "
            "by partition; about one heartbeat interval when it keeps up",
            ["partition"],
            registry=self.registry,
        )
        self.behind = Gauge(
            "fleet_aggregator_pending_heartbeats",
            "Heartbeats in FLEET_HB not yet delivered to the partition's consumer, as of "
            "the last one this aggregator processed, by partition",
            ["partition"],
            registry=self.registry,
        )
        self.oldest = Gauge(
            "fleet_aggregator_oldest_unprocessed_seconds",
            "Age of the oldest heartbeat of the partition this aggregator has not processed "
            "yet (bounded above by the time since the newest processed one was stored; 0 "
            "when nothing is pending), by partition",
            ["partition"],
            registry=self.registry,
        )
        self.breaker = Gauge(
            "fleet_policy_breaker_tripped",
            "1 while the remediation policy's circuit breaker of the cluster is tripped "
            "(only fleetctl policy reset closes it), else 0; by cluster",
            ["cluster"],
            registry=self.registry,
        )
        self.policy_holds = Gauge(
            "fleet_policy_held_nodes",
            "Nodes the remediation policy holds cordoned or drained, by cluster",
            ["cluster"],
            registry=self.registry,
        )
        self.policy_limit = Gauge(
            "fleet_policy_hold_limit",
            "Nodes the breaker lets the policy hold at once (the smaller of its absolute "
            "and percentage caps), by cluster",
            ["cluster"],
            registry=self.registry,
        )
        self.workload_replicas = Gauge(
            "fleet_workload_replicas",
            "Replicas of each placed workload the reconciler keeps, by state: placed (on a "
            "node) or pending (no node fits); rewritten each round",
            ["workload", "state"],
            registry=self.registry,
        )
        self.workload_commands = Counter(
            "fleet_workload_commands",
            "Deploys and stops the workload reconciler sent after writing its decision, by kind",
            ["kind"],
            registry=self.registry,
        )
        self.workload_untrusted = Gauge(
            "fleet_workload_untrusted",
            "Placed workloads the reconciler leaves alone: not signed by an operator it "
            "trusts, or changed since signed",
            registry=self.registry,
        )
        self.am_sent = Counter(
            "fleet_alertmanager_sent",
            "Alerts Alertmanager accepted, by Alertmanager URL",
            ["url"],
            registry=self.registry,
        )
        self.am_errors = Counter(
            "fleet_alertmanager_errors",
            "POSTs to Alertmanager that failed (unreachable, 5xx) and are retried, by URL",
            ["url"],
            registry=self.registry,
        )
        self.am_dropped = Counter(
            "fleet_alertmanager_dropped",
            "Alerts never delivered to Alertmanager, by reason (queue_full, rejected: 4xx; "
            "handler_error, transient_error: an unreadable FLEET_ALERTS message)",
            ["reason"],
            registry=self.registry,
        )
        for reason in ("queue_full", "rejected", *LOOP_DROP_REASONS):
            self.am_dropped.labels(reason)
        self.am_suppressed = Counter(
            "fleet_alertmanager_suppressed",
            "Alerts not forwarded on purpose, by reason (maintenance: the node is in a window)",
            ["reason"],
            registry=self.registry,
        )
        self.am_suppressed.labels("maintenance")
        self.am_queued = Gauge(
            "fleet_alertmanager_queue_length",
            "Alerts waiting to be sent to Alertmanager, by URL",
            ["url"],
            registry=self.registry,
        )

    @property
    def newest_stored(self) -> float | None:
        """When FLEET_HB stored the newest heartbeat this aggregator processed (any
        partition)."""
        return max(self._newest.values(), default=None)

    @property
    def pending_now(self) -> int:
        """Heartbeats pending in every partition this aggregator consumes."""
        return sum(self._pending.values())

    def oldest_unprocessed(self, partition: int | None = None) -> float:
        """Seconds the oldest unprocessed heartbeat of ``partition`` (None: of any) has
        waited, at most (0: none)."""
        names = list(self._pending) if partition is None else [str(partition)]
        return max((self._oldest(name) for name in names), default=0.0)

    def _oldest(self, name: str) -> float:
        newest = self._newest.get(name)
        if not self._pending.get(name) or newest is None:
            return 0.0
        return max(0.0, time.time() - newest)

    def _lag(self, name: str) -> float:
        newest = self._newest.get(name)
        return math.nan if newest is None else time.time() - newest

    def processed(self, stored: float, pending: int, partition: int = 0) -> None:
        """A message of partition ``partition`` of FLEET_HB, stored at ``stored``, was
        processed, ``pending`` behind it."""
        name = str(partition)
        if name not in self._newest:
            self.lag.labels(name).set_function(partial(self._lag, name))
            self.oldest.labels(name).set_function(partial(self._oldest, name))
            self._newest[name] = stored
        elif stored > self._newest[name]:
            self._newest[name] = stored
        self.behind.labels(name).set(pending)
        self._pending[name] = pending

    def owns(self, partition: int) -> None:
        self.owner.labels(str(partition)).set(1)

    def forget(self, partition: int) -> None:
        """A partition this aggregator no longer consumes: its series go (another
        aggregator reports it now)."""
        name = str(partition)
        self._newest.pop(name, None)
        self._pending.pop(name, None)
        for gauge in (self.owner, self.lag, self.behind, self.oldest):
            with contextlib.suppress(KeyError):
                gauge.remove(name)
