"""``fleetctl nodes`` from the fleet's state index (:mod:`actors.fleet.live.state_index`)
where it can stand for the records: the summary by cluster and state from the index's
counts alone, and a listing of nodes in states other than active (``--state unhealthy``)
from the records of the nodes the index names, read by key and then live. Anything else
(a label selector, an order, every row, JSON, a watch, active nodes) or an index that
cannot be used (an aggregator gone, a partition's index old) reads every record as
before."""

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
    """Whether the index can answer the listing asked for (see the module's docstring)."""
    return (
        output in ("table", "wide")
        and not (args.all or args.watch or args.label or args.sort_by)
        and args.limit is None
        and "deregistered" not in states
    )


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
    bus: Bus, subjects: Subjects, cluster: str | None, states: set[str]
) -> Indexed | None:
    """The listing of ``cluster``'s nodes in ``states`` (every node when empty) from the
    index; None when the records must be read instead."""
    index = await read_index(bus, subjects)
    if index is None:
        return None
    counts = counted(index, cluster, states)
    total = sum(sum(row.values()) for row in counted(index, None, set()).values())
    if sum(sum(row.values()) for row in counts.values()) > tables.SUMMARY_ABOVE:
        return Indexed(summary=tables.count_summary(counts), total=total)
    if not states or "active" in states or not index.listed_all:
        return None  # rows of active nodes: the index does not name them
    nodes = [
        node
        for node, entry in index.listed.items()
        if entry.state in states and (not cluster or entry.cluster == cluster)
    ]
    records = [
        record
        for record in await live.stored_records_of(bus, subjects, nodes)
        if record.state in states and (not cluster or record.cluster == cluster)
    ]
    return Indexed(records=list(await live.overlay(bus, subjects, records)), total=total)
