"""Alert storms folded for ``fleetctl watch --alerts``: alerts of one severity, kind and
cluster raised within a window of each other are printed as one line with a count
(``80 nodes stale in cluster local (sim-001 ... sim-080)``); a lone alert is printed as
itself. The price is latency: a line is printed when its window closes."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from actors.cli.render import tables
from actors.fleet.views.history import Entry
from actors.runtime.spans import clock
from schemas.messages import Alert

GROUP_WINDOW = 2.0
"""Seconds of alerts folded into one line by default (``--group-window``)."""

MAX_GROUP_NODES = 100_000
"""Alert ids and node names one group keeps (a fleet's worth): alerts past it are left out
of the count, so a flood of made-up ones within a window cannot grow the process without
bound."""

Key = tuple[str, str, str]
"""(severity, kind, cluster) of the alerts one line folds."""


@dataclass
class Group:
    """The alerts of one key since ``first`` (its first alert's time): the first entry,
    the ids of the alerts (one alert delivered twice, by two aggregators, counts once) and
    the nodes they named, each at most MAX_GROUP_NODES."""

    first: Entry
    ids: set[str] = field(default_factory=set)
    nodes: set[str] = field(default_factory=set)
    timer: asyncio.TimerHandle | None = None


def group_line(key: Key, group: Group) -> str:
    """``<time> warning  80 nodes stale in cluster local (sim-001 ... sim-080)``; a group of
    one alert is that alert's own line."""
    if len(group.ids) <= 1:
        return tables.event_line(group.first)
    severity, kind, cluster = key
    ends = sorted(group.nodes)
    named = f"{ends[0]} ... {ends[-1]}" if len(ends) > 1 else ends[0]
    count = tables.nodes(len(group.nodes))
    repeats = f", {len(group.ids)} alerts" if len(group.ids) != len(group.nodes) else ""
    return tables.printable(
        f"{clock(group.first.ts)} {severity:<8} {count} {kind} in cluster {cluster} "
        f"({named}{repeats})"
    )


class AlertGroups:
    """Folds alerts as they come (:meth:`add`) and hands each line to ``write`` when its
    group closes: ``window`` seconds after its first alert (a timer, for live alerts), or
    when an alert of the same key comes from later than that (a replay, read faster than
    it happened). :meth:`close` writes what is still open."""

    def __init__(self, window: float, write: Callable[[str], None]) -> None:
        self.window = window
        self.write = write
        self.open: dict[Key, Group] = {}

    def add(self, entry: Entry) -> None:
        message = entry.message
        if not isinstance(message, Alert):
            self.write(tables.event_line(entry))  # unreadable: shown as it is, at once
            return
        key = (message.severity, message.kind, message.cluster)
        group = self.open.get(key)
        if group is not None and entry.ts - group.first.ts > self.window:
            self.flush(key)
            group = None
        if group is None:
            group = self.open[key] = Group(first=entry)
            group.timer = asyncio.get_running_loop().call_later(self.window, self.flush, key)
        if len(group.ids) < MAX_GROUP_NODES:
            group.ids.add(message.id)
            group.nodes.add(message.node_id)

    def flush(self, key: Key) -> None:
        group = self.open.pop(key, None)
        if group is None:
            return
        if group.timer is not None:
            group.timer.cancel()
        self.write(group_line(key, group))

    def close(self) -> None:
        for key in sorted(self.open, key=lambda k: self.open[k].first.ts):
            self.flush(key)
