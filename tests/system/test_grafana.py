"""deploy/grafana/fleet.json is a dashboard Grafana's schema knows field for field, is what
its generator builds, and every panel queries series node-agent or the aggregator export."""

from __future__ import annotations

import json
import re
from typing import Any

from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import Dashboard
from prometheus_client.parser import text_string_to_metric_families

from actors.fleet.metrics import AggregatorMetrics, node_series
from actors.node.metrics import AgentMetrics
from schemas.events import Gpu
from schemas.messages import NodeRecord
from tests.support import grafana_dashboard

OURS = re.compile(r"\b(?:node_agent|fleet|process)_[a-z_]+\b")


def shipped() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(grafana_dashboard.PATH.read_text())
    return data


def exported() -> set[str]:
    """Every series name an agent (with a GPU) and an aggregator (holding a node) export."""
    agent = AgentMetrics()
    agent.identify("n1", "c1")
    agent.observe_gpus(
        [Gpu(index=0, uuid="GPU-1", name="H100", pci_bus_id="0", memory_total=1, memory_used=0)]
    )
    holding = NodeRecord(node_id="n1", cluster="c1", state="active", last_seq=1, last_seen=1.0)
    per_node = text_string_to_metric_families(node_series([holding]).decode())
    names = set()
    for family in [
        *agent.registry.collect(),
        *AggregatorMetrics().registry.collect(),
        *per_node,
    ]:
        names.add(family.name)
        names.update(sample.name for sample in family.samples)
        if family.type == "counter":
            names.add(f"{family.name}_total")
    return names


def test_the_dashboard_is_what_its_generator_builds() -> None:
    """The shipped file equals the generator's output (`python -m
    tests.support.grafana_dashboard` rewrites it)."""
    assert grafana_dashboard.PATH.read_text() == grafana_dashboard.text()


def test_the_dashboard_round_trips_through_grafanas_schema_types() -> None:
    """Decoded by Grafana's schema types and encoded again, the dashboard is unchanged: no
    field the schema does not know (it would be dropped)."""
    data = shipped()
    back = json.loads(json.dumps(Dashboard.from_json(data), cls=JSONEncoder))
    assert back == data


def test_every_panel_queries_series_the_programs_export() -> None:
    """Each panel has a query, and every series name of ours in it is exported."""
    names = exported()
    panels = [panel for panel in shipped()["panels"] if panel["type"] != "row"]
    assert len(panels) >= 10
    for panel in panels:
        exprs = [target["expr"] for target in panel["targets"]]
        assert exprs, panel["title"]
        for expr in exprs:
            used = set(OURS.findall(expr))
            assert used, f"{panel['title']}: {expr} names none of our series"
            assert used <= names, f"{panel['title']}: {sorted(used - names)} not exported"
