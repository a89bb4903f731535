"""Forwards the fleet's alerts to Alertmanager through its own API (``POST /api/v2/alerts``).

Two kinds of alert reach Alertmanager, both labelled ``alertname``, ``node``, ``cluster``,
``kind``, ``severity`` and the node's labels (``label_<name>``, as kube-state-metrics
names them):

- **Conditions**: a node that is stale, offline, unhealthy or degraded *now*. The
  aggregator holding the node's partition sends them from its in-memory records: at once
  when one starts, and again every ``alertmanager_resend`` seconds while it lasts, each
  time with ``endsAt`` four resends ahead, as Prometheus does. A condition that ends
  (the node beats again) is sent once more with ``endsAt`` now, which resolves it. A
  holder that dies stops resending: the next holder of the partition sends the same
  labels, and if none does, Alertmanager resolves the alert when its ``endsAt`` passes.
- **Events**: every other kind of ``FLEET_ALERTS`` (sequence gaps, bad signatures,
  interruptions, hardware changes, ...), read by the aggregators together through one
  durable consumer, so each is forwarded once and none is lost while an aggregator
  restarts; each is sent with ``endsAt`` ``alertmanager_event_hold`` after it was raised.

Nodes in a maintenance window (:mod:`actors.fleet.storage.windows`) are left out of both: their
alerts stay in ``FLEET_ALERTS`` and are counted as suppressed, not forwarded.

Each Alertmanager URL (every instance of an Alertmanager cluster, as Prometheus sends to
all) has its own bounded queue and sender: batches of up to :data:`BATCH` alerts, retried
with exponential backoff while the instance is unreachable or answers 5xx; a full queue
drops its oldest alert, and an alert Alertmanager refuses (4xx) is dropped; both are
counted in ``fleet_alertmanager_dropped_total``.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import re
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import NamedTuple, Protocol

import aiohttp
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from actors.fleet.changed_nodes import WRITES, ChangedNodes
from actors.fleet.config import AggregatorConfig
from actors.fleet.metrics import AggregatorMetrics
from actors.fleet.storage.windows import MaintenanceWindows
from actors.runtime.bus import Bus
from actors.runtime.config import ConfigError
from actors.runtime.consumer import DurableConsumer, consume_forever
from actors.runtime.schedule import Backoff
from actors.runtime.tls import client_context
from schemas import codec
from schemas.messages import Alert, MaintenanceWindow, NodeRecord, Severity
from schemas.subjects import STREAM_ALERTS, Subjects

log = logging.getLogger(__name__)

BATCH = 64
"""Alerts in one POST at most."""
CHECK_EVERY = 2.0
"""Seconds between two looks at the held nodes' conditions: a node that turns stale is
forwarded within this long of its record changing."""
ENDS_AHEAD = 4
"""A firing condition's ``endsAt`` is this many resends ahead."""
MAX_BACKOFF = 60.0
CONDITION_KINDS = frozenset({"stale", "offline", "recovered", "health"})
"""Alert kinds that conditions stand for (``recovered`` ends them): not forwarded as
events, which would duplicate them."""
API_PATH = "/api/v2/alerts"
LABEL_NAME = re.compile(r"[^a-zA-Z0-9_]")

AmAlert = dict[str, object]
"""One alert as Alertmanager's API takes it (labels, annotations, startsAt, endsAt)."""
HeldRecords = Callable[[], Iterable[NodeRecord]]


class HeldChanges(Protocol):
    """What the aggregator beside the forwarder tells of the nodes it holds
    (``aggregator.view.View``): each write, each held node's record, and what moved."""

    @property
    def moves(self) -> tuple[int, int]:
        """Changes to which nodes are held that no write tells (counts)."""
        ...

    def record(self, node: str) -> NodeRecord | None: ...

    def listen(self, written: Callable[[str], None]) -> None: ...

    def __len__(self) -> int:
        """The nodes held."""
        ...


"""The records of the nodes this aggregator holds now."""


class Condition(NamedTuple):
    kind: str
    severity: Severity
    message: str


CONDITIONS = ("stale", "offline", "unhealthy", "degraded")
"""The kinds :func:`conditions` finds."""


