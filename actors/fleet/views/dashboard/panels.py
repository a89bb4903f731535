"""The overview's panels above the node table, as HTML: what needs a person and the
counts (:func:`counts`), the aggregators in one line (:func:`aggregators`), the firing
conditions (:func:`conditions`), the raw alert feed (:func:`feed`) and the legend.
Every value from a node or an alert is escaped (:func:`~.render.esc`)."""

from __future__ import annotations

from collections.abc import Sequence
from urllib.parse import urlencode

from actors.fleet.storage.leases import PartitionStatus
from actors.fleet.views.dashboard.attention import CONCERNS, Tally
from actors.fleet.views.dashboard.conditions import Row
from actors.fleet.views.dashboard.render import (
    STATE_CLASS,
    Query,
    alert_item,
    esc,
    fmt,
    node_count,
    node_link,
    state_badge,
)
from actors.runtime.spans import age
from schemas.messages import Alert

SHOWN_ROWS = 100
"""Condition rows shown at most (the rest counted)."""
STORM_NODES = 50
"""Nodes a storm's row lists at most."""
CLUSTERS_SHOWN = 12
SEVERITIES = ("critical", "warning", "info")


def counts(counted: Tally) -> str:
    """What needs a person (by concern), the nodes by health and by what the policy
    and maintenance do, then by state, then by cluster."""
    needing = len(counted.concerns)
    if needing:
        nodes = "1 node needs" if needing == 1 else f"{needing} nodes need"
        head = f'<p class="headline bad">{nodes} a person'
        parts = [f"{count} {CONCERNS[rank]}" for rank, count in sorted(counted.by_concern.items())]
        head += f": {esc(', '.join(parts))}</p>"
    else:
        head = f'<p class="headline ok">Nothing needs a person ({node_count(counted.total)})</p>'
    health = [
        ("unhealthy", counted.unhealthy, "bad"),
        ("degraded", counted.degraded, "warn"),
        ("stale", counted.by_state.get("stale", 0), "bad"),
        ("offline", counted.by_state.get("offline", 0), "bad"),
        ("held by the policy", counted.policy_held, "held"),
        ("policy needs a person", counted.policy_needs, "bad"),
        ("in maintenance", counted.maintenance, "held"),
    ]
    by_health = "".join(
        f'<li><span class="badge {kind if count else ""}">{esc(name)}</span> {count}</li>'
        for name, count, kind in health
    )
    by_state = "".join(
        f'<li><a href="?{esc(urlencode({"state": state}))}">{state_badge(state)}</a> {count}</li>'
        for state, count in sorted(counted.by_state.items())
    )
    clusters = sorted(counted.by_cluster.items())
    lines = [
        f"{esc(cluster)}: "
        + ", ".join(f"{esc(state)} {count}" for state, count in sorted(states.items()))
        for cluster, states in clusters[:CLUSTERS_SHOWN]
    ]
    if len(clusters) > CLUSTERS_SHOWN:
        lines.append(f"and {len(clusters) - CLUSTERS_SHOWN} more clusters")
    return (
        f'{head}<ul class="counts">{by_health}</ul>'
        f'<ul class="counts states"><li>{node_count(counted.total)}:</li>{by_state}</ul>'
        f'<p class="clusters">{"; ".join(lines)}</p>'
    )


def aggregators(rows: Sequence[PartitionStatus]) -> str:
    """One line (aggregators, partitions held, how far behind), the partitions on expand."""
    holders = {row.holder for row in rows if row.holder}
    held = sum(1 for row in rows if row.holder)
    pending = sum(row.pending for row in rows)
    unacked = sum(row.unacked for row in rows)
    kind = "ok" if rows and held == len(rows) else "bad"
    line = (
        f'<span class="badge {kind}">{len(holders)} aggregator{"s" if len(holders) != 1 else ""}'
        f"</span> {held}/{len(rows)} partitions held, lag {pending} pending, {unacked} unacked"
    )
    if not rows:
        return f"{line} (not read yet)"
    table = "".join(
        f"<tr><td>{esc(row.partition)}</td><td>{esc(row.holder or '(nobody)')}</td>"
        f"<td>{fmt(row.renewed_ago, ' s ago', 1) if row.holder else '-'}</td>"
        f"<td>{row.pending}</td><td>{row.unacked}</td></tr>"
        for row in rows
    )
    return (
        f'<details data-key="partitions"><summary>{line}</summary><table><thead><tr>'
        "<th>Partition</th><th>Holder</th><th>Renewed</th><th>Pending</th><th>Unacked</th>"
        f"</tr></thead><tbody>{table}</tbody></table></details>"
    )


