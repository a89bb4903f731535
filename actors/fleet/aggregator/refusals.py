"""What an aggregator remembers about nodes whose heartbeats it refuses.

A node whose heartbeats are all refused still puts messages on its subject, each replacing
the last, so the server's TTL marker never fires and the record would stay ``active``
forever. The aggregator therefore remembers the nodes it refused and checks their records
every ``sweep_interval`` (:func:`actors.fleet.aggregator.sweeps.refused_silent`). It also
notes the refusal kind in the record, for the node to read, at most once per
``refused_note_every`` per kind,
and raises ``deregistered_node_beating`` once per boot of the node. Memory is bounded: at
most MAX_TRACKED nodes are remembered (the oldest are forgotten first; a forgotten one is
still found by the full sweep, :func:`actors.fleet.aggregator.sweeps.silent_without_marker`).
"""

from __future__ import annotations

from collections import OrderedDict

import msgspec

from schemas.messages import NodeRecord

MAX_TRACKED = 100_000
"""Nodes remembered per table: the fleet size the aggregator is sized for."""


def _bounded_set(table: OrderedDict[str, object], key: str, value: object) -> None:
    table[key] = value
    table.move_to_end(key)
    while len(table) > MAX_TRACKED:
        table.popitem(last=False)


class RefusalTracker:
    """Pure bookkeeping, no I/O: the aggregator asks and acts."""

    def __init__(self, note_every: float) -> None:
        self.note_every = note_every
        self.refused: OrderedDict[str, object] = OrderedDict()
        """Nodes refused since their last accepted heartbeat (value unused)."""
        self._noted: OrderedDict[str, object] = OrderedDict()
        """node -> (kind, monotonic time) of the last refusal noted in its record."""
        self._boots: OrderedDict[str, object] = OrderedDict()
        """node -> the boot id ``deregistered_node_beating`` was raised for."""

    def on_refused(self, node: str) -> None:
        _bounded_set(self.refused, node, None)

    def on_accepted(self, node: str) -> None:
        self.refused.pop(node, None)
        self._noted.pop(node, None)

    def forget(self, node: str) -> None:
        """No longer check ``node`` each sweep (it went stale, or has no live record)."""
        self.refused.pop(node, None)

    def should_note(self, node: str, kind: str, now: float) -> bool:
        """Whether to write ``kind`` into the node's record now: a new kind at once, the
        same one again after ``note_every``. Answering yes counts as noted."""
        last = self._noted.get(node)
        if isinstance(last, tuple) and last[0] == kind and now - last[1] < self.note_every:
            return False
        _bounded_set(self._noted, node, (kind, now))
        return True

    def first_of_boot(self, node: str, boot_id: str) -> bool:
        """True the first time ``boot_id`` of ``node`` is seen beating after it left."""
        if self._boots.get(node) == boot_id:
            return False
        _bounded_set(self._boots, node, boot_id)
        return True


def mark_refused(
    record: NodeRecord | None, kind: str, now: float, every: float
) -> NodeRecord | None:
    """The record with the refusal ``kind`` noted for the node to read, or None when
    nothing needs writing: no record (an unknown node gets none), the same kind noted less
    than ``every`` seconds ago (refused beats must not turn into a KV write each)."""
    if record is None:
        return None
    fresh = record.refused_at is not None and now - record.refused_at < every
    if record.refused == kind and fresh:
        return None
    return msgspec.structs.replace(record, refused=kind, refused_at=now)
