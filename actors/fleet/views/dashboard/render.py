"""The dashboard's HTML, rendered on the server from plain values: no template engine, no
JavaScript framework. Every value that came from a node or an operator is escaped here
(:func:`esc`), so a node's hostile label or reason is text on the page, never markup.
What only a node says of itself (its host name, versions, labels, who set its state) is
labelled ``node says``; what the fleet recorded itself (the policy's hold, a maintenance
window) is said as a fact. This module holds the page shell, the node table (a GPU is
three small bars: temperature, utilisation, memory; marks for XIDs, ECC, lost GPUs,
maintenance and the policy) and the node page's details; the overview's panels are in
:mod:`.panels`, the charts in :mod:`.charts`, the other pages in :mod:`.pages`."""

from __future__ import annotations

import html
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from urllib.parse import urlencode

from actors.fleet.live import workload_status
from actors.fleet.live.reader import LiveRecord
from actors.fleet.record_state import KNOWN_NOW
from actors.fleet.views.dashboard.attention import CONCERNS
from actors.fleet.views.dashboard.conditions import CLUSTER_NODE
from actors.fleet.views.history import Entry
from actors.runtime.spans import age, clock, span
from schemas.events import Gpu, Health, HostFacts
from schemas.messages import Alert, CommandResult, MaintenanceWindow, NodeRecord
from schemas.remediation import Hold
from schemas.xid_catalog import rule_of

PAGE_SIZE = 50
SORTS = ("attention", "node", "cluster", "state", "health", "gpus", "seen")
"""The node table's orders; ``attention`` (the default) is problems first."""
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
NAV = (
    ("/", "Fleet"),
    ("/ui/gpus", "GPUs"),
    ("/ui/workloads", "Workloads"),
    ("/ui/policy", "Policy"),
    ("/ui/maintenance", "Maintenance"),
)
CLAIM = "node says"
"""How a node's own claim is labelled."""


def esc(value: object) -> str:
    return html.escape(str(value), quote=True)


@dataclass(frozen=True)
class Query:
    """What the overview shows: the node table's filters, order and page, and the
    conditions' severity and kind (from the URL)."""

    state: str = ""
    cluster: str = ""
    labels: tuple[str, ...] = ()
    text: str = ""
    sort: str = "attention"
    descending: bool = False
    page: int = 1
    severity: str = ""
    kind: str = ""
    day: bool = False
    """The fleet's charts over the last day (else the last hour)."""

    def url(self, **changes: object) -> str:
        values: dict[str, object] = {
            "state": self.state,
            "cluster": self.cluster,
            "q": self.text,
            "sort": self.sort,
            "order": "desc" if self.descending else "asc",
            "page": self.page,
            "severity": self.severity,
            "kind": self.kind,
            "span": "day" if self.day else "",
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
        f'<td><details data-key="health"><summary>{record.health_score} {esc(health.status)}'
        f"</summary><ul>{parts}</ul></details></td>"
    )


def maintenance_badge(window: MaintenanceWindow | None) -> str:
    """A ``maintenance`` badge naming the window, or nothing."""
    if window is None:
        return ""
    title = f"window {window.id}: {window.reason or 'no reason given'}"
    return f' <span class="badge held" title="{esc(title)}">maintenance</span>'


def marks(record: NodeRecord, window: MaintenanceWindow | None, hold: Hold | None) -> str:
    """Small marks after the state: XIDs, uncorrectable ECC errors and lost GPUs in its
    last heartbeat, a spot notice, the maintenance window and the policy's hold."""
    beat = record.heartbeat
    gpus = beat.sample.gpus if beat is not None and beat.sample is not None else []
    out = []
    codes = sorted({xid.code for gpu in gpus for xid in gpu.xids})
    if codes:
        shown = ",".join(map(str, codes[:3])) + ("…" if len(codes) > 3 else "")
        out.append(f'<span class="mark bad" title="XIDs reported">XID {esc(shown)}</span>')
    ecc = sum(gpu.ecc_uncorrected or 0 for gpu in gpus)
    if ecc:
        out.append(f'<span class="mark bad" title="uncorrectable ECC errors">ECC {ecc}</span>')
    lost = sum(1 for gpu in gpus if gpu.lost)
    if lost:
        out.append(f'<span class="mark bad" title="GPUs lost">lost {lost}</span>')
    if beat is not None and beat.spot is not None and beat.spot.notice is not None:
        notice = f"{beat.spot.notice.provider} {beat.spot.notice.kind}"
        out.append(f'<span class="mark warn" title="{esc(notice)}">spot</span>')
    if window is not None:
        title = f"window {window.id}: {window.reason or 'no reason given'}"
        out.append(f'<span class="mark held" title="{esc(title)}">maintenance</span>')
    if hold is not None:
        text = "policy needs a person" if hold.needs_attention else f"policy {hold.action}"
        title = f"{hold.reason_class}: {hold.reason}"
        out.append(f'<span class="mark held" title="{esc(title)}">{esc(text)}</span>')
    return "".join(f" {mark}" for mark in out)


