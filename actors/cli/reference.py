"""The reference tables of docs/ written from the code: every setting of the agent, the
aggregator and fleetctl (docs/settings.md, from the settings Structs' docstrings and
defaults), the settings the fleet may set on its nodes (from the node's table of them)
and every metric series (docs/metrics.md, from the registries' own names,
types, labels and help). ``python -m actors.cli.reference`` rewrites them; a test fails
when the files and the code disagree.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import msgspec
from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.parser import text_string_to_metric_families

from actors.cli.common import CLIENT_ENV_PREFIX, ClientConfig, flag_name
from actors.fleet.config import ENV_PREFIX as AGGREGATOR_ENV_PREFIX
from actors.fleet.config import AggregatorConfig
from actors.fleet.metrics import AggregatorMetrics, node_series
from actors.node.config import ENV_PREFIX as AGENT_ENV_PREFIX
from actors.node.config import AgentConfig
from actors.node.metrics import AgentMetrics
from actors.node.settings.table import FLEET_SETTABLE, FLOORS, ITEMIZED
from actors.runtime.config import list_fields
from actors.runtime.config_docs import default_text, setting_docs
from schemas.messages import NodeRecord

DOCS = Path(__file__).parents[2] / "docs"
SETTINGS_DOC = DOCS / "settings.md"
METRICS_DOC = DOCS / "metrics.md"

SETTINGS: tuple[tuple[str, str, type[msgspec.Struct], str], ...] = (
    ("node-agent", "`node-agent start` and `register`", AgentConfig, AGENT_ENV_PREFIX),
    ("aggregator", "`fleetctl aggregator`", AggregatorConfig, AGGREGATOR_ENV_PREFIX),
    ("fleetctl", "every `fleetctl` command that connects", ClientConfig, CLIENT_ENV_PREFIX),
)
"""Each settings Struct: its marker name, who reads it, the Struct, its variables' prefix."""


def _cell(text: str) -> str:
    """``text`` safe in a Markdown table cell: ``|`` escaped everywhere, and outside
    `code` spans the ``<`` and ``*`` that would start a tag or emphasis."""
    parts = text.replace("|", "\\|").split("`")
    for index in range(0, len(parts), 2):
        parts[index] = parts[index].replace("<", "&lt;").replace("*", "\\*")
    return "`".join(parts)


def settings_table(config_type: type[msgspec.Struct], env_prefix: str) -> str:
    """One row per setting: TOML key, flag, variable, default and the whole docstring."""
    docs = setting_docs(config_type)
    lists = list_fields(config_type)
    lines = ["| setting | flag | env | default | meaning |", "|---|---|---|---|---|"]
    for field in msgspec.structs.fields(config_type):
        flag = flag_name(field.name)
        if field.name in lists:
            flag += " (repeatable)"
        default = default_text(config_type, field.name)
        default_cell = _cell(default) if " " in default else f"`{_cell(default)}`"
        lines.append(
            f"| `{field.name}` | `{flag}` | `{env_prefix}{field.name.upper()}` "
            f"| {default_cell} | {_cell(docs.get(field.name, ''))} |"
        )
    return "\n".join(lines) + "\n"


Series = tuple[str, str, list[str], str]
"""A metric family: name, type, label names, help."""
STANDARD = (ProcessCollector, PlatformCollector)
"""Collectors of every program's standard series (:mod:`actors.runtime.prometheus`),
listed once for both programs."""


def _series(registry: CollectorRegistry, standard: bool = False) -> Iterator[Series]:
    """Each metric family a registry holds, registered metrics and custom collectors
    alike: only the standard collectors' with ``standard``, else all but theirs.
    prometheus_client has no public list of a registry's collectors nor of a metric's
    label names, so this reads its attributes."""
    collectors: list[Any] = list(registry._collector_to_names)
    for collector in collectors:
        if isinstance(collector, STANDARD) != standard:
            continue
        if isinstance(collector, MetricWrapperBase) and collector._type != "info":
            wrapper: Any = collector
            yield wrapper._name, wrapper._type, list(wrapper._labelnames), wrapper._documentation
        else:  # collectors, and an Info, whose labels are its value's
            for family in collector.collect():
                yield from _families([family])


