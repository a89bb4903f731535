"""The dashboard's pages beside the overview and the node page, as HTML from plain values:
every GPU of the fleet (:func:`gpu_table`, the rows ``fleetctl gpus`` lists), the placed
workloads and their replicas (:func:`workloads`), the remediation policy
(:func:`policy`) and the maintenance windows (:func:`maintenance`). Every value is
escaped; what a node reports (a replica's state in its heartbeat) is labelled as the
node's, what the fleet's own records say is said plainly."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from urllib.parse import urlencode

from actors.fleet.storage.placed import endpoint, listed
from actors.fleet.views.dashboard.render import (
    CLAIM,
    PAGE_SIZE,
    esc,
    labels_text,
    node_count,
    node_link,
)
from actors.fleet.views.gpus import CURRENT_STATES, SORTS, GpuRow
from actors.runtime.spans import age, clock, span
from schemas.health_limits import HOT_GPU_C
from schemas.messages import Alert, CommandResult, MaintenanceWindow, NodeRecord
from schemas.placement import PlacedWorkload
from schemas.remediation import PolicyRecord

GIB = 2**30
HISTORY_SHOWN = 5
"""Remediation times shown per node."""
DECISIONS_SHOWN = 50
POLICY_KINDS = frozenset({"remediation", "breaker_tripped", "needs_attention"})
DRY_RUN = "dry run, would: "
LOST = ' <span class="mark bad">lost</span>'
"""How the policy's alerts start in a dry run (nothing written, nothing sent)."""


@dataclass(frozen=True)
class GpuQuery:
    """What the GPU page lists: filters as ``fleetctl gpus`` takes them, an order, a page."""

    cluster: str = ""
    nodes: tuple[str, ...] = ()
    labels: tuple[str, ...] = ()
    sort: str = "node"
    page: int = 1

    def url(self, **changes: object) -> str:
        values: dict[str, object] = {"cluster": self.cluster, "sort": self.sort, "page": self.page}
        values.update(changes)
        pairs = [(k, str(v)) for k, v in values.items() if v not in ("", None)]
        pairs += [("node", node) for node in self.nodes]
        pairs += [("label", label) for label in self.labels]
        return "?" + urlencode(pairs)


def gpu_form(query: GpuQuery) -> str:
    sorts = "".join(
        f"<option{' selected' if key == query.sort else ''}>{esc(key)}</option>" for key in SORTS
    )
    return (
        '<form class="filters" method="get">'
        f'<input name="cluster" placeholder="cluster" value="{esc(query.cluster)}">'
        f'<input name="node" placeholder="node" value="{esc(" ".join(query.nodes))}">'
        f'<input name="label" placeholder="key=value" value="{esc(" ".join(query.labels))}">'
        f'<select name="sort">{sorts}</select><button type="submit">list</button></form>'
    )