def why(record: NodeRecord, rank: int | None, hold: Hold | None, now: float) -> str:
    """What needs a person in the node, in a few words: its concern and the reason its
    last heartbeat or the fleet gives; empty when nothing does."""
    if rank is None:
        return ""
    beat = record.heartbeat
    reason = ""
    if CONCERNS[rank] == "policy needs a person" and hold is not None:
        reason = hold.hook_error or f"remediated too often ({hold.reason})"
    elif CONCERNS[rank] in ("unhealthy", "degraded") and beat is not None and beat.health:
        bad = [c for c in beat.health.checks if c.status in ("degraded", "unhealthy")]
        reason = "; ".join(f"{c.name}: {c.reason}" for c in bad[:2])
    elif CONCERNS[rank] in ("stale", "offline"):
        since = record.offline_since if record.state == "offline" else record.stale_since
        reason = f"silent for {span(now - since)}" if since else ""
    elif CONCERNS[rank] == "refused":
        reason = f"heartbeats refused: {record.refused}"
    elif CONCERNS[rank] == "waits for approval":
        reason = "fleetctl approve it, or forget it"
    text = CONCERNS[rank] + (f": {reason}" if reason else "")
    return f'<span class="why r{rank}">{esc(text)}</span>'


def node_row(
    record: NodeRecord,
    now: float,
    window: MaintenanceWindow | None = None,
    hold: Hold | None = None,
    rank: int | None = None,
) -> str:
    """One row of the node table: ``window``, ``hold`` and ``rank`` are what the fleet
    knows beside the record (:mod:`.facts`, :mod:`.attention`)."""
    beat = record.heartbeat
    known = record.state in KNOWN_NOW
    gpus = beat.sample.gpus if beat is not None and beat.sample is not None else []
    workloads = ", ".join(w.name for w in beat.workloads) if beat is not None else ""
    reason = beat.schedulability_reason if beat is not None and known else ""
    node = esc(record.node_id)
    cells = [
        f'<td><a href="/ui/nodes/{node}">{node}</a></td>',
        f"<td>{esc(record.cluster)}</td>",
        f"<td>{state_badge(record.state)}{marks(record, window, hold)}</td>",
        f"<td>{why(record, rank, hold, now) or '-'}</td>",
        health_cell(record, beat.health if beat else None, known),
        f"<td>{gpu_bars(gpus) if known else '-'}</td>",
        age_cell(record.last_stored or record.last_seen, now),
        f"<td>{esc(record.schedulability if known else '-')}"
        f"{f' <small>{esc(reason)}</small>' if reason else ''}</td>",
        f"<td>{esc(workloads) or '-'}</td>",
    ]
    return f'<tr data-node="{node}" data-key="{node}">{"".join(cells)}</tr>'


FactsOf = Callable[[NodeRecord], tuple[MaintenanceWindow | None, Hold | None, int | None]]
"""What the fleet knows beside a record: its maintenance window, the policy's hold and
its concern's rank."""


def table_body(
    records: Iterable[NodeRecord],
    now: float,
    facts: FactsOf = lambda record: (None, None, None),
) -> str:
    rows = [node_row(record, now, *facts(record)) for record in records]
    return "".join(rows) or '<tr><td colspan="9">no nodes match</td></tr>'


def table(query: Query, body: str, total: int) -> str:
    """The node table: filter form, sortable headings, the rows, the pager."""
    headings = []
    for key, title in (
        ("node", "Node"),
        ("cluster", "Cluster"),
        ("state", "State"),
        ("attention", "Needs a person"),
        ("health", "Health"),
        ("gpus", "GPUs"),
        ("seen", "Last heartbeat"),
    ):
        descending = not query.descending if query.sort == key else False
        mark = (" ▼" if query.descending else " ▲") if query.sort == key else ""
        url = query.url(sort=key, order="desc" if descending else "asc", page=1)
        headings.append(f'<th><a href="{esc(url)}">{title}{mark}</a></th>')
    headings += ["<th>Schedulability</th>", "<th>Workloads</th>"]
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
        f'<tbody id="rows" data-live>{body}</tbody></table><p class="pager" id="pager" data-live>'
        f"{pager}</p>"
    )


def node_link(node: str) -> str:
    """A link to the node's page; an alert about a whole cluster links the policy page."""
    if node == CLUSTER_NODE:
        return '<a href="/ui/policy">the cluster</a>'
    return f'<a href="/ui/nodes/{esc(node)}">{esc(node)}</a>'


def alert_item(alert: Alert) -> str:
    """One alert, as the raw feed and a node's history list it."""
    when = clock(alert.ts, "%H:%M:%S")
    return (
        f'<li class="{esc(alert.severity)}"><time>{when}Z</time> {node_link(alert.node_id)} '
        f"{esc(alert.kind)}: {esc(alert.message)}</li>"
    )


def result_item(result: CommandResult) -> str:
    when = clock(result.ts, "%H:%M:%S")
    return (
        f"<li><time>{when}Z</time> {esc(result.command_id[:8])}… "
        f"<b>{esc(result.status)}</b> {esc(result.detail)}</li>"
    )


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


