"""Builds ``deploy/grafana/fleet.json``, the fleet's Grafana dashboard, with Grafana's own
Python SDK (``grafana-foundation-sdk``, types generated from Grafana's dashboard schema),
so the file is a dashboard Grafana's schema knows field for field.

``python -m tests.support.grafana_dashboard`` rewrites the file;
``tests/system/test_grafana.py`` fails while it differs from what this module builds, and
checks that every panel's query names series node-agent or the aggregator export.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from grafana_foundation_sdk.builders import dashboard, heatmap, prometheus, stat, table, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import DataSourceRef, VariableRefresh

PATH = Path(__file__).parents[2] / "deploy" / "grafana" / "fleet.json"
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
NODE_INFO = "on(instance) group_left(node, cluster) node_agent_node_info"
"""Joins an agent's series (labelled by instance) to its node and cluster."""


def query(expr: str, legend: str = "", ref: str = "A") -> prometheus.Dataquery:
    built = prometheus.Dataquery().expr(expr).ref_id(ref)
    return built.legend_format(legend) if legend else built


def build() -> dict[str, object]:
    """The dashboard as Grafana's JSON model."""
    board = (
        dashboard.Dashboard("GPU fleet")
        .uid("nats-node-agent-fleet")
        .tags(["gpu", "fleet", "nats-node-agent"])
        .description(
            "Nodes by state and cluster, unhealthy nodes and why, GPU temperature, "
            "utilisation and power, XIDs, and the aggregators' lag and CPU per heartbeat."
        )
        .time("now-6h", "now")
        .refresh("30s")
        .with_variable(
            dashboard.DatasourceVariable("datasource").label("Prometheus").type("prometheus")
        )
        .with_variable(
            dashboard.QueryVariable("cluster")
            .label("Cluster")
            .datasource(DATASOURCE)
            .query("label_values(fleet_node_state, cluster)")
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
            .include_all(True)
            .multi(True)
        )
        .with_row(dashboard.Row("Fleet").id(13))
        .with_panel(
            stat.Panel()
            .id(1)
            .title("Nodes by state")
            .datasource(DATASOURCE)
            .with_target(
                query('sum by (state) (fleet_node_state{cluster=~"$cluster"})', "{{state}}")
            )
            .height(6)
            .span(8)
        )
        .with_panel(
            timeseries.Panel()
            .id(2)
            .title("Nodes by cluster and state")
            .datasource(DATASOURCE)
            .with_target(
                query(
                    'sum by (cluster, state) (fleet_node_state{cluster=~"$cluster"})',
                    "{{cluster}} {{state}}",
                )
            )
            .height(6)
            .span(16)
        )
        .with_panel(
            table.Panel()
            .id(3)
            .title("Unhealthy, stale and offline nodes")
            .datasource(DATASOURCE)
            .with_target(
                query(
                    'fleet_node_state{state=~"unhealthy|degraded|stale|offline",'
                    'cluster=~"$cluster"} == 1'
                ).instant()
            )
            .height(8)
            .span(12)
        )
        .with_panel(
            table.Panel()
            .id(4)
            .title("Why: failing health checks")
            .description("Every hard check of every agent that is not passing, by node.")
            .datasource(DATASOURCE)
            .with_target(
                query(f'(node_agent_health_check{{status!="pass"}} == 1) * {NODE_INFO}').instant()
            )
            .height(8)
            .span(12)
        )
        .with_row(dashboard.Row("GPUs").id(14))
        .with_panel(
            heatmap.Panel()
            .id(5)
            .title("GPU temperature")
            .datasource(DATASOURCE)
            .with_target(query(f"node_agent_gpu_temperature_celsius * {NODE_INFO}"))
            .unit("celsius")
            .height(8)
            .span(8)
        )
        .with_panel(
            heatmap.Panel()
            .id(6)
            .title("GPU utilisation")
            .datasource(DATASOURCE)
            .with_target(query(f"node_agent_gpu_utilization_percent * {NODE_INFO}"))
            .unit("percent")
            .height(8)
            .span(8)
        )
        .with_panel(
            heatmap.Panel()
            .id(7)
            .title("GPU power")
            .datasource(DATASOURCE)
            .with_target(query(f"node_agent_gpu_power_watts * {NODE_INFO}"))
            .unit("watt")
            .height(8)
            .span(8)
        )
        .with_panel(
            timeseries.Panel()
            .id(8)
            .title("XIDs per hour, by code")
            .datasource(DATASOURCE)
            .with_target(
                query("sum by (xid) (increase(node_agent_gpu_xid_errors_total[1h]))", "XID {{xid}}")
            )
            .height(8)
            .span(12)
        )
        .with_panel(
            table.Panel()
            .id(9)
            .title("Lost GPUs")
            .datasource(DATASOURCE)
            .with_target(query(f"(node_agent_gpu_lost == 1) * {NODE_INFO}").instant())
            .height(8)
            .span(12)
        )
        .with_row(dashboard.Row("Aggregators").id(15))
        .with_panel(
            timeseries.Panel()
            .id(10)
            .title("Oldest unprocessed heartbeat, by partition")
            .datasource(DATASOURCE)
            .with_target(
                query("fleet_aggregator_oldest_unprocessed_seconds", "{{instance}} p{{partition}}")
            )
            .unit("s")
            .height(8)
            .span(8)
        )
        .with_panel(
            timeseries.Panel()
            .id(11)
            .title("Aggregator CPU per accepted heartbeat")
            .datasource(DATASOURCE)
            .with_target(
                query(
                    'rate(process_cpu_seconds_total{job="fleet-aggregator"}[5m]) '
                    "/ rate(fleet_heartbeats_accepted_total[5m])",
                    "{{instance}}",
                )
            )
            .unit("s")
            .height(8)
            .span(8)
        )
        .with_panel(
            timeseries.Panel()
            .id(12)
            .title("Heartbeats accepted and refused")
            .datasource(DATASOURCE)
            .with_target(query("sum(rate(fleet_heartbeats_accepted_total[5m]))", "accepted"))
            .with_target(
                query("sum by (kind) (rate(fleet_heartbeats_refused_total[5m]))", "{{kind}}", "B")
            )
            .unit("reqps")
            .height(8)
            .span(8)
        )
    )
    encoded: dict[str, object] = json.loads(json.dumps(board.build(), cls=JSONEncoder))
    return encoded


def text() -> str:
    return json.dumps(build(), indent=2, sort_keys=True) + "\n"


def main() -> None:
    PATH.parent.mkdir(parents=True, exist_ok=True)
    PATH.write_text(text())
    sys.stdout.write(f"wrote {PATH}\n")


if __name__ == "__main__":
    main()