def filters(query: Query, kinds: Sequence[str]) -> str:
    """Links that filter the conditions by severity and kind, in the page's URL (with the
    table's query kept)."""

    def link(text: str, on: bool, **change: str) -> str:
        klass = ' class="on"' if on else ""
        return f'<a{klass} href="{esc(query.url(**change))}#conditions">{esc(text)}</a>'

    by_severity = [link("all", not query.severity, severity="")]
    by_severity += [link(s, s == query.severity, severity=s) for s in SEVERITIES]
    by_kind = [link("every kind", not query.kind, kind="")]
    shown = sorted(set(kinds) | ({query.kind} if query.kind else set()))
    by_kind += [link(k, k == query.kind, kind=k) for k in shown]
    return f'<p class="filters">severity: {" ".join(by_severity)} · kind: {" ".join(by_kind)}</p>'


def conditions(rows: Sequence[Row], now: float, dropped: int) -> str:
    """The firing conditions, then the resolved ones greyed; a storm's nodes on expand."""
    lines = []
    for row in rows[:SHOWN_ROWS]:
        resolved = row.resolved_at is not None
        if len(row.nodes) == 1:
            who = node_link(row.nodes[0])
        else:
            listed = ", ".join(node_link(node) for node in row.nodes[:STORM_NODES])
            more = len(row.nodes) - STORM_NODES
            key = f"storm|{row.kind}|{row.severity}|{row.cluster}|{resolved}"
            who = (
                f'<details data-key="{esc(key)}"><summary>{node_count(len(row.nodes))}</summary>'
                f"{listed}{f' and {more} more' if more > 0 else ''}</details>"
            )
        state = (
            f"resolved {esc(age(now - row.resolved_at))}"
            if row.resolved_at is not None
            else f'since <span class="age" data-ts="{row.since:.3f}">{esc(age(now - row.since))}'
            "</span>"
        )
        repeats = f"x{row.count}" if row.count > 1 else ""
        key = f"{row.kind}|{row.severity}|{row.cluster}|{row.nodes[0]}|{resolved}"
        lines.append(
            f'<tr class="{esc(row.severity)}{" resolved" if resolved else ""}" '
            f'data-key="{esc(key)}"><td><span class="sev">{esc(row.severity)}</span></td>'
            f"<td>{esc(row.kind)}</td><td>{who}</td><td>{esc(row.message)}</td>"
            f"<td>{state}</td><td>{repeats}</td></tr>"
        )
    if not lines:
        lines.append('<tr><td colspan="6">no condition firing</td></tr>')
    notes = []
    if len(rows) > SHOWN_ROWS:
        notes.append(f"{len(rows) - SHOWN_ROWS} more rows not shown (filter by severity or kind)")
    if dropped:
        notes.append(f"{dropped} older conditions forgotten (memory bound)")
    note = f'<p class="note">{esc("; ".join(notes))}</p>' if notes else ""
    return (
        '<table class="conditions"><thead><tr><th>Severity</th><th>Kind</th><th>Node</th>'
        f"<th>What</th><th>State</th><th>Repeats</th></tr></thead><tbody>{''.join(lines)}"
        f"</tbody></table>{note}"
    )


def feed(alerts: Sequence[Alert], shown: int = 50) -> str:
    """The newest ``shown`` alerts, newest first."""
    items = "".join(alert_item(alert) for alert in list(alerts)[-shown:][::-1])
    return items or "<li>no alerts in the last hour</li>"


LEGEND = (
    '<p class="legend">GPU bars: <span class="key temperature"></span> temperature (of '
    '100 °C) <span class="key utilisation"></span> utilisation <span class="key memory">'
    '</span> memory used; <span class="gpu lost">✕</span> a lost GPU. Marks: '
    '<span class="mark bad">XID</span> XIDs reported, <span class="mark bad">ECC</span> '
    'uncorrectable ECC errors, <span class="mark bad">lost</span> GPUs lost, '
    '<span class="mark held">maintenance</span> in a maintenance window, '
    '<span class="mark held">policy</span> held by the remediation policy, '
    '<span class="mark warn">spot</span> a spot notice. States: '
    + " ".join(
        f'<span class="badge {kind}">{esc(state)}</span>' for state, kind in STATE_CLASS.items()
    )
    + "</p>"
)
