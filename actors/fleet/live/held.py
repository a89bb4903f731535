"""What the views read of the nodes held by the aggregator in their process: its
in-memory records, current to the last heartbeat it judged, read-only. The aggregator
gives one (``AggregatorActor.view``); a view without an aggregator beside it has none and
reads ``fleet_nodes`` alone."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from schemas.messages import NodeRecord


class Held(Protocol):
    """The nodes the aggregator beside a view holds."""

    @property
    def loading(self) -> bool:
        """A cold start is filling the table: the view keeps no copy of the records coming
        in (the aggregator is about to hold them)."""
        ...

    @property
    def everything(self) -> bool:
        """The aggregator holds every partition, each claimed and loaded: every node's
        record is its own."""
        ...

    @property
    def released(self) -> int:
        """How often the aggregator let nodes go (a partition lost or handed on): the view
        reads their records again."""
        ...

    def __contains__(self, node: object) -> bool: ...

    def __len__(self) -> int: ...

    def items(self) -> list[tuple[str, NodeRecord]]:
        """Every held node and its record as kept in memory (slim: no heartbeat)."""
        ...

    def record(self, node: str) -> NodeRecord | None:
        """The held node's record as kept (slim: its heartbeat slim, no GPU
        fingerprint); None if not held."""
        ...

    def whole(self, node: str) -> NodeRecord | None:
        """The node's whole record, its latest accepted heartbeat in it; None if not held."""
        ...

    def listen(self, written: Callable[[str], None]) -> None:
        """Have ``written(node)`` called each time the aggregator writes a held node's
        record (a state or decision-fact change at once, the rest at its checkpoint):
        how a reader of the held nodes learns of a change without looking at each."""
        ...

    def follow(self, changed: Callable[[str], None]) -> None:
        """Have ``changed(node)`` called each time the aggregator takes a node in, lets
        it go, or accepts a heartbeat of it: how a reader of the held nodes' heartbeats
        learns what changed without looking at each."""
        ...
