"""Each page's live parts: the HTML of every element the server renders again at each push
(by element id), from what the dashboard holds (:class:`Board`). A page's first load and
its event stream render through the same function, so the stream only ever sends what
the page would show if reloaded.

What each page reads: the overview, the pages' one snapshot of the fleet (its counts,
concerns and table order) with the live heartbeat of the rows on screen; the node page,
the node's live record and the charts' history; the GPU page, the nodes' heartbeats (for
an order by a reading: every chosen node's, see :func:`gpu_parts`); the workloads,
policy and maintenance pages, the fleet's facts (:mod:`.facts`) and the alert feed.
"""

from __future__ import annotations

import asyncio
import heapq
import time
from collections import deque
from collections.abc import Iterator
from typing import Protocol

import msgspec

from actors.fleet.config import AggregatorConfig
from actors.fleet.record_state import KNOWN_NOW
from actors.fleet.storage.leases import PartitionStatus
from actors.fleet.storage.windows import InForce
from actors.fleet.views.dashboard import pages, panels, render
from actors.fleet.views.dashboard.chart_sets import fleet_charts, node_charts
from actors.fleet.views.dashboard.conditions import Conditions, Filter, Now
from actors.fleet.views.dashboard.facts import Facts
from actors.fleet.views.dashboard.fleet_history import FleetHistory
from actors.fleet.views.dashboard.history import History
from actors.fleet.views.dashboard.pages import GpuQuery
from actors.fleet.views.dashboard.table import Snapshot, selected, selectors
from actors.fleet.views.gpus import SORTS, GpuRow, gpu_rows
from actors.fleet.views.history import AlertFeed
from schemas.messages import Alert, CommandResult, Heartbeat, MaintenanceWindow, NodeRecord
from schemas.remediation import Hold

Parts = dict[str, str]
DECODE_CHUNK = 1000
"""Heartbeats decoded between two yields to the event loop (a GPU page ordered by a
reading decodes every chosen node's)."""


class FleetView(Protocol):
    """What the dashboard reads, as the fleet API reads it."""

    def current(self) -> dict[str, NodeRecord]: ...

    @property
    def complete(self) -> bool:
        """Whether :meth:`current` has every node (not while the live feed catches up)."""
        ...

    def record(self, node: str) -> NodeRecord | None: ...

    async def live_records(self, records: list[NodeRecord]) -> list[NodeRecord]: ...


class Board(Protocol):
    """What the dashboard holds, as the pages read it."""

    config: AggregatorConfig
    view: FleetView
    facts: Facts
    conditions: Conditions
    history: History
    fleet_history: FleetHistory
    alerts: AlertFeed
    """The newest alerts (the raw feed) with their sequence numbers: info ones kept apart
    from warning and critical ones."""
    decisions: deque[Alert]
    """The remediation policy's alerts, newest last."""
    results: dict[str, deque[CommandResult]]
    partitions: list[PartitionStatus]

    def fleet(self) -> Snapshot: ...

    def heartbeat(self, record: NodeRecord) -> Heartbeat | None:
        """The node's latest accepted heartbeat as this process knows it without a read:
        the aggregator's memory for a node it holds, else the record's own."""
        ...

    def held_note(self) -> str:
        """Which nodes the GPU figures of the fleet's charts cover, in words."""
        ...


def _now(board: Board, snapshot: Snapshot) -> Now:
    return Now(
        record=snapshot.by_node.get,
        needs_attention=board.facts.needs_attention(),
        tripped=board.facts.tripped(),
    )


async def overview_parts(board: Board, query: render.Query) -> Parts:
    """The counts, the aggregators' line, the conditions, the raw feed, the fleet's
    charts, and the node table's rows and pager."""
    snapshot = board.fleet()
    now = time.time()
    found = snapshot.matching(query)
    start = (query.page - 1) * render.PAGE_SIZE
    page, total = found[start : start + render.PAGE_SIZE], len(found)
    shown = await board.view.live_records(page)
    windows = board.facts.in_force(now)
    concerns = snapshot.counted.concerns

    def facts(record: NodeRecord) -> tuple[MaintenanceWindow | None, Hold | None, int | None]:
        hold = board.facts.hold(record.cluster, record.node_id)
        return board.facts.covering(record, now, windows), hold, concerns.get(record.node_id)

    body = render.table(query, render.table_body(shown, now, facts), total)
    rows_start = body.index('<tbody id="rows"') + len('<tbody id="rows" data-live>')
    rows_end = body.index("</tbody>", rows_start)
    pager = '<p class="pager" id="pager" data-live>'
    pager_start = body.index(pager) + len(pager)
    only = Filter(
        frozenset({query.severity}) if query.severity else frozenset(),
        frozenset({query.kind}) if query.kind else frozenset(),
    )
    rows = snapshot.condition_rows(board.conditions, _now(board, snapshot), only)
    kinds = sorted({held.kind for held in board.conditions.held.values()})
    return {
        "counts": panels.counts(snapshot.counted),
        "aggregators": panels.aggregators(board.partitions),
        "conditions": panels.filters(query, kinds)
        + panels.conditions(rows, now, board.conditions.dropped),
        "feed": panels.feed([alert for _, alert in board.alerts]),
        "fleet-charts": fleet_charts(
            board.fleet_history,
            now,
            board.config.dashboard_history_interval,
            query.day,
            board.held_note(),
        ),
        "table": body,
        "rows": body[rows_start:rows_end],
        "pager": body[pager_start : body.index("</p>", pager_start)],
    }