def gpu_table(rows: Sequence[GpuRow], query: GpuQuery, total: int) -> str:
    """One page of GPUs, as ``fleetctl gpus`` lists them, and its pager."""
    lines = []
    for row in rows:
        used = "-" if row.memory_used is None else f"{row.memory_used / GIB:.1f}"
        limit = "" if row.power_limit_w is None else f" / {row.power_limit_w:.0f}"
        power = "-" if row.power_w is None else f"{row.power_w:.0f}{limit} W"
        xids = ", ".join(f"{code} x{count}" for code, count in row.xids.items()) or "-"
        held = (
            ", ".join(row.workloads) or "-"
            if row.state in CURRENT_STATES
            else f"(node {row.state})"
        )
        hot = row.temperature_c is not None and row.temperature_c > HOT_GPU_C
        lines.append(
            f'<tr data-key="{esc(row.node)}|{row.index}"><td>{node_link(row.node)}</td>'
            f"<td>{row.index}</td><td>{esc(row.name)}"
            f"{LOST if row.lost else ''}</td>"
            f"<td>{used} / {row.memory_total / GIB:.1f} GiB</td>"
            f'<td class="{"bad" if hot else ""}">{_reading(row.temperature_c, " °C")}</td>'
            f"<td>{power}</td>"
            f"<td>{_reading(row.utilization_pct, ' %')}</td>"
            f"<td>{_count(row.ecc_corrected)} / {_count(row.ecc_uncorrected)}</td>"
            f"<td>{esc(xids)}</td><td>{esc(held)}</td></tr>"
        )
    pages = max(1, math.ceil(total / PAGE_SIZE))
    pager = f"page {query.page} of {pages} ({total} GPU{'s' if total != 1 else ''})"
    if query.page > 1:
        pager = f'<a href="{esc(query.url(page=query.page - 1))}">&lsaquo; previous</a> {pager}'
    if query.page < pages:
        pager += f' <a href="{esc(query.url(page=query.page + 1))}">next &rsaquo;</a>'
    body = "".join(lines) or '<tr><td colspan="10">no GPUs reported by the nodes chosen</td></tr>'
    return (
        "<table><thead><tr><th>Node</th><th>GPU</th><th>Name</th><th>Memory used</th>"
        "<th>Temp</th><th>Power</th><th>Util</th><th>ECC corr. / unc.</th><th>XIDs</th>"
        f"<th>Workloads</th></tr></thead><tbody>{body}</tbody></table>"
        f'<p class="pager">{pager}</p>'
    )


def _reading(value: float | None, unit: str) -> str:
    return "-" if value is None else f"{value:.0f}{unit}"


def _count(value: int | None) -> str:
    return "-" if value is None else str(value)


def workloads(
    placed: Sequence[PlacedWorkload],
    record: Callable[[str], NodeRecord | None],
    result: Callable[[str, str], CommandResult | None],
    now: float,
) -> str:
    """Each placed workload: what it runs and where it may, then each replica (its node,
    GPUs, state as the node reports it, endpoint, deploy, moves and why), then the old
    copies still to stop. ``record`` is a node's live record, ``result`` the latest
    result of a command (node, command id) if one came."""
    if not placed:
        return (
            "<p>No placed workloads (<code>fleetctl deploy NAME --replicas N</code> places "
            "one). Workloads deployed to a named node are on that node's page.</p>"
        )
    return "".join(_workload(workload, record, result, now) for workload in placed)


def _workload(
    workload: PlacedWorkload,
    record: Callable[[str], NodeRecord | None],
    result: Callable[[str, str], CommandResult | None],
    now: float,
) -> str:
    deploy = workload.deploy
    where = [f"cluster {workload.cluster}" if workload.cluster else "any cluster"]
    if workload.selector:
        where.append(f"labels {labels_text(workload.selector)}")
    memory = f", {workload.gpu_memory / GIB:.0f} GiB free each" if workload.gpu_memory else ""
    updated = (
        f"; updated {age(now - workload.updated_at)} by {workload.updated_by[:16]}"
        if workload.updated_at is not None
        else ""
    )
    head = (
        f"{deploy.engine} {deploy.model or deploy.image or '-'}; {workload.gpus} GPU(s) a "
        f"replica{memory}; {', '.join(where)}; created {clock(workload.created_at)} by "
        f"{workload.created_by[:16]}…{updated}"
    )
    rows = []
    for replica in workload.replicas:
        node = record(replica.node) if replica.node else None
        running = listed(node, workload.name) if node is not None else None
        if not replica.node:
            state = "pending: no node fits"
        elif running is None:
            state = "not listed by its node yet"
        else:
            state = f"{running.state}{f' ({running.reason})' if running.reason else ''}"
            state += f", {running.restarts} restarts" if running.restarts else ""
        reached = endpoint(node, running.port) if node is not None and running else "-"
        sent = result(replica.node, replica.command_id) if replica.command_id else None
        deployed = (
            f"sent {age(now - replica.deployed_at)}" if replica.deployed_at is not None else "-"
        )
        if sent is not None:
            deployed += f", {sent.status}{f': {sent.detail}' if sent.detail else ''}"
        moves = (
            f"{replica.moves}, on this node since {clock(replica.deployed_at)}"
            if (replica.moves and replica.deployed_at is not None)
            else str(replica.moves)
        )
        rows.append(
            f'<tr data-key="{esc(workload.name)}|{replica.index}"><td>{replica.index}</td>'
            f"<td>{node_link(replica.node) if replica.node else '-'}</td>"
            f"<td>{esc(','.join(map(str, replica.gpus)) or '-')}</td>"
            f'<td>{esc(state)} <small class="claim">{CLAIM if running else ""}</small></td>'
            f"<td>{esc(reached)}</td><td>{esc(deployed)}</td><td>{esc(moves)}</td>"
            f"<td>{esc(replica.why) or '-'}</td></tr>"
        )
    leftovers = "".join(
        f"<li>replica {left.index}'s old copy on {node_link(left.node)} since "
        f"{esc(clock(left.since))}: {esc(left.reason or 'moved')}; "
        + (
            f"stop sent {esc(age(now - left.stopped_at))}"
            if left.stopped_at is not None
            else f"stopped by {esc(clock(left.stop_by))} at the latest"
        )
        + "</li>"
        for left in workload.leftovers
    )
    copies = f"<h4>Old copies to stop (moves)</h4><ul>{leftovers}</ul>" if leftovers else ""
    return (
        f'<section class="workload" data-key="{esc(workload.name)}"><h3>{esc(workload.name)}'
        f"</h3><p>{esc(head)}</p><table><thead><tr><th>Replica</th><th>Node</th><th>GPUs</th>"
        "<th>State</th><th>Endpoint</th><th>Deploy</th><th>Moves</th><th>Why this node</th>"
        f"</tr></thead><tbody>{''.join(rows)}</tbody></table>{copies}</section>"
    )


