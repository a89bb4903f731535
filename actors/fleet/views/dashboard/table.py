"""The dashboard's node table as the server keeps it: the query a page's URL asks for
(:func:`query_of`), the records that match it in its order (:func:`matching`: problems
first by default), and the one :class:`Snapshot` of the fleet every open page reads in a
refresh, with its counts (:class:`~.attention.Tally`)."""

from __future__ import annotations

import contextlib
import dataclasses
import re
import time
from collections.abc import Callable, Iterable, Mapping
from operator import attrgetter

from aiohttp import web
from multidict import MultiMapping

from actors.fleet import labels as fleet_labels
from actors.fleet.views.dashboard import render
from actors.fleet.views.dashboard.attention import Tally
from actors.fleet.views.dashboard.conditions import Conditions, Filter, Now, Row
from actors.fleet.views.dashboard.pages import GpuQuery
from actors.fleet.views.gpus import SORTS as GPU_SORTS
from actors.fleet.views.gpus import GpuRow
from schemas.errors import FleetError
from schemas.messages import NodeRecord

SEVERITIES = ("critical", "warning", "info")
KIND = re.compile(r"[a-z_]{1,32}")
MAX_SORTED_PAGES = 200
"""Pages of GPUs listed in an order by a reading (10,000 GPUs: the top of the fleet;
each page kept costs the rows up to it)."""
MAX_QUERIES = 32
"""Queries a snapshot keeps the rows of (a new one past this starts the cache again)."""


def page_of(params: MultiMapping[str]) -> int:
    try:
        return max(1, min(int(params.get("page", "1")), 10**6))
    except ValueError:
        return 1


def words(params: MultiMapping[str], name: str, keep: Callable[[str], bool]) -> tuple[str, ...]:
    """Every space-separated word of the repeatable parameter ``name`` that ``keep``
    accepts, at most 8 of them, each at most 128 characters."""
    found = (text[:128] for value in params.getall(name, []) for text in value.split())
    return tuple(text for text in found if keep(text))[:8]


def query_of(request: web.Request) -> render.Query:
    """The overview's query from the URL; a value it cannot use is left out, never an
    error."""
    params = request.query
    page = page_of(params)
    sort = params.get("sort", "attention")
    labels = words(params, "label", lambda text: "=" in text)
    severity = params.get("severity", "")
    kind = params.get("kind", "")
    return render.Query(
        state=params.get("state", "")[:64],
        cluster=params.get("cluster", "")[:64],
        labels=labels[:8],
        text=params.get("q", "")[:128],
        sort=sort if sort in render.SORTS else "attention",
        descending=params.get("order") == "desc",
        page=page,
        severity=severity if severity in SEVERITIES else "",
        kind=kind if KIND.fullmatch(kind) else "",
        day=params.get("span") == "day",
    )


def gpu_query_of(request: web.Request) -> GpuQuery:
    """The GPU page's query from the URL, read as leniently as :func:`query_of`."""
    params = request.query
    sort = params.get("sort", "node")
    sort = sort if sort in GPU_SORTS else "node"
    page = page_of(params)
    return GpuQuery(
        cluster=params.get("cluster", "")[:64],
        nodes=words(params, "node", lambda text: True),
        labels=words(params, "label", lambda text: "=" in text),
        sort=sort,
        page=page if sort == "node" else min(page, MAX_SORTED_PAGES),
    )


def selected(
    record: NodeRecord,
    cluster: str,
    chosen: list[fleet_labels.Selector],
    nodes: tuple[str, ...] = (),
) -> bool:
    """The record is not deregistered and matches the cluster and the selectors and, if
    any are given, is one of ``nodes``."""
    return (
        record.state != "deregistered"
        and (not cluster or record.cluster == cluster)
        and (not nodes or record.node_id in nodes)
        and fleet_labels.matches(record.labels, chosen)
    )


def selectors(texts: Iterable[str]) -> list[fleet_labels.Selector]:
    """The selectors of ``texts`` that parse (a query never fails on one that does not)."""
    found = []
    for text in texts:
        with contextlib.suppress(FleetError):
            found.append(fleet_labels.parse_selector(text))
    return found


