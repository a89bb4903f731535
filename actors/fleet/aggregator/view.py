"""The aggregator's read-only window on the nodes it holds, for the views in its process
(:class:`actors.fleet.live.held.Held`: the fleet API, the dashboard, the Alertmanager
forwarder): they read through it, never the table itself."""

from __future__ import annotations

from collections.abc import Callable

from actors.fleet.aggregator.hot_state import NodeTable
from schemas.messages import NodeRecord


class View:
    """``table`` as the views read it."""

    def __init__(self, table: NodeTable) -> None:
        self._table = table

    @property
    def loading(self) -> bool:
        return self._table.loading

    @property
    def everything(self) -> bool:
        return self._table.everything

    @property
    def released(self) -> int:
        return self._table.released

    @property
    def moves(self) -> tuple[int, int]:
        """Changes to which nodes are held that no write tells: (partitions let go,
        partitions loaded) so far."""
        return self._table.released, self._table.loads

    def record(self, node: str) -> NodeRecord | None:
        """The held node's record as kept (slim: its heartbeat slim, no GPU
        fingerprint); None if not held."""
        state = self._table.get(node)
        return None if state is None else state.record

    def __contains__(self, node: object) -> bool:
        return node in self._table

    def __len__(self) -> int:
        return len(self._table)

    def items(self) -> list[tuple[str, NodeRecord]]:
        return [(node, state.record) for node, state in self._table.items()]

    def whole(self, node: str) -> NodeRecord | None:
        state = self._table.get(node)
        return None if state is None else self._table.whole(state)

    def listen(self, written: Callable[[str], None]) -> None:
        self._table.listeners.append(written)

    def follow(self, changed: Callable[[str], None]) -> None:
        self._table.followers.append(changed)
