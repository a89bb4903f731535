"""The dashboard's HTML, rendered on the server from plain values: no template engine, no
JavaScript framework. Every value that came from a node or an operator is escaped here
(:func:`esc`), so a node's hostile label or reason is text on the page, never markup.
Charts are inline SVG polylines; a GPU is three small bars (temperature, utilisation,
memory)."""

from __future__ import annotations

import html
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from urllib.parse import urlencode

from actors.fleet.live import workload_status
from actors.fleet.live.reader import LiveRecord
from actors.fleet.storage.leases import PartitionStatus
from actors.fleet.views.dashboard.history import SERIES
from actors.fleet.views.history import Entry
from actors.runtime.spans import age, clock
from schemas.events import Gpu, Health
from schemas.messages import Alert, CommandResult, MaintenanceWindow, NodeRecord
from schemas.xid_catalog import rule_of

PAGE_SIZE = 50
SORTS = ("node", "cluster", "state", "health", "gpus", "seen")
STATE_CLASS = {
    "active": "ok",
    "degraded": "warn",
    "unhealthy": "bad",
    "stale": "bad",
    "offline": "bad",
    "cordoned": "held",
    "draining": "held",
    "drained": "held",
}
ACTIONS = ("cordon", "drain", "uncordon")


def esc(value: object) -> str:
    return html.escape(str(value), quote=True)


@dataclass(frozen=True)
class Query:
    """What the node table shows: filters, order and page (from the URL)."""

    state: str = ""
    cluster: str = ""
    labels: tuple[str, ...] = ()
    text: str = ""
    sort: str = "node"
    descending: bool = False
    page: int = 1

    def url(self, **changes: object) -> str:
        values: dict[str, object] = {
            "state": self.state,
            "cluster": self.cluster,
            "q": self.text,
            "sort": self.sort,
            "order": "desc" if self.descending else "asc",
            "page": self.page,
        }
        values.update(changes)
        pairs = [(k, str(v)) for k, v in values.items() if v not in ("", None)]
        pairs += [("label", label) for label in self.labels]
        return "?" + urlencode(pairs)


def age_cell(ts: float | None, now: float) -> str:
    """A cell whose age ticks in the browser (``data-ts``); ``-`` without a time."""
    if ts is None:
        return "<td>-</td>"
    return f'<td class="age" data-ts="{ts:.3f}">{esc(age(now - ts))}</td>'


def state_badge(state: str) -> str:
    return f'<span class="badge {STATE_CLASS.get(state, "")}">{esc(state)}</span>'


def gpu_bars(gpus: Sequence[Gpu]) -> str:
    """Per GPU three bars: temperature (of 100 °C), utilisation, memory used."""
    out = []
    for gpu in gpus:
        if gpu.lost:
            out.append(f'<span class="gpu lost" title="GPU {gpu.index} lost">✕</span>')
            continue
        memory = 100.0 * gpu.memory_used / gpu.memory_total if gpu.memory_total else None
        bars: list[str] = []
        for what, value in (
            ("temperature", gpu.temperature_c),
            ("utilisation", gpu.utilization_pct),
            ("memory", memory),
        ):
            height = 0.0 if value is None else max(0.0, min(100.0, value)) / 100 * 16
            bars.append(
                f'<rect class="{what}" x="{len(bars) * 5}" y="{16 - height:.1f}" width="4" '
                f'height="{height:.1f}"/>'
            )
        title = (
            f"GPU {gpu.index}: {fmt(gpu.temperature_c, '°C')}, "
            f"{fmt(gpu.utilization_pct, '%')} busy, {fmt(memory, '%')} memory"
        )
        out.append(
            f'<svg class="gpu" width="15" height="16" role="img"><title>{esc(title)}</title>'
            f"{''.join(bars)}</svg>"
        )
    return "".join(out) or "-"


def fmt(value: float | None, unit: str = "", digits: int = 0) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}{unit}"


def health_cell(record: NodeRecord, health: Health | None, known: bool) -> str:
    """The score, with its explained components on expand (a ``<details>``)."""
    if not known or record.health_score is None:
        return "<td>-</td>"
    if health is None:
        return f"<td>{record.health_score}</td>"
    parts = "".join(
        f"<li>{esc(c.name)}: {c.points}/{c.max_points} {esc(c.reason)}</li>"
        for c in health.components
    )
    return (
        f"<td><details><summary>{record.health_score} {esc(health.status)}</summary>"
        f"<ul>{parts}</ul></details></td>"
    )


KNOWN_STATES = frozenset({"active", "degraded", "unhealthy", "cordoned", "draining", "drained"})
"""States in which a node's last heartbeat says how it is now."""


