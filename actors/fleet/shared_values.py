"""One object for a value many nodes hold alike (a cluster's state key, a heartbeat's
interval, a spot status without a notice), so that 100,000 nodes keep a few objects
instead of one each; bounded, so values a node makes up anew cost no more than before.
Pure: no I/O, shared by the aggregator's in-memory state and the views' indexes."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Generic, TypeVar

T = TypeVar("T", bound=Hashable)


class SharedValues(Generic[T]):
    """Up to ``bound`` distinct values, each kept once: :meth:`one` answers the object
    kept for a value equal to the one given, else keeps that one (while there is room)
    and answers it. One instance holds one type of value (``1 == 1.0 == True``)."""

    def __init__(self, bound: int) -> None:
        self.bound = bound
        self._kept: dict[T, T] = {}

    def __len__(self) -> int:
        return len(self._kept)

    def one(self, value: T) -> T:
        kept = self._kept.get(value)
        if kept is not None:
            return kept
        if len(self._kept) < self.bound:
            self._kept[value] = value
        return value