def policy(records: Sequence[PolicyRecord], decisions: Sequence[Alert], now: float) -> str:
    """Each cluster's breaker and holds, the would-be actions (a tripped breaker's, and a
    dry run's from its alerts), the nodes remediated within the window, then the policy's
    recent decisions (its alerts, newest first)."""
    parts = []
    if not records:
        parts.append(
            "<p>The remediation policy holds nothing (no aggregator has run it here, or it "
            "runs in dry run, which writes nothing: its would-be actions are below).</p>"
        )
    for record in records:
        parts.append(_cluster_policy(record, now))
    dry = {}
    for alert in decisions:
        if alert.kind == "remediation" and alert.message.startswith(DRY_RUN):
            dry[(alert.cluster, alert.node_id)] = alert
    if dry:
        items = "".join(
            f"<li>{esc(cluster)} {node_link(node)}: "
            f"{esc(alert.message.removeprefix(DRY_RUN))} <small>({esc(age(now - alert.ts))})"
            "</small></li>"
            for (cluster, node), alert in sorted(dry.items())
        )
        parts.append(
            f"<h3>Would-be actions of a dry run (the latest per node)</h3><ul>{items}</ul>"
        )
    recent = [alert for alert in decisions if alert.kind in POLICY_KINDS][-DECISIONS_SHOWN:]
    items = "".join(
        f'<li class="{esc(alert.severity)}"><time>{esc(clock(alert.ts, "%H:%M:%S"))}Z</time> '
        f"{esc(alert.cluster)} {node_link(alert.node_id)} {esc(alert.kind)}: "
        f"{esc(alert.message)}</li>"
        for alert in reversed(recent)
    )
    parts.append(
        "<h3>Recent decisions (the policy's alerts, last hour)</h3>"
        f'<ul class="feed">{items or "<li>none</li>"}</ul>'
    )
    return "".join(parts)