def maintenance_badge(window: MaintenanceWindow | None) -> str:
    """A ``maintenance`` badge naming the window, or nothing."""
    if window is None:
        return ""
    title = f"window {window.id}: {window.reason or 'no reason given'}"
    return f' <span class="badge held" title="{esc(title)}">maintenance</span>'


def node_row(record: NodeRecord, now: float, window: MaintenanceWindow | None = None) -> str:
    beat = record.heartbeat
    known = record.state in KNOWN_STATES
    gpus = beat.sample.gpus if beat is not None and beat.sample is not None else []
    spot = beat.spot.notice if beat is not None and beat.spot is not None else None
    workloads = ", ".join(w.name for w in beat.workloads) if beat is not None else ""
    reason = beat.schedulability_reason if beat is not None and known else ""
    node = esc(record.node_id)
    cells = [
        f'<td><a href="/ui/nodes/{node}">{node}</a></td>',
        f"<td>{esc(record.cluster)}</td>",
        f"<td>{state_badge(record.state)}{maintenance_badge(window)}</td>",
        health_cell(record, beat.health if beat else None, known),
        f"<td>{gpu_bars(gpus) if known else '-'}</td>",
        age_cell(record.last_stored or record.last_seen, now),
        f"<td>{esc(record.schedulability if known else '-')}"
        f"{f' <small>{esc(reason)}</small>' if reason else ''}</td>",
        f"<td>{esc(f'{spot.provider} {spot.kind}') if spot else '-'}</td>",
        f"<td>{esc(workloads) or '-'}</td>",
    ]
    return f'<tr data-node="{node}">{"".join(cells)}</tr>'


def table_body(
    records: Iterable[NodeRecord],
    now: float,
    windows: Callable[[NodeRecord], MaintenanceWindow | None] = lambda record: None,
) -> str:
    rows = [node_row(record, now, windows(record)) for record in records]
    return "".join(rows) or '<tr><td colspan="9">no nodes match</td></tr>'


def table(query: Query, body: str, total: int) -> str:
    """The node table: filter form, sortable headings, the rows, the pager."""
    headings = []
    for key, title in (
        ("node", "Node"),
        ("cluster", "Cluster"),
        ("state", "State"),
        ("health", "Health"),
        ("gpus", "GPUs"),
        ("seen", "Last heartbeat"),
    ):
        descending = not query.descending if query.sort == key else False
        mark = (" ▼" if query.descending else " ▲") if query.sort == key else ""
        url = query.url(sort=key, order="desc" if descending else "asc", page=1)
        headings.append(f'<th><a href="{esc(url)}">{title}{mark}</a></th>')
    headings += ["<th>Schedulability</th>", "<th>Spot</th>", "<th>Workloads</th>"]
    pages = max(1, math.ceil(total / PAGE_SIZE))
    pager = f"page {query.page} of {pages} ({total} node{'s' if total != 1 else ''})"
    if query.page > 1:
        pager = f'<a href="{esc(query.url(page=query.page - 1))}">&lsaquo; previous</a> {pager}'
    if query.page < pages:
        pager += f' <a href="{esc(query.url(page=query.page + 1))}">next &rsaquo;</a>'
    labels = " ".join(query.labels)
    form = (
        '<form class="filters" method="get">'
        f'<input name="q" placeholder="search" value="{esc(query.text)}">'
        f'<input name="state" placeholder="state" value="{esc(query.state)}">'
        f'<input name="cluster" placeholder="cluster" value="{esc(query.cluster)}">'
        f'<input name="label" placeholder="key=value" value="{esc(labels)}">'
        f'<input type="hidden" name="sort" value="{esc(query.sort)}">'
        '<button type="submit">filter</button></form>'
    )
    return (
        f'{form}<table id="nodes"><thead><tr>{"".join(headings)}</tr></thead>'
        f'<tbody id="rows">{body}</tbody></table><p class="pager" id="pager">{pager}</p>'
    )


def counts(by_state: dict[str, int], by_cluster: dict[str, dict[str, int]]) -> str:
    states = "".join(
        f"<li>{state_badge(state)} {count}</li>" for state, count in sorted(by_state.items())
    )
    clusters = "".join(
        f"<tr><td>{esc(cluster)}</td><td>"
        + " ".join(f"{esc(s)} {n}" for s, n in sorted(states_of.items()))
        + "</td></tr>"
        for cluster, states_of in sorted(by_cluster.items())
    )
    return f'<ul class="counts">{states}</ul><table class="clusters">{clusters}</table>'