def conditions(record: NodeRecord) -> list[Condition]:
    """What is wrong with the node now, as its record says."""
    if record.state == "stale":
        return [Condition("stale", "warning", "no heartbeat: the node's last one expired")]
    if record.state == "offline":
        return [Condition("offline", "critical", "no heartbeat for offline_after or longer")]
    if record.state in ("deregistered", "pending"):
        return []
    if record.health_status == "unhealthy":
        return [Condition("unhealthy", "critical", f"health score {record.health_score}")]
    if record.health_status == "degraded":
        return [Condition("degraded", "warning", f"health score {record.health_score}")]
    return []


def rfc3339(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat().replace("+00:00", "Z")


def node_labels(record: NodeRecord | None) -> dict[str, str]:
    """The node's own labels, as Alertmanager label names (``label_<name>``)."""
    if record is None:
        return {}
    return {f"label_{LABEL_NAME.sub('_', key)}": value for key, value in record.labels.items()}


def am_alert(
    *,
    alertname: str,
    node: str,
    cluster: str,
    kind: str,
    severity: str,
    message: str,
    starts: float,
    ends: float,
    extra: Mapping[str, str],
) -> AmAlert:
    labels = {
        **extra,
        "alertname": alertname,
        "node": node,
        "cluster": cluster,
        "kind": kind,
        "severity": severity,
    }
    return {
        "labels": labels,
        "annotations": {"summary": f"{node} {kind}: {message}"[:1024]},
        "startsAt": rfc3339(starts),
        "endsAt": rfc3339(ends),
    }


def alertname(kind: str) -> str:
    """``sequence_gap`` -> ``FleetNodeSequenceGap``."""
    return "FleetNode" + "".join(part.capitalize() for part in kind.split("_"))


class Outbox:
    """One Alertmanager instance's bounded queue and its sender."""

    def __init__(
        self,
        url: str,
        session: aiohttp.ClientSession,
        config: AggregatorConfig,
        metrics: AggregatorMetrics,
    ) -> None:
        self.url = url.rstrip("/") + API_PATH
        self.session = session
        self.limit = config.alertmanager_queue
        self.timeout = aiohttp.ClientTimeout(total=config.alertmanager_timeout)
        self.metrics = metrics
        self.queue: deque[AmAlert] = deque()
        self.wake = asyncio.Event()

    def put(self, alerts: Iterable[AmAlert]) -> None:
        for alert in alerts:
            if len(self.queue) >= self.limit:
                self.queue.popleft()
                self.metrics.am_dropped.labels("queue_full").inc()
            self.queue.append(alert)
        self.metrics.am_queued.labels(self.url).set(len(self.queue))
        self.wake.set()

    async def run(self) -> None:
        backoff = Backoff(1.0, MAX_BACKOFF)
        while True:
            await self.wake.wait()
            self.wake.clear()
            while self.queue:
                batch = [self.queue.popleft() for _ in range(min(BATCH, len(self.queue)))]
                self.metrics.am_queued.labels(self.url).set(len(self.queue))
                if await self._post(batch):
                    backoff.reset()
                    continue
                # Unreachable or 5xx: put the batch back in front (what the bound allows)
                # and try again later.
                room = max(0, self.limit - len(self.queue))
                for alert in reversed(batch[:room]):
                    self.queue.appendleft(alert)
                if len(batch) > room:
                    self.metrics.am_dropped.labels("queue_full").inc(len(batch) - room)
                await asyncio.sleep(backoff.next())

    async def _post(self, batch: list[AmAlert]) -> bool:
        """True when the batch is done with (sent, or refused for good)."""
        try:
            async with self.session.post(self.url, json=batch, timeout=self.timeout) as answer:
                if answer.status < 300:
                    self.metrics.am_sent.labels(self.url).inc(len(batch))
                    return True
                reason = (await answer.text())[:200]
                if answer.status < 500:
                    self.metrics.am_dropped.labels("rejected").inc(len(batch))
                    log.error(
                        "alertmanager refused alerts",
                        extra={"url": self.url, "status": answer.status, "reason": reason},
                    )
                    return True
                why = f"{answer.status} {reason}"
        except (aiohttp.ClientError, TimeoutError) as exc:
            why = str(exc) or type(exc).__name__
        self.metrics.am_errors.labels(self.url).inc()
        log.warning("alertmanager unreachable; retrying", extra={"url": self.url, "reason": why})
        return False


class AlertmanagerActor:
    """Sends conditions of the held nodes and events of FLEET_ALERTS to every configured
    Alertmanager; publishes nothing on the bus."""

    name = "alertmanager"

    def __init__(
        self,
        config: AggregatorConfig,
        bus: Bus,
        metrics: AggregatorMetrics,
        held: HeldRecords,
        windows: MaintenanceWindows,
        record_of: Callable[[str], NodeRecord | None] | None = None,
        changes: HeldChanges | None = None,
    ) -> None:
        self.config = config
        self.bus = bus
        self.metrics = metrics
        self.held = held
        self.windows = windows
        self.record_of = record_of
        """Any node's record as its process's live feed has it (its labels, for an
        event's): the fleet process hands its feed's reader; None knows the held only."""
        self.subjects = Subjects(config.prefix)
        self.outboxes: list[Outbox] = []
        self.changes = changes
        """The held nodes' writes, where the aggregator gives them: a check then looks
        only at the nodes written since the last (None: every held node each check)."""
        self.firing: dict[tuple[str, str], AmAlert] = {}
        """Conditions sent as firing, by (node, kind)."""
        self._resent = 0.0
        self._checked = 0.0
        self._written = ChangedNodes(changes.__len__ if changes is not None else lambda: 0, WRITES)
        """Held nodes written since the last check."""
        self._moves: tuple[int, int] | None = None
        self._windows: list[MaintenanceWindow] | None = None
        if changes is not None:
            changes.listen(self._written.note)

    def send(self, alerts: list[AmAlert]) -> None:
        if alerts:
            for outbox in self.outboxes:
                outbox.put(alerts)

    def check_conditions(self, now: float) -> None:
        """Send the conditions that started, the resolution of those that ended, and, once
        per ``alertmanager_resend``, every one still firing. With ``changes`` only the
        nodes written since the last check are looked at (every held node at the first,
        once nodes were let go or loaded, and when a maintenance window changed or began
        or ended)."""
        resend = self.config.alertmanager_resend
        ends = now + ENDS_AHEAD * resend
        due = now - self._resent >= resend
        changed = self._changed(now)
        if changed is None:
            out = self._walk(now, ends, due)
        else:
            started, resolved = self._look(changed, now, ends)
            if due:
                self.firing = {
                    key: {**alert, "endsAt": rfc3339(ends)} for key, alert in self.firing.items()
                }
                started = list(self.firing.values())
            out = started + resolved
        if due:
            self._resent = now
        self._checked = now
        self.send(out)

    def _changed(self, now: float) -> set[str] | None:
        """The nodes written since the last check; None when every held node is to be
        looked at (too many written to keep their names, too)."""
        written = self._written.take()
        if self.changes is None:
            return None
        moves = self.changes.moves
        windows = list(self.windows.windows)
        turned = any(self._checked < at <= now for w in windows for at in (w.since, w.until))
        if moves != self._moves or windows != self._windows or turned:
            self._moves, self._windows = moves, windows
            return None
        return written

    def _current(self, record: NodeRecord, now: float, ends: float) -> dict[str, AmAlert]:
        """The node's conditions now, by kind (none while a window covers it)."""
        if self.windows.covering(record, now) is not None:
            if conditions(record):
                self.metrics.am_suppressed.labels("maintenance").inc()
            return {}
        found: dict[str, AmAlert] = {}
        for condition in conditions(record):
            since = record.stale_since if condition.kind == "stale" else None
            if condition.kind == "offline":
                since = record.offline_since
            found[condition.kind] = am_alert(
                alertname=alertname(condition.kind),
                node=record.node_id,
                cluster=record.cluster,
                kind=condition.kind,
                severity=condition.severity,
                message=condition.message,
                starts=since or now,
                ends=ends,
                extra=node_labels(record),
            )
        return found

    def _walk(self, now: float, ends: float, due: bool) -> list[AmAlert]:
        """Every held node looked at: what to send."""
        held: set[str] = set()
        current: dict[tuple[str, str], AmAlert] = {}
        for record in self.held():
            held.add(record.node_id)
            for kind, alert in self._current(record, now, ends).items():
                current[(record.node_id, kind)] = alert
        out = [alert for key, alert in current.items() if due or key not in self.firing]
        for key, alert in self.firing.items():
            # Resolved only by the node's holder: a node no longer held (its partition
            # moved) keeps firing from its new holder.
            if key not in current and key[0] in held:
                out.append({**alert, "endsAt": rfc3339(now)})
        self.firing = current
        return out

    def _look(
        self, nodes: set[str], now: float, ends: float
    ) -> tuple[list[AmAlert], list[AmAlert]]:
        """Only ``nodes`` looked at (their records were written): the conditions that
        started, and the resolutions of those that ended."""
        assert self.changes is not None
        started: list[AmAlert] = []
        resolved: list[AmAlert] = []
        for node in nodes:
            record = self.changes.record(node)
            if record is None:  # no longer held: its new holder resolves what fires
                for kind in CONDITIONS:
                    self.firing.pop((node, kind), None)
                continue
            current = self._current(record, now, ends)
            for kind in CONDITIONS:
                key = (node, kind)
                if kind in current and key not in self.firing:
                    self.firing[key] = current[kind]
                    started.append(current[kind])
                elif kind not in current and key in self.firing:
                    resolved.append({**self.firing.pop(key), "endsAt": rfc3339(now)})
        return started, resolved

    async def on_event(self, msg: Msg) -> None:
        alert = codec.decode(msg.data, Alert, msg.subject)
        if alert.kind not in CONDITION_KINDS:
            record = self._record(alert.node_id)
            if record is not None and self.windows.covering(record, time.time()) is not None:
                self.metrics.am_suppressed.labels("maintenance").inc()
            else:
                event = am_alert(
                    alertname=alertname(alert.kind),
                    node=alert.node_id,
                    cluster=alert.cluster,
                    kind=alert.kind,
                    severity=alert.severity,
                    message=alert.message,
                    starts=alert.ts,
                    ends=alert.ts + self.config.alertmanager_event_hold,
                    extra=node_labels(record),
                )
                self.send([event])
        await msg.ack()

    def _record(self, node: str) -> NodeRecord | None:
        """The node's record (its labels): from the process's live feed (memory), else
        from the held nodes."""
        if self.record_of is not None:
            return self.record_of(node)
        return next((record for record in self.held() if record.node_id == node), None)

    def _events_consumer(self) -> DurableConsumer:
        return DurableConsumer(
            self.bus.js,
            self.subjects.stream_name(STREAM_ALERTS),
            self.subjects.alerts(),
            self.config.alertmanager_durable,
            ConsumerConfig(
                ack_policy=AckPolicy.EXPLICIT,
                deliver_policy=DeliverPolicy.NEW,
                ack_wait=30,
                max_deliver=5,
            ),
        )

    async def run(self, ready: Callable[[], None]) -> None:
        headers = basic_auth(self.config)
        tls = client_context(
            self.config.alertmanager_ca, self.config.alertmanager_cert, self.config.alertmanager_key
        )
        connector = aiohttp.TCPConnector(ssl=tls if tls is not None else True)
        async with aiohttp.ClientSession(headers=headers, connector=connector) as session:
            self.outboxes = [
                Outbox(url, session, self.config, self.metrics)
                for url in self.config.alertmanager_urls
            ]
            consumer = self._events_consumer()
            await consumer.open()
            await self.windows.refresh()
            tasks = [asyncio.create_task(outbox.run()) for outbox in self.outboxes]
            tasks.append(asyncio.create_task(self.windows.follow()))
            tasks.append(
                asyncio.create_task(
                    consume_forever(
                        consumer,
                        self.on_event,
                        batch=BATCH,
                        wait=5.0,
                        what="alertmanager",
                        dropped=lambda reason: self.metrics.am_dropped.labels(reason).inc(),
                    )
                )
            )
            ready()
            try:
                while True:
                    self.check_conditions(time.time())
                    done = [task for task in tasks if task.done()]
                    for task in done:
                        task.result()  # a failed sender or consumer restarts the actor
                    await asyncio.sleep(CHECK_EVERY)
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                await consumer.close()


def basic_auth(config: AggregatorConfig) -> dict[str, str]:
    """The Authorization header of HTTP basic auth for Alertmanager, from
    ``alertmanager_username`` and the first line of ``alertmanager_password_file``; no
    header without a username."""
    if not config.alertmanager_username:
        return {}
    try:
        password = Path(config.alertmanager_password_file).read_text().splitlines()[0]
    except (OSError, IndexError):
        raise ConfigError(
            f"alertmanager_password_file: {config.alertmanager_password_file!r} is not a "
            "readable file with the password on its first line"
        ) from None
    pair = f"{config.alertmanager_username}:{password}".encode()
    return {"Authorization": "Basic " + base64.b64encode(pair).decode()}
