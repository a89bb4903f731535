"""The nodes told of since a fleet-wide job's round last took them, bounded.

The jobs that look only at what changed (the full sweep, the dashboard's history sample,
the state index, the command-consumer keeper, the remediation policy's members, the
Alertmanager conditions) each note the nodes the aggregator tells them of (a heartbeat
accepted, a record written) and take them once a round. In a running fleet every node
beats between two rounds (beats every 10 to 30 s, rounds every 60 s), so a set of names
would hold the whole fleet in every job: a 4 MB table at 100,000 nodes each. Once the
names noted are more than a share of the nodes (:data:`SHARE`), they are let go and the
round looks at every node instead, which it nearly had to anyway: a round costs at most
:data:`SHARE` times what changed, and a job's names at most a share of the fleet.
"""

from __future__ import annotations

from collections.abc import Callable

SHARE = 8
"""Names kept up to one node in this many (at least :data:`FLOOR`): 12,500 names at
100,000 nodes, a 512 KB table."""
FLOOR = 1024
"""Names kept whatever the fleet's size: a small fleet's rounds stay proportional."""


class ChangedNodes:
    """The nodes noted since the last :meth:`take`, or "every node" once they were more
    than a :data:`SHARE` of ``count()`` (the nodes there are, read at each take)."""

    def __init__(self, count: Callable[[], int]) -> None:
        self._count = count
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
        self._limit = max(FLOOR, self._count() // SHARE)
        return taken