def aggregators(rows: Sequence[PartitionStatus]) -> str:
    """Each partition of FLEET_HB: who holds it and how far behind its consumer is."""
    lines = "".join(
        f"<tr><td>{esc(row.partition)}</td><td>{esc(row.holder or '(nobody)')}</td>"
        f"<td>{fmt(row.renewed_ago, ' s ago', 1) if row.holder else '-'}</td>"
        f"<td>{row.pending}</td><td>{row.unacked}</td></tr>"
        for row in rows
    )
    return (
        "<table><thead><tr><th>Partition</th><th>Holder</th><th>Renewed</th>"
        f"<th>Pending</th><th>Unacked</th></tr></thead><tbody>{lines}</tbody></table>"
    )


def alert_item(alert: Alert) -> str:
    when = clock(alert.ts, "%H:%M:%S")
    return (
        f'<li class="{esc(alert.severity)}"><time>{when}Z</time> '
        f'<a href="/ui/nodes/{esc(alert.node_id)}">{esc(alert.node_id)}</a> '
        f"{esc(alert.kind)}: {esc(alert.message)}</li>"
    )


def result_item(result: CommandResult) -> str:
    when = clock(result.ts, "%H:%M:%S")
    return (
        f"<li><time>{when}Z</time> {esc(result.command_id[:8])}… "
        f"<b>{esc(result.status)}</b> {esc(result.detail)}</li>"
    )


def chart(title: str, points: Sequence[tuple[float, float]], now: float) -> str:
    """An inline SVG line of ``points`` over the last hour, with its latest value."""
    width, height = 300, 80
    start = now - 3600
    if not points:
        line = ""
        latest = "no data yet"
    else:
        low = min(value for _, value in points)
        high = max(value for _, value in points)
        span = (high - low) or 1.0
        coords = " ".join(
            f"{(ts - start) / 3600 * width:.1f},"
            f"{height - 4 - (value - low) / span * (height - 8):.1f}"
            for ts, value in points
        )
        line = f'<polyline points="{coords}"/>'
        if len(points) == 1:
            x, y = coords.split(",")
            line = f'<circle cx="{x}" cy="{y}" r="2"/>'
        latest = f"{points[-1][1]:g} (min {low:g}, max {high:g})"
    return (
        f'<figure class="chart" data-points="{len(points)}"><figcaption>{esc(title)}: '
        f'{esc(latest)}</figcaption><svg viewBox="0 0 {width} {height}" width="{width}" '
        f'height="{height}" role="img"><title>{esc(title)}, last hour</title>{line}</svg></figure>'
    )


def charts(series: Sequence[Sequence[tuple[float, float]]], now: float) -> str:
    return "".join(chart(title, points, now) for title, points in zip(SERIES, series, strict=True))


def who_set(record: NodeRecord) -> str:
    """Who set the node's schedulability: the remediation policy where its own record
    holds the node (a fact), and who the node says (its claim, labelled so)."""
    parts = []
    if isinstance(record, LiveRecord) and record.policy_hold:
        parts.append(f"held by the remediation policy ({record.policy_hold})")
    by = record.heartbeat.schedulability_by if record.heartbeat is not None else ""
    if by:
        parts.append(f"node says: by {by}")
    return f" <small>({esc('; '.join(parts))})</small>" if parts else ""


