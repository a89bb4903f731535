"""The nodes whose command consumer the aggregator keeps (admitted, in a partition it
owns), told to the consumer keeper (``command_queues``) by what changed: the nodes whose
records were written since it last asked, or every node once the partitions it owns
changed or too many were written (:class:`~actors.fleet.changed_nodes.ChangedNodes`). A
round with nothing written walks no table."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

from actors.fleet.aggregator.command_queues import NOT_ADMITTED, Node
from actors.fleet.aggregator.hot_state import NodeTable
from actors.fleet.aggregator.ownership import Ownership
from actors.fleet.changed_nodes import WRITES, ChangedNodes


class Admitted:
    """:class:`~actors.fleet.aggregator.command_queues.AdmittedNodes` of one aggregator."""

    def __init__(self, table: NodeTable, ownership: Ownership) -> None:
        self._table = table
        self._ownership = ownership
        self._written = ChangedNodes(table.__len__, WRITES)
        """Nodes written since the last :meth:`changed`."""
        self._owned: frozenset[int] | None = None
        self.written = asyncio.Event()
        table.listeners.append(self._note)

    def _note(self, node: str) -> None:
        self._written.note(node)
        self.written.set()

    def every(self) -> Iterator[Node]:
        """Each admitted node it owns, from the table's nodes as they were at the first
        step (the keeper pauses between steps). The names are copied, not the items: a
        pair per node is 100,000 objects that live through the walk, enough to start a
        collection of every object the aggregator holds (a walk took 30 ms, or 130 ms
        with one)."""
        for node in list(self._table):
            state = self._table.get(node)
            if (
                state is not None
                and state.record.state not in NOT_ADMITTED
                and self._ownership.owns(node)
            ):
                yield state.record.cluster, node

    def cluster(self, node: str) -> str | None:
        state = self._table.get(node)
        if state is None or state.record.state in NOT_ADMITTED or not self._ownership.owns(node):
            return None
        return state.record.cluster

    def changed(self) -> set[str] | None:
        owned = frozenset(self._ownership.since)
        written = self._written.take()
        if owned != self._owned:
            self._owned = owned
            return None
        return written