def matching(
    records: Iterable[NodeRecord], query: render.Query, concerns: Mapping[str, int] | None = None
) -> list[NodeRecord]:
    """``records`` (in node order) as the query filters and orders them (deregistered
    nodes left out); ``concerns`` (node to rank, :mod:`.attention`) orders them problems
    first: the few concerned nodes sorted, then the rest as they are, in node order (at
    100,000 nodes a sort of every record by a computed key took most of a page's time)."""
    concerns = concerns or {}
    chosen = selectors(query.labels)
    needle = query.text.lower()
    if not (query.state or query.cluster or chosen or needle):
        found = [record for record in records if record.state != "deregistered"]
    else:
        found = [
            record
            for record in records
            if record.state != "deregistered"
            and (not query.state or record.state == query.state)
            and (not query.cluster or record.cluster == query.cluster)
            and fleet_labels.matches(record.labels, chosen)
            and (
                not needle
                or needle in record.node_id.lower()
                or any(needle in f"{k}={v}".lower() for k, v in record.labels.items())
            )
        ]
    if query.sort == "attention":
        first = [record for record in found if record.node_id in concerns]
        first.sort(
            key=lambda r: (
                concerns[r.node_id],
                r.health_score if r.health_score is not None else 101,
                r.node_id,
            )
        )
        rest = [record for record in found if record.node_id not in concerns]
        found = first + rest
        return found[::-1] if query.descending else found
    keys: dict[str, Callable[[NodeRecord], tuple[object, ...]]] = {
        "cluster": lambda r: (r.cluster, r.node_id),
        "state": lambda r: (r.state, r.node_id),
        "health": lambda r: (r.health_score if r.health_score is not None else -1, r.node_id),
        "gpus": lambda r: (r.gpus_total, r.node_id),
        "seen": lambda r: (r.last_stored or r.last_seen, r.node_id),
    }
    if query.sort in keys:
        found.sort(key=keys[query.sort])
    return found[::-1] if query.descending else found


class Snapshot:
    """The records every page reads in one refresh, their tally, and each query's rows
    (found once per snapshot, whatever the number of pages asking)."""

    def __init__(
        self, records: dict[str, NodeRecord], counted: Tally, built: float, refresh: float
    ) -> None:
        self.built_at = time.time()
        self.by_node = records
        self.records = sorted(records.values(), key=attrgetter("node_id"))
        """Every record, in node order."""
        self.counted = counted
        self.built = built
        self.refresh = refresh
        self._found: dict[render.Query, list[NodeRecord]] = {}
        self.gpu_rows: dict[tuple[object, ...], list[GpuRow]] = {}
        """The GPU page's rows ordered by a reading, by query (up to its page)."""
        self.covered: dict[str, int] = {}
        """Nodes each maintenance window in force covers, by window id."""
        self.conditions: dict[tuple[Filter, int], list[Row]] = {}
        """The conditions' rows by filter and version of the conditions: computed once a
        snapshot for every page showing them."""

    def condition_rows(self, conditions: Conditions, now: Now, only: Filter) -> list[Row]:
        key = (only, conditions.version)
        rows = self.conditions.get(key)
        if rows is None:
            if len(self.conditions) >= MAX_QUERIES:
                self.conditions.clear()
            rows = self.conditions[key] = conditions.rows(self.built_at, now, only)
        return rows

    def keep_gpu_rows(self, key: tuple[object, ...], rows: list[GpuRow]) -> None:
        if len(self.gpu_rows) >= MAX_QUERIES:
            self.gpu_rows.clear()
        self.gpu_rows[key] = rows

    def matching(self, query: render.Query) -> list[NodeRecord]:
        key = dataclasses.replace(query, page=1, severity="", kind="", day=False)
        found = self._found.get(key)
        if found is None:
            if len(self._found) >= MAX_QUERIES:
                self._found.clear()
            found = self._found[key] = matching(self.records, query, self.counted.concerns)
        return found