def node_detail(record: NodeRecord, now: float, window: MaintenanceWindow | None = None) -> str:
    """The latest heartbeat, readable: checks, XIDs, GPUs, engines, workloads, Slurm, latency."""
    beat = record.heartbeat
    parts = [
        f"<p>{state_badge(record.state)}{maintenance_badge(window)} in {esc(record.cluster)}, "
        "last heartbeat "
        f'<span class="age" data-ts="{(record.last_stored or record.last_seen):.3f}">'
        f"{esc(age(now - (record.last_stored or record.last_seen)))}</span> (seq "
        f"{record.last_seq}), {esc(record.schedulability)}{who_set(record)}</p>"
    ]
    if beat is None:
        return "".join(parts) + "<p>No heartbeat kept.</p>"
    if beat.health is not None:
        checks = "".join(
            f"<tr><td>{esc(c.name)}</td><td>{esc(c.status)}</td><td>{esc(c.reason)}</td>"
            f"<td>{esc(c.action)}</td></tr>"
            for c in beat.health.checks
        )
        parts.append(
            f"<h3>Health {beat.health.score} ({esc(beat.health.status)})</h3><table><thead><tr>"
            "<th>Check</th><th>Status</th><th>Reason</th><th>Action</th></tr></thead>"
            f"<tbody>{checks}</tbody></table>"
        )
    gpus = beat.sample.gpus if beat.sample else []
    if gpus:
        rows = "".join(
            f"<tr><td>{g.index}</td><td>{esc(g.name)}</td><td>{fmt(g.temperature_c, ' °C')}</td>"
            f"<td>{fmt(g.utilization_pct, ' %')}</td><td>{fmt(g.power_w, ' W')}</td>"
            f"<td>{g.memory_used // 2**20} / {g.memory_total // 2**20} MiB</td>"
            f"<td>{fmt(g.ecc_uncorrected)}</td>"
            f"<td>{esc(', '.join(f'{x.code} x{x.count}' for x in g.xids)) or '-'}</td>"
            f"<td>{'lost' if g.lost else ''}</td></tr>"
            for g in gpus
        )
        parts.append(
            "<h3>GPUs</h3><table><thead><tr><th>#</th><th>Name</th><th>Temp</th><th>Util</th>"
            "<th>Power</th><th>Memory</th><th>ECC (unc.)</th><th>XIDs</th><th></th></tr>"
            f"</thead><tbody>{rows}</tbody></table>"
        )
        parts.append(xid_table(gpus))
    if beat.engine is not None and beat.engine.engines:
        engines = "".join(
            f"<li>{esc(e.kind)} {esc(e.url)}: {'healthy' if e.healthy else 'unhealthy'}</li>"
            for e in beat.engine.engines
        )
        parts.append(f"<h3>Engines</h3><ul>{engines}</ul>")
    if beat.workloads:
        items = "".join(
            f"<li>{esc(w.name)}: {esc(workload_status.status(record, w, (), now))}</li>"
            for w in beat.workloads
        )
        parts.append(f"<h3>Workloads</h3><ul>{items}</ul>")
    if beat.scheduler is not None:
        parts.append(f"<h3>Slurm</h3><pre>{esc(beat.scheduler)}</pre>")
    if beat.latency is not None:
        peers = "".join(
            f"<li>{esc(p.target_node_id)}: "
            f"{fmt(None if p.rtt_us is None else p.rtt_us / 1000, ' ms', 1)}, "
            f"{fmt(p.loss_pct, ' % loss')}</li>"
            for p in beat.latency.peers
        )
        parts.append(f"<h3>Latency</h3><ul>{peers or '<li>no peers</li>'}</ul>")
    return "".join(parts)


def actions_form(node: str, token: str) -> str:
    buttons = "".join(
        f'<button name="action" value="{action}" data-confirm="{action} {esc(node)}?">'
        f"{action}</button>"
        for action in ACTIONS
    )
    return (
        f'<form class="actions" method="post" action="/ui/nodes/{esc(node)}/command">'
        f'<input type="hidden" name="token" value="{esc(token)}">'
        f'<input name="reason" placeholder="reason">{buttons}</form>'
    )


def entries(history: Sequence[Entry]) -> str:
    items = []
    for entry in history:
        if isinstance(entry.message, Alert):
            items.append(alert_item(entry.message))
        elif isinstance(entry.message, CommandResult):
            items.append(result_item(entry.message))
    return "".join(reversed(items)) or "<li>nothing yet</li>"


def page(title: str, body: str, stream: str) -> str:
    """The page shell: styles, the live script and its event stream's URL."""
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        f"<title>{esc(title)}</title>"
        '<link rel="stylesheet" href="/ui/static/dashboard.css"></head>'
        f'<body data-stream="{esc(stream)}"><header><a href="/">GPU fleet</a>'
        f'<span id="live" class="live">connecting…</span></header>'
        f"<main>{body}</main>"
        '<script src="/ui/static/dashboard.js"></script></body></html>'
    )


def xid_table(gpus: Sequence[Gpu]) -> str:
    """Every XID the node's GPUs reported, with its severity, meaning and action from the
    XID catalog (what the node's ``xid`` check judges by once a code's count within its
    window is reached); empty when there are none."""
    rows = "".join(
        f"<tr><td>{g.index}</td><td>{x.code}</td><td>{x.count}</td>"
        f'<td class="{esc(rule.status)}">{esc(rule.status)}</td><td>{esc(rule.meaning)}</td>'
        f"<td>{esc(rule.action)}</td>"
        f"<td>{clock(x.last_at, '%Y-%m-%d %H:%M:%S UTC')}</td></tr>"
        for g in gpus
        for x in g.xids
        for rule in (rule_of(x.code),)
    )
    if not rows:
        return ""
    return (
        "<h3>XIDs</h3><table><thead><tr><th>GPU</th><th>XID</th><th>Seen</th><th>Severity</th>"
        "<th>Meaning</th><th>Action</th><th>Last</th></tr></thead>"
        f"<tbody>{rows}</tbody></table>"
    )