def _cluster_policy(record: PolicyRecord, now: float) -> str:
    if record.tripped_at is not None:
        breaker = (
            f'<span class="badge bad">tripped</span> {esc(age(now - record.tripped_at))}: no '
            f"action until <code>fleetctl policy reset --cluster {esc(record.cluster)}</code>"
        )
    else:
        breaker = '<span class="badge ok">closed</span>'
    would = "".join(f"<li>{esc(text)}</li>" for text in record.would)
    holds = []
    for node, hold in sorted(record.holds.items()):
        status = "needs a person (fleetctl policy clear)" if hold.needs_attention else "held"
        if hold.healthy_since is not None and not hold.needs_attention:
            status = f"healthy for {span(now - hold.healthy_since)}"
        hooks = "; ".join(
            [f"done: {', '.join(hold.hooks_done)}"] * bool(hold.hooks_done)
            + [f"running {hold.hook_running}"] * bool(hold.hook_running)
            + [f"failed: {hold.hook_error}"] * bool(hold.hook_error)
        )
        holds.append(
            f'<tr data-key="{esc(node)}"><td>{node_link(node)}</td><td>{esc(hold.action)}</td>'
            f"<td>{esc(clock(hold.since))}</td><td>{esc(hold.reason_class)}</td>"
            f"<td>{esc(status)}</td><td>{esc(hold.reason)}</td><td>{esc(hooks or '-')}</td></tr>"
        )
    history = "".join(
        f"<li>{node_link(node)}: {len(times)} time{'s' if len(times) != 1 else ''}, last "
        f"{esc(', '.join(clock(at) for at in times[-HISTORY_SHOWN:]))}</li>"
        for node, times in sorted(record.history.items())
    )
    return (
        f'<section data-key="{esc(record.cluster)}"><h3>Cluster {esc(record.cluster)}</h3>'
        f"<p>Breaker {breaker}; holds {len(record.holds)} of at most {record.limit}; "
        f"written by {esc(record.updated_by[:16] or '-')}</p>"
        + (f"<h4>Would do, once reset</h4><ul>{would}</ul>" if would else "")
        + "<h4>Holds</h4><table><thead><tr><th>Node</th><th>Action</th><th>Since</th>"
        "<th>Class</th><th>Status</th><th>Reason</th><th>Hooks</th></tr></thead><tbody>"
        + ("".join(holds) or '<tr><td colspan="7">none</td></tr>')
        + "</tbody></table><h4>Remediated within the window</h4>"
        + f"<ul>{history or '<li>none</li>'}</ul></section>"
    )


def maintenance(
    windows: Sequence[MaintenanceWindow], covered: Callable[[MaintenanceWindow], int], now: float
) -> str:
    """The windows in force, then the scheduled, then those ended (newest first);
    ``covered`` counts the nodes a window in force covers now."""
    active = sorted((w for w in windows if w.since <= now < w.until), key=lambda w: w.until)
    later = sorted((w for w in windows if w.since > now), key=lambda w: w.since)
    ended = sorted((w for w in windows if w.until <= now), key=lambda w: -w.until)[:20]
    return (
        "<h3>In force</h3>"
        + _windows(
            active, now, lambda w: f"{node_count(covered(w))} now, ends in {span(w.until - now)}"
        )
        + "<h3>Scheduled</h3>"
        + _windows(later, now, lambda w: f"starts in {span(w.since - now)}")
        + "<h3>Ended (the last 20)</h3>"
        + _windows(ended, now, lambda w: f"ended {age(now - w.until)}")
    )


def _windows(
    windows: Sequence[MaintenanceWindow], now: float, state: Callable[[MaintenanceWindow], str]
) -> str:
    if not windows:
        return "<p>none</p>"
    rows = "".join(
        f'<tr data-key="{esc(w.id)}"><td>{esc(w.id)}</td>'
        f"<td>{esc(', '.join(w.nodes) or labels_text(w.selector))}"
        f"{' in ' + esc(w.cluster) if w.cluster else ''}</td>"
        f"<td>{esc(clock(w.since))}</td><td>{esc(clock(w.until))}</td><td>{esc(state(w))}</td>"
        f"<td>{esc(w.reason or '-')}</td><td>{esc(w.by[:16])}…</td></tr>"
        for w in windows
    )
    return (
        "<table><thead><tr><th>Window</th><th>Covers</th><th>From</th><th>Until</th>"
        "<th>Now</th><th>Reason</th><th>By (operator key)</th></tr></thead>"
        f"<tbody>{rows}</tbody></table>"
    )
