"""What the remediation policy knows of the fleet between rounds, kept from the live
feed's writes instead of decoding every record each round: per cluster, how many nodes
it has and how many report (the breaker's base), and the nodes it may act on, those
whose record has a finding now (``classify``) or may come to have one with time alone
(silent: ``hung``). A round decodes those and the nodes the policy holds, nothing else;
what a round costs follows what changed, not the fleet's size."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from actors.fleet.changed_nodes import WRITES, ChangedNodes
from actors.fleet.live.feed import NodeFeed
from actors.fleet.remediation.config import PolicyConfig
from actors.fleet.remediation.findings import REPORTING, SILENT, classify
from actors.fleet.shared_values import SharedValues
from actors.runtime.schedule import take_turn
from schemas.messages import NodeRecord

READ_PER_TURN = 1000
"""Records decoded between two turns of the event loop (about 20 ms of them)."""
ENTRIES: SharedValues[tuple[str, bool, bool]] = SharedValues(4096)
"""A node's entry, one tuple for the nodes alike (64 bytes a node otherwise)."""


class Members:
    """The policy's index of the feed's records (a few bytes a node)."""

    def __init__(self, feed: NodeFeed, config: PolicyConfig) -> None:
        self.feed = feed
        self.config = config
        self._entry: dict[str, tuple[str, bool, bool]] = {}
        """Node -> (cluster, reporting, may be acted on), as last read."""
        self._nodes: Counter[str] = Counter()
        self._reporting: Counter[str] = Counter()
        self._candidates: dict[str, set[str]] = {}
        self._written = ChangedNodes(self._entry.__len__, WRITES)
        """Nodes written since the last refresh (kept up to a share of the nodes known)."""
        self._released = -1
        self.read = 0
        """Records decoded by refreshes so far (what a quiet round adds none to)."""
        feed.listen(self._written.note)

    async def refresh(self, everything: bool) -> None:
        """Take in the nodes written since the last refresh; every node with
        ``everything`` (the first round, or the feed was incomplete since) or once the
        aggregator beside the feed let nodes go (their records are read anew). The event
        loop runs every :data:`READ_PER_TURN` nodes: a round at 100,000 nodes decodes
        25,000 written records at the defaults (about 0.5 s), all of them at its first. A
        node written meanwhile is taken in by the next refresh."""
        held = self.feed.held
        released = held.released if held is not None else 0
        written: Iterable[str] | None = self._written.take()
        if everything or written is None or released != self._released:
            self._released = released
            self._entry.clear()
            self._nodes.clear()
            self._reporting.clear()
            self._candidates.clear()
            written = self.feed.nodes()
        for step, node in enumerate(written, 1):
            await take_turn(step, READ_PER_TURN)
            self._drop(node)
            record = self.feed.record(node)
            self.read += 1
            if record is not None and not record.deregistered:
                self._put(node, record)

    def _drop(self, node: str) -> None:
        entry = self._entry.pop(node, None)
        if entry is None:
            return
        cluster, reporting, candidate = entry
        self._nodes[cluster] -= 1
        if not self._nodes[cluster]:
            del self._nodes[cluster]
        self._reporting[cluster] -= reporting
        if candidate:
            self._candidates[cluster].discard(node)

    def _put(self, node: str, record: NodeRecord) -> None:
        cluster = record.cluster
        reporting = record.state in REPORTING
        candidate = record.state in SILENT or classify(record, self.config.classes) is not None
        self._entry[node] = ENTRIES.one((cluster, reporting, candidate))
        self._nodes[cluster] += 1
        self._reporting[cluster] += reporting
        if candidate:
            self._candidates.setdefault(cluster, set()).add(node)

    def clusters(self) -> list[str]:
        """Every cluster with a node, in order."""
        return sorted(self._nodes)

    def reporting(self, cluster: str) -> int:
        """The cluster's reporting nodes (the breaker's base)."""
        return self._reporting[cluster]

    def of(self, cluster: str, held: set[str]) -> list[NodeRecord]:
        """The whole records the policy may act on in ``cluster``: those with a finding
        or silent, and the nodes of ``held`` (its holds) that are in the cluster."""
        found: list[NodeRecord] = []
        for node in sorted(self._candidates.get(cluster, set()) | held):
            record = self.feed.record(node)
            if record is not None and record.cluster == cluster and not record.deregistered:
                found.append(record)
        return found
