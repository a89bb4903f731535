"""Alerts folded into conditions: what is wrong now, one row per node and kind, instead of
a log of every alert. Pure: fed alerts (:meth:`Conditions.add`), asked what fires
(:meth:`Conditions.rows`) with what the fleet knows now (:class:`Now`).

- A condition opens at its first alert and counts the repeats after it (eight dry-run
  lines for one node are one row, ``x8``); its severity and message are the latest's.
- It resolves when its resolving alert comes (``recovered`` for ``stale``/``offline``,
  a health alert back to healthy), when the fleet says it is over (the node's record,
  written after the alert, is no longer stale or offline, no longer unhealthy or
  degraded: a snapshot older than the alert settles nothing; the policy no longer
  needs a person for it, its breaker closed), or, for kinds that are events rather than
  states (a refused heartbeat, a sequence gap, a policy action), after :data:`QUIET`
  seconds without a repeat. A resolved condition stays, greyed, :data:`KEEP_RESOLVED`
  seconds, then goes.
- A storm is one row: more than :data:`STORM` nodes of one cluster with the same kind
  and severity (``80 nodes stale in local``), the nodes listed on expand.

Memory is bounded (:data:`MAX_CONDITIONS`; the oldest resolved go first, and what was
dropped is counted).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from actors.fleet.record_state import KNOWN_NOW
from schemas.messages import Alert, NodeRecord

QUIET = 600.0
"""Seconds without a repeat after which an event's condition is resolved."""
KEEP_RESOLVED = 900.0
"""Seconds a resolved condition stays on the page, greyed."""
STORM = 5
"""More nodes than this with one kind, severity and cluster firing are one row."""
MAX_CONDITIONS = 20_000
SEVERITY_RANK = {"critical": 0, "warning": 1, "info": 2}
SILENT = frozenset({"stale", "offline"})
"""Kinds that hold while the node's record is in one of these states."""
ENDS_SILENCE = frozenset({"recovered", "stopped", "deregistered", "forgotten"})
"""Kinds that end a node's silence (and are not conditions themselves, except the last
two, which an operator may want to see)."""
QUIET_KINDS_SHOWN = frozenset({"deregistered", "forgotten"})
HEALTH_BAD = frozenset({"degraded", "unhealthy"})
CLUSTER_NODE = "_cluster"
"""The node id of an alert about a whole cluster (the policy's breaker)."""


@dataclass
class Condition:
    """One node's condition of one kind."""

    node: str
    cluster: str
    kind: str
    severity: str
    message: str
    since: float
    last: float
    count: int = 1
    resolved_at: float | None = None


@dataclass(frozen=True)
class Now:
    """What the fleet says now, to settle conditions by: each node's record, the nodes
    the policy needs a person for, the clusters whose breaker is tripped."""

    record: Callable[[str], NodeRecord | None]
    needs_attention: Collection[tuple[str, str]] = ()
    """(cluster, node) pairs."""
    tripped: Collection[str] = ()


@dataclass(frozen=True)
class Row:
    """One line of the panel: a condition, or a storm of them (``nodes`` > 1)."""

    kind: str
    severity: str
    cluster: str
    nodes: list[str]
    message: str
    """The condition's latest message; for a storm, what it is and its newest member's."""
    since: float
    last: float
    count: int
    resolved_at: float | None


@dataclass(frozen=True)
class Filter:
    """Which rows to show: severities and kinds (empty: all)."""

    severities: frozenset[str] = frozenset()
    kinds: frozenset[str] = frozenset()

    def allows(self, row: Row) -> bool:
        return (not self.severities or row.severity in self.severities) and (
            not self.kinds or row.kind in self.kinds
        )