def _families(families: Iterable[Any]) -> Iterator[Series]:
    for family in families:
        labels = list(family.samples[0].labels) if family.samples else []
        kind = "gauge" if family.type == "info" else family.type
        name = f"{family.name}_info" if family.type == "info" else family.name
        yield name, kind, list(getattr(family, "_labelnames", ())) or labels, family.documentation


def _text_series(text: bytes) -> Iterator[Series]:
    """The families of series written as exposition text (the aggregator's per-node
    series, :func:`actors.fleet.metrics.node_series`)."""
    yield from _families(text_string_to_metric_families(text.decode()))


def metrics_table(series: Iterable[Series], where: str) -> str:
    """One row per series a scrape can show (a counter's ``_total``, a histogram's
    ``_bucket``, ``_sum`` and ``_count``), in registration order."""
    lines = [f"| series ({where}) | type | meaning |", "|---|---|---|"]
    for name, kind, labels, text in series:
        if kind == "counter":
            rows = [(f"{name}_total", labels, text)]
        elif kind == "histogram":
            rows = [
                (f"{name}_bucket", [*labels, "le"], text),
                (f"{name}_sum", labels, "its sum"),
                (f"{name}_count", labels, "its count"),
            ]
        else:
            rows = [(name, labels, text)]
        for row, names, meaning in rows:
            label_text = "{" + ",".join(names) + "}" if names else ""
            lines.append(f"| `{row}{label_text}` | {kind} | {_cell(meaning)} |")
    return "\n".join(lines) + "\n"


def fleet_settable_table() -> str:
    """One row per setting ``fleetctl settings`` may set: when a node applies it, whether
    it takes items one by one, and the shortest period the fleet may set."""
    lines = ["| setting | applied | set by item | shortest |", "|---|---|---|---|"]
    for name, effect in FLEET_SETTABLE.items():
        when = "live" if effect == "live" else "at the agent's next start"
        items = f"`{name}.NAME=VALUE`" if name in ITEMIZED else "-"
        floor = f"{FLOORS[name]:g} s" if name in FLOORS else "-"
        lines.append(f"| `{name}` | {when} | {items} | {floor} |")
    return "\n".join(lines) + "\n"


EXAMPLE_RECORD = NodeRecord(
    node_id="n", cluster="c", state="active", last_seq=1, last_seen=0.0, health_score=100
)
"""A record that gives every per-node family of the aggregator a series."""


def tables() -> dict[str, str]:
    """Every generated table by its marker name."""
    found = {
        f"settings-{name}": settings_table(config_type, prefix)
        for name, _, config_type, prefix in SETTINGS
    }
    agent = AgentMetrics()
    agent.identify("n", "c")
    aggregator = AggregatorMetrics()
    found["fleet-settable"] = fleet_settable_table()
    found["metrics-both"] = metrics_table(_series(agent.registry, standard=True), "both")
    found["metrics-agent"] = metrics_table(_series(agent.registry), "agent, `:9091/metrics`")
    found["metrics-aggregator"] = metrics_table(
        [*_series(aggregator.registry), *_text_series(node_series([EXAMPLE_RECORD]))],
        "aggregator, `:9092/metrics`",
    )
    return found


def with_tables(text: str, generated: dict[str, str]) -> str:
    """``text`` with each ``<!-- NAME:start -->`` ... ``<!-- NAME:end -->`` block
    replaced by the table of that name."""
    for name, table in generated.items():
        pattern = re.compile(
            rf"(<!-- {name}:start [^>]*-->\n).*?(<!-- {name}:end -->)", flags=re.DOTALL
        )
        text = pattern.sub(r"\g<1>" + table.replace("\\", "\\\\") + r"\g<2>", text)
    return text


def main() -> int:
    generated = tables()
    for path in (SETTINGS_DOC, METRICS_DOC):
        path.write_text(with_tables(path.read_text(), generated))
        sys.stdout.write(f"wrote the tables of {path}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