async def node_parts(board: Board, node: str) -> Parts | None:
    """The node's details (with the fleet's facts of it), its charts and its results;
    None when the fleet has no such node."""
    record = board.view.record(node)
    if record is None:
        return None
    (whole,) = await board.view.live_records([record])
    now = time.time()
    window = board.facts.covering(whole, now)
    hold = board.facts.hold(whole.cluster, whole.node_id)
    recent = list(board.results.get(node, ()))
    live = whole.heartbeat if whole.state in KNOWN_NOW else None
    return {
        "detail": render.node_detail(whole, now, window, hold),
        "charts": node_charts(
            board.history.series(node),
            live,
            whole.last_stored or whole.last_seen,
            now,
            board.config.dashboard_history_interval,
        ),
        "results": "".join(render.result_item(r) for r in reversed(recent)),
    }


async def gpu_parts(board: Board, query: GpuQuery) -> Parts:
    """One page of the fleet's GPUs. In node order only the page's nodes are read (live,
    as the node table's rows); ordered by a reading, every chosen node's heartbeat is
    decoded (the aggregator's memory for the nodes it holds, the record's checkpoint for
    the others: up to a minute old), in chunks between which the event loop runs, and
    only the rows up to the page are kept. At 100,000 nodes that costs seconds: the
    pages' snapshot keeps such an answer as long as it keeps the fleet."""
    snapshot = board.fleet()
    chosen_selectors = selectors(query.labels)
    chosen = [
        record
        for record in snapshot.records
        if selected(record, query.cluster, chosen_selectors, query.nodes)
    ]
    chosen.sort(key=lambda record: record.node_id)
    start = (query.page - 1) * render.PAGE_SIZE
    total = sum(record.gpus_total for record in chosen)
    if query.sort == "node":
        wanted, skip = _node_page(chosen, start)
        rows = gpu_rows(await board.view.live_records(wanted))[skip : skip + render.PAGE_SIZE]
    else:
        key = ("gpus", query.cluster, query.nodes, query.labels, query.sort, query.page)
        kept = snapshot.gpu_rows.get(key)
        if kept is None:
            kept = await _sorted_rows(board, chosen, query.sort, start)
            snapshot.keep_gpu_rows(key, kept)
        rows = kept[start : start + render.PAGE_SIZE]
    return {"gpus": pages.gpu_table(rows, query, total)}


def _node_page(chosen: list[NodeRecord], start: int) -> tuple[list[NodeRecord], int]:
    """The nodes whose GPUs (by ``gpus_total``) hold rows ``start`` to a page on, and how
    many rows of the first of them come before ``start``."""
    seen = 0
    wanted: list[NodeRecord] = []
    skip = 0
    for record in chosen:
        if seen + record.gpus_total <= start:
            seen += record.gpus_total
            continue
        if not wanted:
            skip = start - seen
        wanted.append(record)
        seen += record.gpus_total
        if seen >= start + render.PAGE_SIZE:
            break
    return wanted, skip


async def _sorted_rows(
    board: Board, chosen: list[NodeRecord], sort: str, start: int
) -> list[GpuRow]:
    """The first ``start`` + a page of rows of ``chosen``'s GPUs in ``sort``'s order
    (ties in node order)."""
    order = SORTS[sort]
    found: list[GpuRow] = []
    for first in range(0, len(chosen), DECODE_CHUNK):
        rows = gpu_rows(_with_heartbeats(board, chosen[first : first + DECODE_CHUNK]))
        found = heapq.nsmallest(
            start + render.PAGE_SIZE,
            [*found, *rows],
            key=lambda row: (order(row), row.node, row.index),
        )
        await asyncio.sleep(0)
    return found


def _with_heartbeats(board: Board, records: list[NodeRecord]) -> Iterator[NodeRecord]:
    for record in records:
        beat = board.heartbeat(record)
        if beat is not None:
            yield record if record.heartbeat is beat else _with(record, beat)


def _with(record: NodeRecord, beat: Heartbeat) -> NodeRecord:
    return msgspec.structs.replace(record, heartbeat=beat)


async def workloads_parts(board: Board) -> Parts:
    """Every placed workload, its replicas read live from their nodes' heartbeats."""
    snapshot = board.fleet()
    placed = board.facts.placed
    nodes = sorted({r.node for w in placed for r in w.replicas if r.node in snapshot.by_node})
    live = await board.view.live_records([snapshot.by_node[node] for node in nodes])
    by_node = {record.node_id: record for record in live}

    def result(node: str, command: str) -> CommandResult | None:
        return next((r for r in board.results.get(node, ()) if r.command_id == command), None)

    note = _unread(board, "workloads")
    return {"workloads": note + pages.workloads(placed, by_node.get, result, time.time())}


async def policy_parts(board: Board) -> Parts:
    """The policy's records of each cluster, and its decisions from the alert feed."""
    note = _unread(board, "policy")
    return {"policy": note + pages.policy(board.facts.policies, board.decisions, time.time())}


async def maintenance_parts(board: Board) -> Parts:
    """Every maintenance window, with the nodes those in force cover now."""
    snapshot = board.fleet()
    now = time.time()

    def covered(window: MaintenanceWindow) -> int:
        count = snapshot.covered.get(window.id)
        if count is None:
            alone = InForce([window], now)
            count = snapshot.covered[window.id] = sum(
                1 for record in snapshot.records if board.facts.covering(record, now, alone)
            )
        return count

    note = _unread(board, "maintenance")
    return {"maintenance": note + pages.maintenance(board.facts.windows, covered, now)}


def _unread(board: Board, fact: str) -> str:
    error = board.facts.errors.get(fact)
    if error is None:
        return ""
    return f'<p class="notice">could not read the {fact} records just now: {render.esc(error)}</p>'
