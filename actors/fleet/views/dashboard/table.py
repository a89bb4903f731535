"""The dashboard's node table as the server keeps it: the query a page's URL asks for
(:func:`query_of`), the records that match it in its order (:func:`matching`), the counts
by state and cluster (:func:`tally`), and the one :class:`Snapshot` of the fleet every
open page reads in a refresh."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable

from aiohttp import web

from actors.fleet import labels as fleet_labels
from actors.fleet.views.dashboard import render
from schemas.errors import FleetError
from schemas.messages import NodeRecord


def query_of(request: web.Request) -> render.Query:
    """The table's query from the URL; a value it cannot use is left out, never an error."""
    params = request.query
    try:
        page = max(1, int(params.get("page", "1")))
    except ValueError:
        page = 1
    sort = params.get("sort", "node")
    labels = tuple(
        text for value in params.getall("label", []) for text in value.split() if "=" in text
    )
    return render.Query(
        state=params.get("state", "")[:64],
        cluster=params.get("cluster", "")[:64],
        labels=labels[:8],
        text=params.get("q", "")[:128],
        sort=sort if sort in render.SORTS else "node",
        descending=params.get("order") == "desc",
        page=page,
    )


def matching(records: Iterable[NodeRecord], query: render.Query) -> list[NodeRecord]:
    """``records`` as the query filters and orders them (deregistered nodes left out)."""
    selectors = []
    for text in query.labels:
        with contextlib.suppress(FleetError):
            selectors.append(fleet_labels.parse_selector(text))
    needle = query.text.lower()
    found = [
        record
        for record in records
        if record.state != "deregistered"
        and (not query.state or record.state == query.state)
        and (not query.cluster or record.cluster == query.cluster)
        and fleet_labels.matches(record.labels, selectors)
        and (
            not needle
            or needle in record.node_id.lower()
            or any(needle in f"{k}={v}".lower() for k, v in record.labels.items())
        )
    ]
    keys: dict[str, Callable[[NodeRecord], tuple[object, ...]]] = {
        "node": lambda r: (r.node_id,),
        "cluster": lambda r: (r.cluster, r.node_id),
        "state": lambda r: (r.state, r.node_id),
        "health": lambda r: (r.health_score if r.health_score is not None else -1, r.node_id),
        "gpus": lambda r: (r.gpus_total, r.node_id),
        "seen": lambda r: (r.last_stored or r.last_seen, r.node_id),
    }
    found.sort(key=keys[query.sort], reverse=query.descending)
    return found


def tally(records: Iterable[NodeRecord]) -> tuple[dict[str, int], dict[str, dict[str, int]]]:
    by_state: dict[str, int] = {}
    by_cluster: dict[str, dict[str, int]] = {}
    for record in records:
        if record.state == "deregistered":
            continue
        by_state[record.state] = by_state.get(record.state, 0) + 1
        cluster = by_cluster.setdefault(record.cluster, {})
        cluster[record.state] = cluster.get(record.state, 0) + 1
    return by_state, by_cluster


class Snapshot:
    """The records every page reads in one refresh, their tally, and each query's rows
    (found once per snapshot, whatever the number of pages asking)."""

    def __init__(
        self,
        records: list[NodeRecord],
        by_state: dict[str, int],
        by_cluster: dict[str, dict[str, int]],
        built: float,
        refresh: float,
    ) -> None:
        self.records = records
        self.by_state = by_state
        self.by_cluster = by_cluster
        self.built = built
        self.refresh = refresh
        self._found: dict[render.Query, list[NodeRecord]] = {}

    def matching(self, query: render.Query) -> list[NodeRecord]:
        key = dataclasses.replace(query, page=1)
        found = self._found.get(key)
        if found is None:
            found = self._found[key] = matching(self.records, query)
        return found
