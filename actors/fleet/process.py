"""The provider side's actors as one process runs them (``fleetctl aggregator`` and
``fleetctl up``): the aggregator, the signed-request services beside it, the state index
it keeps (:mod:`actors.fleet.live.state_index`), the live feed its readers share, its
HTTP API and, when configured, the Alertmanager forwarder, the remediation policy and the
workload reconciler, under one supervisor."""

from __future__ import annotations

from pathlib import Path

from actors.fleet.aggregator.actor import AggregatorActor
from actors.fleet.alerts.alertmanager import AlertmanagerActor
from actors.fleet.config import AggregatorConfig
from actors.fleet.live.feed import NodeFeed
from actors.fleet.live.state_index import Ownership, StateIndexActor
from actors.fleet.metrics import AggregatorMetrics
from actors.fleet.operator.forget import ForgetActor
from actors.fleet.operator.maintenance import MaintenanceActor
from actors.fleet.operator.policy_requests import PolicyRequestsActor
from actors.fleet.placement.actor import ReconcilerActor
from actors.fleet.placement.reconcile import Timing
from actors.fleet.remediation.actor import RemediationActor
from actors.fleet.remediation.config import PolicyConfig
from actors.fleet.storage.windows import MaintenanceWindows
from actors.fleet.views.api import FleetApiActor
from actors.fleet.views.dashboard.actor import DashboardActor
from actors.fleet.views.dashboard.held_nodes import HeldNodes
from actors.runtime.bus import Bus
from actors.runtime.config import ConfigError
from actors.runtime.supervisor import Actor, Supervisor
from schemas import signing
from schemas.messages import NodeRecord
from schemas.subjects import Subjects


class ProviderActors:
    """The actors of one aggregator process and the supervisor that runs them: the
    aggregator first, the others once it is ready. The aggregator provisions the fleet's
    streams and buckets before it says so, and the others read them as they start (the
    reconciler its bucket, the dashboard and the Alertmanager forwarder FLEET_ALERTS, the
    HTTP API fleet_nodes): started together on a fresh server, each crashed once."""

    def __init__(
        self,
        config: AggregatorConfig,
        bus: Bus,
        metrics: AggregatorMetrics,
        policy: PolicyConfig | None = None,
    ) -> None:
        self.aggregator = AggregatorActor(config, bus, metrics)
        subjects = Subjects(config.prefix)
        self.feed = NodeFeed(bus, subjects, self.aggregator.view, metrics, config.lease_ttl)
        """The nodes' records every reader of this process shares (one watch, one copy)."""
        actors: list[Actor] = [
            StateIndexActor(bus, subjects, self.aggregator.view, held_partitions(self.aggregator)),
            ForgetActor(config, bus),
            MaintenanceActor(config, bus),
            PolicyRequestsActor(config, bus),
        ]
        readers = config.http_port >= 0 or config.workloads_key_file or config.alertmanager_urls
        if policy is not None or readers:
            actors.append(self.feed)
        if policy is not None:
            actors.append(RemediationActor(policy, bus, config.prefix, metrics, self.feed))
        if config.workloads_key_file:
            timing = Timing(grace=config.workloads_grace, handoff=config.workloads_handoff)
            actors.append(
                ReconcilerActor(
                    bus,
                    config.prefix,
                    config.workloads_key_file,
                    config.workloads_interval,
                    timing,
                    config.workloads_operators,
                    metrics,
                    self.feed,
                )
            )
        self.http: FleetApiActor | None = None
        if config.http_port >= 0:
            # /healthz asks the supervisor, made below, once serving; /nodes answers from
            # the aggregator's live records.
            self.http = FleetApiActor(
                config,
                bus,
                metrics,
                lambda: self.supervisor.check(),
                self.aggregator.view,
                feed=self.feed,
            )
            actors.append(self.http)
            if config.dashboard:
                key = None
                if config.allow_ui_commands:
                    if not config.ui_key_file:
                        raise ConfigError("allow_ui_commands needs ui_key_file (an operator key)")
                    key = signing.load_key_file(Path(config.ui_key_file))
                dashboard = DashboardActor(
                    config, bus, self.http, HeldNodes(self.aggregator.view), key
                )
                self.http.routes = dashboard.routes
                actors.append(dashboard)
        if config.alertmanager_urls:
            windows = MaintenanceWindows(bus, subjects)
            actors.append(
                AlertmanagerActor(
                    config,
                    bus,
                    metrics,
                    self.held,
                    windows,
                    self.feed.record,
                    changes=self.aggregator.view,
                )
            )
        self.supervisor = Supervisor([self.aggregator], then=actors)

    def held(self) -> list[NodeRecord]:
        """The records of the nodes the aggregator holds now."""
        return [record for _, record in self.aggregator.view.items()]


def held_partitions(aggregator: AggregatorActor) -> Ownership:
    """What the state index asks of ``aggregator``: its partition count, the partitions it
    holds now and its holder id ("" before it has leases)."""

    def now() -> tuple[int, list[int], str]:
        ownership = aggregator.ownership
        count, leases = ownership.partition_count, ownership.partitions
        if leases is None:
            return count, [], ""
        return count, [p for p in range(count) if leases.holds(p)], leases.holder

    return now
