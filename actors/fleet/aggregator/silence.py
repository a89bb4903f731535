"""Telling a node's silence from the bus's, so a stream without a leader is not a stale
storm. Pure: no I/O, the times are given.

While ``FLEET_HB`` (or ``FLEET_HB_IN``) has no leader (a server killed or frozen, cut
off), no heartbeat of any node is stored for some seconds; every node whose TTL runs out
meanwhile gets its server marker, though each kept beating and is stored again the
moment the stream has a leader. So the owner notes, to the second, when the stream
stored the heartbeats it judged (:class:`StreamPulse`), and a TTL marker that comes after
a silence of the whole stream (none of its nodes' heartbeats stored for at least half the
node's ``stale_after``, within the ``stale_after`` before the marker) is held
(:class:`HeldMarkers`) instead of making the node stale:

- a heartbeat of the node releases it (the node was alive: no alert, nothing written);
- once the stream has stored heartbeats again for :func:`grace` seconds with none of the
  node's among them, the node is stale, as the marker said (the sweep does it, every
  ``sweep_interval``);
- while the stream stays silent, a node held alone is stale after another
  ``stale_after`` (one node's silence is its own); with :data:`MANY` or more held, a
  silence that wide is the bus's, and they are stale only once it has lasted
  ``bus_outage_max`` (the bound of one ``bus_outage`` alert);
- a node held through a silence longer than ``bus_outage_max`` is stale at once: an
  outage that long is told per node, as before.

A node that dies while the others beat is stale at once, as before; one that died
inside a silence is found stale a grace after the stream resumed (or once the silence
outlasts ``bus_outage_max``), and one alone in its owner's partitions (its own silence is
all the owner sees) up to one more ``stale_after`` later.
"""

from __future__ import annotations

from dataclasses import dataclass

from schemas.base import MAX_STALE_AFTER

KEPT_SECONDS = int(2 * MAX_STALE_AFTER)
"""Seconds of the stream's past the pulse remembers (past any node's ``stale_after`` the
aggregator believes)."""
MANY = 2
"""Held markers at once that make a silence with no end yet the bus's, not a node's."""
SILENT_FRACTION = 0.5
"""A stream that stored nothing for this fraction of a node's ``stale_after`` (in one
stretch, within the ``stale_after`` before its marker) was silent."""


def grace(interval: float, stale_after: float) -> float:
    """Seconds a held node has, once the stream stores heartbeats again, to be stored too:
    two of its beats, and at least half its ``stale_after`` (a node whose server went
    with the leader first has to notice and move to another)."""
    return max(2 * interval, stale_after / 2)


class StreamPulse:
    """The seconds (of the server's clock) in which the stream stored a heartbeat the
    owner judged, for the last :data:`KEPT_SECONDS`."""

    def __init__(self) -> None:
        self._seconds: set[int] = set()
        self._newest = 0

    def stored(self, at: float) -> None:
        """A heartbeat stored at ``at`` (the stream's time) was judged."""
        second = int(at)
        if second in self._seconds:
            return
        self._seconds.add(second)
        if second > self._newest:
            self._newest = second
            if len(self._seconds) > 2 * KEPT_SECONDS:
                oldest = second - KEPT_SECONDS
                self._seconds = {kept for kept in self._seconds if kept >= oldest}

    def silent(self, before: float, span: float) -> bool:
        """Whether the stream stored nothing for at least :data:`SILENT_FRACTION` of
        ``span`` in one stretch, within the ``span`` seconds before ``before``."""
        span = min(span, MAX_STALE_AFTER)
        return self._longest_gap(int(before - span), int(before))[0] >= SILENT_FRACTION * span

    def silence_between(
        self, after: float, before: float, span: float
    ) -> tuple[float, float] | None:
        """The longest stretch with nothing stored strictly between the seconds of
        ``after`` and ``before`` (two heartbeats of one node, say), as (its first second,
        the second after its last), if it lasted at least :data:`SILENT_FRACTION` of
        ``span``; None otherwise, and for what is older than the pulse remembers."""
        first = max(int(after) + 1, self._newest - KEPT_SECONDS)
        length, last = self._longest_gap(first, int(before))
        if length < SILENT_FRACTION * min(span, MAX_STALE_AFTER):
            return None
        return float(last - length + 1), float(last + 1)

    def _longest_gap(self, first: int, end: int) -> tuple[int, int]:
        """(length, last second) of the longest stretch of seconds from ``first`` to
        before ``end`` with nothing stored."""
        longest = run = last = 0
        for second in range(first, end):
            run = 0 if second in self._seconds else run + 1
            if run > longest:
                longest, last = run, second
        return longest, last

    def silent_since(self, before: float, limit: float) -> float:
        """When the silence before ``before`` began: the second after the last one in
        which a heartbeat was stored, looking back ``limit`` seconds at most
        (``before - limit``: silent at least that long)."""
        end = int(before)
        for second in range(end - 1, int(before - limit) - 1, -1):
            if second in self._seconds:
                return float(second + 1)
        return before - limit

    def resumed(self, after: float) -> float | None:
        """The first second after ``after`` in which a heartbeat was stored (None: none
        yet)."""
        later = [second for second in self._seconds if second > after]
        return float(min(later)) if later else None


@dataclass(frozen=True)
class Held:
    """A TTL marker held during a silence: when the server stored it (``marked_at``, and
    at which stream sequence) and why, the node's own times and when the stream's
    silence before the marker began (:meth:`StreamPulse.silent_since`)."""

    marked_at: float
    reason: str
    stale_after: float
    interval: float
    stream_seq: int
    silent_since: float


class HeldMarkers:
    """The markers held, one per node (the latest), for a silence of ``bound`` seconds at
    most (the aggregator's ``bus_outage_max``)."""

    def __init__(self, bound: float) -> None:
        self.bound = bound
        self.held: dict[str, Held] = {}

    def hold(self, node: str, held: Held) -> None:
        self.held[node] = held

    def may_hold(self, held: Held, now: float) -> bool:
        """Whether a marker due may be held on (its node beats into FLEET_HB_IN, or the
        intake cannot tell): only within ``bound`` of the marker, so an intake that never
        answers does not keep a dead node alive. From the marker, not the silence: an
        aggregator just started knows no silence's start (``silent_since`` is then
        ``bound`` before the marker) and would hold nothing."""
        return now < held.marked_at + self.bound

    def release(self, node: str) -> None:
        """A heartbeat of ``node`` was accepted: it was alive."""
        self.held.pop(node, None)

    def due(self, pulse: StreamPulse, now: float) -> list[tuple[str, Held]]:
        """The held markers whose node is stale now (see the module's doc), taken out."""
        found = []
        many = len(self.held) >= MANY
        for node, held in list(self.held.items()):
            resumed = pulse.resumed(held.marked_at)
            silence_over = held.silent_since + self.bound
            if resumed is None:
                stale = now >= (silence_over if many else held.marked_at + held.stale_after)
            else:
                stale = resumed > silence_over or now >= resumed + grace(
                    held.interval, held.stale_after
                )
            if stale:
                del self.held[node]
                found.append((node, held))
        return found
