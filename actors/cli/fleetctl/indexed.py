"""``fleetctl nodes`` from the fleet's state index (:mod:`actors.fleet.live.state_index`)
where it can stand for the records: the summary by cluster and state from the index's
counts alone, and a listing of nodes in states other than active (``--state unhealthy``,
as a summary, rows or JSON) from the records of the nodes the index names, read by key
and then live. Anything else (a label selector, an order, a watch, rows or JSON of active
nodes) or an index that cannot be used (an aggregator gone, a partition's index old)
reads every record as before."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from actors.cli.render import tables
from actors.fleet.live import reader as live
from actors.fleet.live.state_index import FleetIndex, read_index
from actors.runtime.bus import Bus
from schemas.subjects import Subjects


@dataclass
class Indexed:
    """What the index answered: a summary to print, or the records to list."""

    summary: str = ""
    records: list[live.LiveRecord] | None = None
    total: int = 0
    """Nodes in the fleet (deregistered ones left out): the listing's ``of``."""


def usable(args: argparse.Namespace, output: str, states: set[str]) -> bool:
    """Whether the index can answer the listing asked for (see the module's docstring):
    the summary, or rows (``--all``, ``--limit``, JSON) of states other than active."""
    if args.watch or args.label or args.sort_by or "deregistered" in states:
        return False
    if output in ("table", "wide") and not args.all and args.limit is None:
        return True
    return bool(states) and "active" not in states and output in ("table", "wide", "json")


def counted(index: FleetIndex, cluster: str | None, states: set[str]) -> dict[str, dict[str, int]]:
    """The index's counts of the nodes asked for, by cluster and state."""
    found: dict[str, dict[str, int]] = {}
    for name, row in index.counts.items():
        if cluster and name != cluster:
            continue
        kept = {
            state: number
            for state, number in row.items()
            if number and state != "deregistered" and (not states or state in states)
        }
        if kept:
            found[name] = kept
    return found


async def from_index(
    bus: Bus,
    subjects: Subjects,
    cluster: str | None,
    states: set[str],
    rows: bool = False,
    limit: int | None = None,
) -> Indexed | None:
    """The listing of ``cluster``'s nodes in ``states`` (every node when empty) from the
    index: a summary above a screenful unless ``rows``, else at most ``limit`` records;
    None when the records must be read instead."""
    index = await read_index(bus, subjects)
    if index is None:
        return None
    counts = counted(index, cluster, states)
    total = sum(sum(row.values()) for row in counted(index, None, set()).values())
    matches = sum(sum(row.values()) for row in counts.values())
    if not rows and matches > tables.SUMMARY_ABOVE:
        return Indexed(summary=tables.count_summary(counts), total=total)
    if not states or "active" in states or not index.listed_all:
        return None  # rows of active nodes: the index does not name them
    nodes = sorted(
        node
        for node, entry in index.listed.items()
        if entry.state in states and (not cluster or entry.cluster == cluster)
    )
    records = [
        record
        for record in await live.stored_records_of(bus, subjects, nodes)
        if record.state in states and (not cluster or record.cluster == cluster)
    ][:limit]
    return Indexed(records=list(await live.overlay(bus, subjects, records)), total=total)