def labels_list(labels: dict[str, str]) -> str:
    items = "".join(
        f"<li><code>{esc(key)}={esc(value)}</code></li>" for key, value in sorted(labels.items())
    )
    return f'<ul class="labels">{items}</ul>' if items else "none"


def fleet_facts(
    record: NodeRecord, now: float, window: MaintenanceWindow | None, hold: Hold | None
) -> str:
    """What the fleet recorded itself of the node: the maintenance window covering it
    (started by an operator's verified request) and the remediation policy's hold."""
    rows = []
    if window is not None:
        scope = ", ".join(window.nodes) or labels_text(window.selector)
        rows.append(
            f"<tr><th>Maintenance</th><td>window <b>{esc(window.id)}</b> until "
            f"{esc(clock(window.until))} ({esc(window.reason or 'no reason given')}; "
            f"covers {esc(scope)}{' in ' + esc(window.cluster) if window.cluster else ''}; "
            f"by operator {esc(window.by[:12])}…): alerts recorded, not forwarded</td></tr>"
        )
    else:
        rows.append("<tr><th>Maintenance</th><td>no window covers it</td></tr>")
    if hold is not None:
        status = "needs a person (fleetctl policy clear)" if hold.needs_attention else "held"
        if hold.healthy_since is not None and not hold.needs_attention:
            status = f"healthy for {span(now - hold.healthy_since)}, to be released"
        hooks = ", ".join(hold.hooks_done) or "none"
        running = f"; running {hold.hook_running}" if hold.hook_running else ""
        error = f"; last hook failed: {hold.hook_error}" if hold.hook_error else ""
        rows.append(
            f"<tr><th>Remediation policy</th><td>{esc(hold.action)} since "
            f"{esc(clock(hold.since))} for {esc(hold.reason_class)}: {esc(hold.reason)}; "
            f"{esc(status)}; hooks done: {esc(hooks)}{esc(running)}{esc(error)}</td></tr>"
        )
    else:
        rows.append("<tr><th>Remediation policy</th><td>holds nothing of it</td></tr>")
    return f'<table class="facts">{"".join(rows)}</table>'


def labels_text(labels: dict[str, str]) -> str:
    return ", ".join(f"{key}={value}" for key, value in sorted(labels.items())) or "-"


def host_block(record: NodeRecord) -> str:
    """Host and versions as the node says them (its claims, labelled so), and its labels."""
    beat = record.heartbeat
    sample = beat.sample if beat is not None else None
    host: HostFacts | None = sample.host if sample is not None else None
    rows = [
        ("Host name", sample.hostname if sample is not None else ""),
        ("Agent", record.agent_version or (beat.agent_version if beat else "")),
        ("GPU driver", host.gpu_driver_version if host else ""),
        ("CUDA (driver)", host.cuda_driver_version if host else ""),
        ("CPU", host.cpu_model if host else ""),
        ("Up", span(host.uptime_s) if host else ""),
        ("Memory used", f"{host.memory_used_pct:.0f} %" if host else ""),
        ("Programs", "; ".join(dep.version for dep in host.dependencies) if host else ""),
    ]
    cells = "".join(f"<tr><th>{name}</th><td>{esc(value or '-')}</td></tr>" for name, value in rows)
    return (
        f'<h3>Host and versions <small class="claim">({CLAIM})</small></h3>'
        f'<table class="facts">{cells}<tr><th>Labels</th><td>{labels_list(record.labels)}'
        "</td></tr></table>"
    )


def node_detail(
    record: NodeRecord,
    now: float,
    window: MaintenanceWindow | None = None,
    hold: Hold | None = None,
) -> str:
    """The latest heartbeat, readable: the fleet's facts of the node (maintenance, the
    policy), checks, XIDs, GPUs, host and versions, labels, engines, workloads, Slurm,
    latency."""
    beat = record.heartbeat
    parts = [
        f"<p>{state_badge(record.state)}{maintenance_badge(window)} in {esc(record.cluster)}, "
        "last heartbeat "
        f'<span class="age" data-ts="{(record.last_stored or record.last_seen):.3f}">'
        f"{esc(age(now - (record.last_stored or record.last_seen)))}</span> (seq "
        f"{record.last_seq}), {esc(record.schedulability)}{who_set(record)}</p>",
        fleet_facts(record, now, window, hold),
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
    parts.append(host_block(record))
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


def page(title: str, body: str, stream: str, here: str = "/") -> str:
    """The page shell: styles, the pages' links (``here`` marked), the live script and
    its event stream's URL."""
    nav = "".join(
        f'<a href="{path}"{" class=here" if path == here else ""}>{name}</a>' for path, name in NAV
    )
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        f"<title>{esc(title)}</title>"
        '<link rel="stylesheet" href="/ui/static/dashboard.css"></head>'
        f'<body data-stream="{esc(stream)}"><header><b>GPU fleet</b><nav>{nav}</nav>'
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
