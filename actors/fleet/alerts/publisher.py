"""Publishing alerts with deterministic ids, so N aggregators never raise one twice.

Refusals are rate-limited per node and kind: a node (or anyone on an open server) sending
hundreds of bad heartbeats a second must not turn into hundreds of alerts a second, which
would fill the alert stream and bury every other alert. The first refusal of a window is
published; the rest are counted, and when the window closes one summary alert of the same
kind carries the count in ``details["suppressed"]``. Each aggregator limits on its own, so
N aggregators publish at most N alerts per node and kind per window, plus their summaries.

A window that closes having held alerts back opens the next one at once: while a flood
lasts, the node gets its first alert and then one summary per window, never a new "first"
alert; only a quiet window ends the series. Refusals of a node's heartbeats (REFUSALS) use
``alert_repeat`` (5 min by default) as their window, the other limited kinds
``alert_window``.

An alert the stream does not acknowledge (a timeout while its leader is elected, a
server cut off) is raised again, under the same id, at every :meth:`AlertPublisher.flush`
until it is stored, for up to :data:`RESEND_FOR` (inside the stream's duplicate window, so
a copy stored but not acknowledged is dropped, never doubled): the record written meanwhile
never leaves it unsaid. So is one whose publish was cancelled in flight (the partition
that raised it let go). At most :data:`MAX_UNSENT` wait; past that the oldest is dropped,
logged as lost.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import nats.errors

from actors.runtime.bus import PUBLISH_TIMEOUT, Bus
from schemas import codec
from schemas.base import MAX_DETAILS, MAX_ID, MAX_NAME, MAX_TEXT
from schemas.messages import REFUSALS, Alert, AlertKind, Severity
from schemas.subjects import Subjects

log = logging.getLogger(__name__)

SEVERITY: dict[AlertKind, Severity] = {
    "stale": "warning",
    "offline": "critical",
    "recovered": "info",
    "anomaly": "warning",
    "sequence_gap": "warning",
    "replay": "critical",
    "bad_signature": "critical",
    "unknown_node": "warning",
    "clock_skew": "warning",
    "health": "warning",
    "interruption": "critical",
    "deregistered": "info",
    "deregistered_node_beating": "warning",
    "hardware_changed": "warning",
    "remediation": "info",
    "breaker_tripped": "critical",
    "needs_attention": "critical",
    "stopped": "info",
    "forgotten": "warning",
    "revoked": "warning",
    "bus_outage": "warning",
}


LIMITED: frozenset[AlertKind] = frozenset(
    {
        "anomaly",
        "sequence_gap",
        "replay",
        "bad_signature",
        "unknown_node",
        "clock_skew",
        "revoked",
        "forgotten",
    }
)
"""Kinds raised per message refused or judged odd, which a sender can repeat at will.
Lifecycle kinds (stale, offline, recovered, ...) follow state changes of a node's record
and are not limited: suppressing one would hide a change."""
DEFAULT_WINDOW = 60.0

RESEND_FOR = 240.0
"""Seconds an unacknowledged alert is raised again; FLEET_ALERTS drops a copy of an id it
stored within its duplicate window (300 s)."""
MAX_UNSENT = 10_000
"""Alerts waiting to be raised again at most (a fleet-wide fault, each node's alert)."""

WindowKey = tuple[AlertKind, str, str]
"""(kind, cluster, node)"""


@dataclass
class Unsent:
    """An alert not acknowledged yet: what to publish again, and until when."""

    subject: str
    body: bytes
    until: float


@dataclass
class Window:
    """One (kind, cluster, node)'s current window: when it closes and what it held back."""

    closes: float
    suppressed: int = 0


class AlertPublisher:
    def __init__(
        self,
        bus: Bus,
        subjects: Subjects,
        window: float = DEFAULT_WINDOW,
        repeat: float | None = None,
    ) -> None:
        self.bus = bus
        self.subjects = subjects
        self.window = window
        self.repeat = window if repeat is None else repeat
        self.windows: dict[WindowKey, Window] = {}
        self.unsent: dict[str, Unsent] = {}
        """Alerts to raise again, by id, oldest first."""

    def window_of(self, kind: AlertKind) -> float:
        """The rate-limit window of ``kind``: ``repeat`` for refusals, else ``window``."""
        # A refused heartbeat is sent again every beat: its kinds' window is ``repeat``.
        return self.repeat if kind in REFUSALS else self.window

    async def publish(
        self,
        kind: AlertKind,
        cluster: str,
        node: str,
        message: str,
        event: str,
        details: dict[str, str] | None = None,
        severity: Severity | None = None,
    ) -> None:
        """``event`` names what happened (a stream or heartbeat sequence, a notice id), so
        the alert id ``kind:cluster:node:event`` — also its Nats-Msg-Id — is the same in
        every aggregator that sees it, and JetStream keeps one. A limited kind is held
        back, and counted, while its node's window for that kind is open. ``severity``
        overrides the kind's own where the event says more (a health change's direction)."""
        if kind in LIMITED:
            now = time.monotonic()
            key = (kind, cluster, node)
            window = self.windows.get(key)
            if window is not None and now < window.closes:
                window.suppressed += 1
                return
            if window is not None and window.suppressed:
                # Still flooding: this one opens the next window, and the summary goes
                # out. The window is replaced first: a flush running while the summary is
                # published must not report the same count again.
                self.windows[key] = Window(closes=now + self.window_of(kind), suppressed=1)
                await self._summarise(key, window)
                return
            self.windows[key] = Window(closes=now + self.window_of(kind))
        await self._send(kind, cluster, node, message, event, details or {}, severity)

    async def flush(self) -> None:
        """Raise again every alert not acknowledged yet, and close every window that has
        run out, publishing a summary for each that held alerts back. Called
        periodically, so a count is reported even when the flood stops, and windows of
        quiet nodes do not pile up in memory."""
        await self.resend()
        now = time.monotonic()
        closed = [(key, window) for key, window in self.windows.items() if now >= window.closes]
        for key, window in closed:
            if self.windows.get(key) is not window:
                continue  # summarised meanwhile, by a publish, while another was sent
            if window.suppressed:
                # Held alerts back: reported now, and the series goes on (see module doc).
                self.windows[key] = Window(closes=now + self.window_of(key[0]))
            else:
                del self.windows[key]
            await self._summarise(key, window)

    async def _summarise(self, key: WindowKey, window: Window) -> None:
        if window.suppressed == 0:
            return
        kind, cluster, node = key
        await self._send(
            kind,
            cluster,
            node,
            f"{window.suppressed} more {kind} alerts held back in {self.window_of(kind):g}s",
            f"summary-{time.time():.3f}",
            {"suppressed": str(window.suppressed), "window": f"{self.window_of(kind):g}"},
        )

    async def _send(
        self,
        kind: AlertKind,
        cluster: str,
        node: str,
        message: str,
        event: str,
        details: dict[str, str],
        severity: Severity | None = None,
    ) -> None:
        alert_id = f"{kind}:{cluster}:{node}:{event}"
        # Refusal texts quote what the sender sent: cut them to the wire bounds, so the
        # alert is one every reader can decode.
        alert = Alert(
            id=alert_id[:MAX_ID],
            kind=kind,
            node_id=node,
            cluster=cluster,
            severity=severity or SEVERITY[kind],
            message=message[:MAX_TEXT],
            ts=time.time(),
            details={
                name[:MAX_NAME]: value[:MAX_TEXT]
                for name, value in list(details.items())[:MAX_DETAILS]
            },
        )
        subject, body = self.subjects.alert(kind, cluster, node), codec.encode(alert)
        try:
            stored = await self._publish(alert.id, subject, body)
        except asyncio.CancelledError:
            # The work that raised it stopped (its partition let go, a lease fenced)
            # with the alert in flight: kept for the next flush all the same.
            self._keep(alert.id, subject, body)
            raise
        if not stored:
            self._keep(alert.id, subject, body)

    def _keep(self, alert_id: str, subject: str, body: bytes) -> None:
        """An alert not acknowledged, to raise again at each flush (the oldest dropped,
        logged as lost, past :data:`MAX_UNSENT`)."""
        if len(self.unsent) >= MAX_UNSENT:
            lost = next(iter(self.unsent))
            del self.unsent[lost]
            log.error("alert lost: too many unacknowledged", extra={"alert": lost})
        self.unsent[alert_id] = Unsent(subject, body, time.monotonic() + RESEND_FOR)

    async def _publish(self, alert_id: str, subject: str, body: bytes) -> bool:
        """One try at storing an alert; whether FLEET_ALERTS acknowledged it."""
        try:
            await self.bus.js.publish(
                subject, body, timeout=PUBLISH_TIMEOUT, headers={"Nats-Msg-Id": alert_id}
            )
        except (nats.errors.Error, TimeoutError) as exc:
            log.warning(
                "alert not acknowledged; raised again until it is",
                extra={"alert": alert_id, "reason": str(exc) or type(exc).__name__},
            )
            return False
        return True

    async def resend(self) -> None:
        """One more try for each alert not acknowledged yet, oldest first; one past
        :data:`RESEND_FOR` is given up, logged as lost. Stops at the first that fails
        again: the stream is not answering, the others would wait as long."""
        for alert_id, unsent in list(self.unsent.items()):
            if time.monotonic() > unsent.until:
                del self.unsent[alert_id]
                log.error("alert lost: not acknowledged in time", extra={"alert": alert_id})
                continue
            if not await self._publish(alert_id, unsent.subject, unsent.body):
                return
            del self.unsent[alert_id]
            log.info("alert stored after a retry", extra={"alert": alert_id})
