"""Which held nodes a full sweep looks at: those whose records changed since the last
one and those whose time rules may hold by now, not every node; and the pending ones, whose
records the registration cap's count is taken from.

The full sweep's rules that fire on time alone (:mod:`~actors.fleet.aggregator.sweeps`):
a live node silent for twice its ``stale_after`` plus the grace though no TTL marker came,
and a pending registration older than ``pending_expire_after``. Each can first hold at a
time its record says (:func:`due`), which changes only when the record does: each node
waits under the whole second that time falls in (rounded down: looked at no later than a
sweep over every node would), and the nodes the table tells of (taken in, let go,
beaten, written: ``NodeTable.followers`` and ``listeners``) are looked at by the next
full sweep, which queues them again. Every rule is still judged on the record as it is
then: a node looked at early is queued again; one whose time moved earlier than it waits
for was told of by the change that moved it. The first full sweep looks at every node.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable

from actors.fleet.aggregator.hot_state import NodeTable
from actors.fleet.changed_nodes import BEATS, ChangedNodes
from schemas.messages import NodeRecord


def due(record: NodeRecord, grace: float, bound: float, expire_after: float) -> float | None:
    """When a full sweep's time rule may first hold for ``record``: the pending expiry or
    the silence without a marker (``sweeps.pending_expired``,
    ``sweeps.silent_without_marker``); None when neither can until the record changes."""
    if record.state == "pending" and record.last_seq == 0 and record.pending_since is not None:
        return record.pending_since + expire_after
    if record.heartbeat is None or record.deregistered or record.offline_since:
        return None
    if record.stale_since is not None or record.stopped_since is not None:
        return None
    return record.last_seen + 2 * min(record.heartbeat.stale_after, bound) + grace


class SweepQueue:
    """The nodes of ``nodes`` by the second their time rules may next hold (a node's
    earliest in ``NodeState.due``; later entries left in the queue are skipped), the
    nodes changed since the last full sweep, and the pending ones."""

    def __init__(self, nodes: NodeTable, due_of: Callable[[NodeRecord], float | None]) -> None:
        self._nodes = nodes
        self._due_of = due_of
        """:func:`due` with the aggregator's settings."""
        self._changed = ChangedNodes(nodes.__len__, BEATS)
        """Nodes told of since the last :meth:`take`."""
        self._first = True
        """No full sweep yet: the first takes every node."""
        self._due: dict[int, list[str]] = {}
        self._seconds: list[int] = []
        self._second: dict[int, int] = {}
        """One int object for each second queued, which every node queued under it holds
        as its ``due`` (an int of its own is 32 bytes a node: 3 MB at 100,000 nodes)."""
        self.pending: set[str] = set()
        """Nodes pending when last looked at (:meth:`pending_records`; ``max_pending``
        keeps them few)."""
        nodes.followers.append(self._changed.note)
        nodes.listeners.append(self._changed.note)

    def take(self, now: float) -> list[str]:
        """The nodes a full sweep at ``now`` looks at."""
        found = self._changed.take()
        if found is None or self._first:
            self._first = False
            return list(self._nodes)
        while self._seconds and self._seconds[0] <= now:
            second = heapq.heappop(self._seconds)
            del self._second[second]
            for node in self._due.pop(second):
                state = self._nodes.get(node)
                if state is not None and state.due == second:
                    state.due = 0
                    found.add(node)
        return list(found)

    def pending_records(self) -> list[NodeRecord]:
        """The records of the nodes pending when last looked at that still are (the
        others leave the set): what the count of pending names is taken from."""
        records = []
        for node in list(self.pending):
            state = self._nodes.get(node)
            if state is None or state.record.state != "pending":
                self.pending.discard(node)
            else:
                records.append(state.record)
        return records

    def put(self, node: str) -> None:
        """The full sweep looked at ``node``: queued for when its time rules may next
        hold (not while none can until its record changes)."""
        state = self._nodes.get(node)
        if state is None or state.record.state != "pending":
            self.pending.discard(node)
        else:
            self.pending.add(node)
        when = None if state is None else self._due_of(state.record)
        if state is None or when is None:
            return
        second = math.floor(when)
        if state.due and state.due <= second:
            return  # queued for then or earlier already: looked at again then
        queued = self._due.get(second)
        if queued is None:
            queued = self._due[second] = []
            self._second[second] = second
            heapq.heappush(self._seconds, second)
        state.due = self._second[second]
        queued.append(node)