@dataclass
class Conditions:
    """Every open or recently resolved condition, by (node, kind family)."""

    limit: int = MAX_CONDITIONS
    held: dict[tuple[str, str], Condition] = field(default_factory=dict)
    dropped: int = 0
    """Conditions forgotten to keep within ``limit``."""
    version: int = 0
    """Alerts folded in so far: rows computed at the same version are the same."""
    resolved: dict[tuple[str, str], None] = field(default_factory=dict)
    """The keys of the resolved conditions, oldest resolved first (the first to drop)."""

    @staticmethod
    def family(kind: str) -> str:
        """Kinds one condition follows: a node's silence goes from stale to offline."""
        return "silent" if kind in SILENT else kind

    def add(self, alert: Alert) -> None:
        """Fold ``alert`` in: open, repeat or resolve a condition."""
        self.version += 1
        if alert.kind in ENDS_SILENCE:
            self._resolve((alert.node_id, "silent"), alert.ts)
            if alert.kind not in QUIET_KINDS_SHOWN:
                return
        if alert.kind == "health" and alert.details.get("to") not in HEALTH_BAD:
            self._resolve((alert.node_id, "health"), alert.ts)
            return
        key = (alert.node_id, self.family(alert.kind))
        held = self.held.get(key)
        if held is None or held.resolved_at is not None:
            self._forget(key)
            self.held[key] = Condition(
                node=alert.node_id,
                cluster=alert.cluster,
                kind=alert.kind,
                severity=alert.severity,
                message=alert.message,
                since=alert.ts,
                last=alert.ts,
            )
            self._bound()
            return
        held.count += 1
        held.kind, held.severity, held.message = alert.kind, alert.severity, alert.message
        held.last = max(held.last, alert.ts)

    def _resolve(self, key: tuple[str, str], when: float) -> None:
        held = self.held.get(key)
        if held is not None and held.resolved_at is None:
            held.resolved_at = when
            self.resolved[key] = None

    def _forget(self, key: tuple[str, str]) -> None:
        self.held.pop(key, None)
        self.resolved.pop(key, None)

    def _bound(self) -> None:
        """Drop the oldest resolved conditions, else the oldest opened, past ``limit``
        (each in constant time: a storm adds tens of thousands at once)."""
        while len(self.held) > self.limit:
            self._forget(next(iter(self.resolved or self.held)))
            self.dropped += 1

    def settle(self, now: float, fleet: Now) -> None:
        """Resolve what the fleet says is over (or what went quiet); forget what was
        resolved more than KEEP_RESOLVED ago."""
        for key, held in list(self.held.items()):
            if held.resolved_at is None and self._over(held, now, fleet):
                self._resolve(key, now)
            if held.resolved_at is not None and now - held.resolved_at > KEEP_RESOLVED:
                self._forget(key)

    @staticmethod
    def _over(held: Condition, now: float, fleet: Now) -> bool:
        if held.kind in SILENT or held.kind == "health":
            record = fleet.record(held.node)
            if record is None or record.deregistered:
                return True
            if max(record.last_seen, record.last_stored or 0.0) <= held.last:
                return False  # the record predates the alert: the pages' snapshot is older
            if held.kind in SILENT:
                return record.state not in SILENT
            return record.state in KNOWN_NOW and record.health_status not in HEALTH_BAD
        if held.kind == "needs_attention":
            return (held.cluster, held.node) not in fleet.needs_attention
        if held.kind == "breaker_tripped":
            return held.cluster not in fleet.tripped
        return now - held.last > QUIET

    def rows(self, now: float, fleet: Now, only: Filter = Filter()) -> list[Row]:
        """The panel's rows: firing first, then by severity, then the newest first; a
        storm as one row."""
        self.settle(now, fleet)
        groups: dict[tuple[str, str, str, bool], list[Condition]] = {}
        for held in self.held.values():
            firing = held.resolved_at is None
            groups.setdefault((held.kind, held.severity, held.cluster, firing), []).append(held)
        rows: list[Row] = []
        for (kind, severity, cluster, _), members in groups.items():
            if len(members) > STORM:
                rows.append(_storm(kind, severity, cluster, members))
            else:
                rows += [_single(held) for held in members]
        shown = [row for row in rows if only.allows(row)]
        shown.sort(key=lambda r: -r.last)
        shown.sort(key=lambda r: (r.resolved_at is not None, SEVERITY_RANK.get(r.severity, 3)))
        return shown


def _single(held: Condition) -> Row:
    return Row(
        kind=held.kind,
        severity=held.severity,
        cluster=held.cluster,
        nodes=[held.node],
        message=held.message,
        since=held.since,
        last=held.last,
        count=held.count,
        resolved_at=held.resolved_at,
    )


def _storm(kind: str, severity: str, cluster: str, members: list[Condition]) -> Row:
    members.sort(key=lambda held: (held.since, held.node))
    newest = max(members, key=lambda held: held.last)
    resolved = [held.resolved_at for held in members if held.resolved_at is not None]
    return Row(
        kind=kind,
        severity=severity,
        cluster=cluster,
        nodes=[held.node for held in members],
        message=f"{len(members)} nodes {kind} in {cluster} (latest, {newest.node}: "
        f"{newest.message})",
        since=members[0].since,
        last=max(held.last for held in members),
        count=sum(held.count for held in members),
        resolved_at=max(resolved) if len(resolved) == len(members) else None,
    )
