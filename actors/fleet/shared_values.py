"""One object for a value many nodes hold alike (a cluster's state key, a heartbeat's
interval, a spot status without a notice, a node's labels), so that 100,000 nodes keep a
few objects instead of one each; bounded, so values a node makes up anew cost no more
than before. Pure: no I/O, shared by the aggregator's in-memory state and the views'
indexes."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Generic, TypeVar

T = TypeVar("T", bound=Hashable)
V = TypeVar("V")


class SharedByKey(Generic[V]):
    """Up to ``bound`` distinct values, each kept once under a key that tells equal values
    alike: how values that cannot be a dict's key themselves (a dict of labels, a list, a
    struct holding either) are shared, keyed by their encoded bytes, say. The values kept
    are shared by every holder: never changed in place."""

    def __init__(self, bound: int) -> None:
        self.bound = bound
        self._kept: dict[Hashable, V] = {}

    def __len__(self) -> int:
        return len(self._kept)

    def one_by(self, key: Hashable, value: V) -> V:
        """The value kept under ``key`` (equal to ``value``), else ``value``, kept while
        there is room."""
        kept = self._kept.get(key)
        if kept is not None:
            return kept
        if len(self._kept) < self.bound:
            self._kept[key] = value
        return value


class SharedValues(SharedByKey[T]):
    """Hashable values, each its own key: :meth:`one` answers the object kept for a value
    equal to the one given, else keeps that one (while there is room) and answers it.
    One instance holds one type of value (``1 == 1.0 == True``)."""

    def one(self, value: T) -> T:
        return self.one_by(value, value)
