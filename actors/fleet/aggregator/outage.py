"""A bus outage is one event, not an alert per node. Pure: no I/O, the times are given.

While the bus is down (a server restarted, the heartbeat stream without a leader) no
heartbeat is stored; afterwards every node's first heartbeats come after a gap, and each
would raise ``anomaly`` (and ``sequence_gap`` for beats lost meanwhile). The TTL markers
of the silence are held already (:mod:`~actors.fleet.aggregator.silence`). So a heartbeat
whose node's previous one was stored before a silence of the whole stream
(:meth:`StreamPulse.silence_between`) is noted here, and its gap alerts dropped; the
silence becomes one ``bus_outage`` alert, with its length and the nodes that beat again
after it, once no node has been noted for the longest ``stale_after`` among them.

An outage longer than the aggregator's ``bus_outage_max`` (:attr:`Outages.bound`) is
told per node as before (its gap alerts kept, its held markers made stale: the silence
module), and its ``bus_outage`` alert says so.

A node that died during the outage does not beat again: its held marker makes it stale
(the silence module). With a single node in the owner's partitions, that node's silence
is all the owner sees: its own gap is then told as an outage too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from actors.runtime.spans import span

GAP_KINDS = frozenset({"anomaly", "sequence_gap"})
"""The alerts a heartbeat raises for its gap, dropped when the gap is the bus's."""
EXAMPLES = 5
"""Nodes an outage's alert names (the count says how many beat again)."""


@dataclass
class Outage:
    """One silence of the stream: its first silent second, the second after its last,
    the nodes seen beating again after it (by cluster) and when the last was noted."""

    start: float
    end: float
    nodes: dict[str, str] = field(default_factory=dict)
    """node -> cluster."""
    settle: float = 0.0
    """The longest ``stale_after`` of its nodes: how long it waits for more of them."""
    noted_at: float = 0.0
    bound: float = 0.0
    """``bus_outage_max``: an outage longer than this was told per node."""

    def per_node(self) -> bool:
        """Whether it lasted longer than its bound (its nodes' alerts were raised)."""
        return self.end - self.start > self.bound

    def message(self) -> str:
        clusters = sorted(set(self.nodes.values()))
        names = sorted(self.nodes)
        shown = " ".join(names[:EXAMPLES]) + (" …" if len(names) > EXAMPLES else "")
        told = (
            f"longer than bus_outage_max ({span(self.bound)}): each node's alerts raised"
            if self.per_node()
            else "no alert per node"
        )
        return (
            f"bus outage: no heartbeat stored for {span(self.end - self.start)}; "
            f"{len(names)} node(s) beat again after it in {', '.join(clusters)} ({shown}): "
            f"{told}"
        )

    def details(self) -> dict[str, str]:
        return {
            "since": f"{self.start:.0f}",
            "until": f"{self.end:.0f}",
            "seconds": f"{self.end - self.start:.0f}",
            "nodes": str(len(self.nodes)),
            "per_node": "yes" if self.per_node() else "no",
        }


class Outages:
    """The outage being noted, and those over but not yet raised; one longer than
    ``bound`` seconds (``bus_outage_max``) is told per node too."""

    def __init__(self, bound: float) -> None:
        self.bound = bound
        self.current: Outage | None = None
        self._over: list[Outage] = []

    def note(
        self, node: str, cluster: str, silence: tuple[float, float], stale_after: float, now: float
    ) -> None:
        """``node`` beat again after ``silence`` (:meth:`StreamPulse.silence_between`)."""
        start, end = silence
        current = self.current
        if current is None or start > current.end + 1 or end < current.start - 1:
            if current is not None:
                self._over.append(current)
            current = self.current = Outage(start=start, end=end, bound=self.bound)
        current.start, current.end = min(current.start, start), max(current.end, end)
        current.nodes[node] = cluster
        current.settle = max(current.settle, stale_after)
        current.noted_at = now

    def told_per_node(self, silence: tuple[float, float]) -> bool:
        """Whether a node's ``silence`` is too long to be told as the bus's alone."""
        start, end = silence
        return end - start > self.bound

    def due(self, now: float) -> list[Outage]:
        """The outages to raise now (each once), taken out."""
        found, self._over = self._over, []
        current = self.current
        if current is not None and now - current.noted_at >= current.settle:
            found.append(current)
            self.current = None
        return found
