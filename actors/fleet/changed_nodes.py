"""The nodes told of since a fleet-wide job's round last took them, bounded.

The jobs that look only at what changed each note the nodes the aggregator tells them of
and take them once a round: the full sweep and the dashboard's history sample are told
of every accepted heartbeat (:data:`BEATS`), the state index, the command-consumer
keeper, the policy's members and the Alertmanager conditions of every record written
(:data:`WRITES`). In a running fleet every node beats between two rounds of the first
kind (beats every 10 to 30 s, rounds every 60 to 120 s), so a set of their names held the
whole fleet in each: a 4 MB table at 100,000 nodes. Once the names noted are more than a
share of the nodes, they are let go and the round looks at every node instead, which it
nearly had to anyway: a round costs at most ``share`` times what changed, and a job's
names at most a ``share``-th of the fleet.
"""

from __future__ import annotations

from collections.abc import Callable

BEATS = 8
"""The share for jobs told of every accepted heartbeat: names kept up to one node in
eight, 12,500 at 100,000 nodes (a 512 KB table)."""
WRITES = 2
"""The share for jobs told of every write: a checkpoint a minute per node is 25,000
names in the policy's 15 s round at 100,000 nodes, where looking at every node decodes
every record; up to half the fleet is kept (a 2 MB table), and only a burst (a fleet's
first contacts, a mass transition) is looked at whole."""
FLOOR = 1024
"""Names kept whatever the fleet's size: a small fleet's rounds stay proportional."""


class ChangedNodes:
    """The nodes noted since the last :meth:`take`, or "every node" once they were more
    than one in ``share`` of ``count()`` (the nodes there are, read at each take)."""

    def __init__(self, count: Callable[[], int], share: int) -> None:
        self._count = count
        self._share = share
        self._names: set[str] | None = set()
        self._limit = FLOOR

    def note(self, node: str) -> None:
        names = self._names
        if names is not None:
            names.add(node)
            if len(names) > self._limit:
                self._names = None

    def take(self) -> set[str] | None:
        """The nodes noted since the last take; None when they were too many to keep:
        look at every node."""
        taken, self._names = self._names, set()
        self._limit = max(FLOOR, self._count() // self._share)
        return taken
