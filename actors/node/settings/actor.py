"""Settings actor: follows the fleet's settings for this node and tells its actors.

Every ``settings_interval`` (jittered) it reads KV ``fleet_settings`` once
(:mod:`.bucket`), takes the entries :class:`.entries.Held` accepts, judges them for this
node (:func:`.effective.judge`: its cluster, and the labels of its own last heartbeat,
which it reads as the command executor does) and publishes ``Settings`` on
``fleet.evt.<node>.settings``: every live value, which the actors that read them take
(:mod:`actors.node.tuning`), and the status the heartbeat carries. It publishes after
every read, changed or not, so an actor that starts late learns the settings within one
interval. The log level it applies itself (to the process's root logger). A bucket that
cannot be read leaves the settings as they are.

:func:`at_start` is the same read made once by the agent before it builds its actors, so
the settings read only at start (``restart`` in :mod:`.table`) are taken then.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping

import nats.errors
from nats.aio.msg import Msg

from actors.node.config import AgentConfig
from actors.node.events import NodeEvents
from actors.node.metrics import AgentMetrics
from actors.node.settings.bucket import take_latest
from actors.node.settings.effective import Outcome, judge
from actors.node.settings.entries import IGNORE_REASONS, TAKEN, Held
from actors.runtime.bus import Bus
from actors.runtime.config import Layers
from actors.runtime.schedule import sleep_jittered
from actors.runtime.subscriptions import listening
from schemas import codec
from schemas.errors import DecodeError
from schemas.messages import Heartbeat
from schemas.settings import Settings
from schemas.subjects import EVENT_SETTINGS, Subjects

log = logging.getLogger(__name__)

READ_TIMEOUT = 5.0
"""Seconds one read of the bucket may take."""


class SettingsActor:
    """Reads KV ``fleet_settings`` and its own heartbeats (for its labels); publishes
    ``Settings`` on ``fleet.evt.<node>.settings``."""

    name = "settings"

    def __init__(
        self,
        config: AgentConfig,
        bus: Bus,
        events: NodeEvents,
        layers: Layers[AgentConfig],
        held: Held,
    ) -> None:
        self.config = config
        """The config the agent started with (fleet values taken at start included)."""
        self.bus = bus
        self.events = events
        self.layers = layers
        self.held = held
        self.metrics = events.metrics
        self.subjects = Subjects(config.prefix)
        self.subject = self.subjects.event(config.node_id, EVENT_SETTINGS)
        self.beats = self.subjects.heartbeat(config.cluster, config.node_id)
        self.outcome: Outcome | None = None
        self._judged: object = None
        self._level: str = config.log_level
        self._failing = ""
        for reason in IGNORE_REASONS:
            self.metrics.settings_ignored.labels(reason)

    async def _on_beat(self, msg: Msg) -> None:
        """This process's own heartbeat: the labels the fleet selects this node by."""
        try:
            heartbeat = codec.decode(msg.data, Heartbeat, msg.subject)
        except DecodeError:
            return
        if heartbeat.labels != self.held.labels:
            self.held.labels = dict(heartbeat.labels)
            self.held.save()

    async def refresh(self) -> Outcome:
        """Read the bucket, judge, apply the log level and tell the actors."""
        trusted = self.config.operator_keys()
        try:
            counts = await take_latest(
                self.bus, self.subjects, self.config.cluster, self.held, trusted, READ_TIMEOUT
            )
        except (nats.errors.Error, TimeoutError) as exc:
            reason = str(exc) or type(exc).__name__
            level = logging.WARNING if reason != self._failing else logging.DEBUG
            log.log(level, "fleet settings not read; kept as they are", extra={"reason": reason})
            self._failing = reason
        else:
            self._failing = ""
            record(self.metrics, counts, self.held)
        outcome = self.judged(trusted)
        self._apply_level(outcome.config.log_level)
        await self.events.publish(
            self.bus,
            self.subject,
            Settings(ts=time.time(), status=outcome.status, live=outcome.live),
        )
        return outcome

    def judged(self, trusted: set[str]) -> Outcome:
        """The judgment of the held entries, made again only when they, the labels or the
        trusted keys changed."""
        entries = self.held.trusted_entries(trusted)
        inputs = (
            sorted((key, entry.revision) for key, entry in entries),
            sorted(self.labels().items()),
            sorted(trusted),
        )
        if self.outcome is None or inputs != self._judged:
            self.outcome = judge(self.layers, entries, self.labels(), started=self.config)
            self._judged = inputs
            status = self.outcome.status
            self.metrics.settings_revision.set(status.revision)
            self.metrics.settings_refused.set(len(status.refused))
            self.metrics.settings_restart.set(len(status.restart))
            if status.refused:
                log.warning("fleet settings refused", extra={"refused": status.refused})
        return self.outcome

    def labels(self) -> dict[str, str]:
        return {**self.held.labels, **self.config.labels}

    def _apply_level(self, level: str) -> None:
        if level == self._level:
            return
        self._level = level
        logging.getLogger().setLevel(level.upper())
        log.info("log level set by the fleet's settings", extra={"level": level})

    async def run(self, ready: Callable[[], None]) -> None:
        routes = {self.beats: self.events.own(self.name, self._on_beat)}
        async with listening(self.bus, routes, ready):
            while True:
                outcome = await self.refresh()
                await sleep_jittered(outcome.config.settings_interval)


def record(metrics: AgentMetrics, counts: Mapping[str, int], held: Held) -> None:
    """Count what a read ignored (one log line for the read, each stored message once),
    and keep what it took."""
    ignored = {reason: count for reason, count in counts.items() if reason != TAKEN}
    for reason, count in ignored.items():
        metrics.settings_ignored.labels(reason).inc(count)
    if ignored:
        log.warning("fleet settings entries ignored", extra={"ignored": ignored})
    if counts.get(TAKEN):
        held.save()


async def at_start(
    bus: Bus, layers: Layers[AgentConfig], held: Held, metrics: AgentMetrics
) -> Outcome:
    """The settings the agent starts with: the entries held from the last run, and those
    one read of the bucket brings (a read that fails is logged and starts without it)."""
    own = layers.build()
    trusted = own.operator_keys()
    held.load(trusted)
    subjects = Subjects(own.prefix)
    try:
        counts = await take_latest(bus, subjects, own.cluster, held, trusted, READ_TIMEOUT)
    except (nats.errors.Error, TimeoutError) as exc:
        log.info(
            "fleet settings not read at start; the held ones apply",
            extra={"reason": str(exc) or type(exc).__name__},
        )
    else:
        record(metrics, counts, held)
    labels = {**held.labels, **own.labels}
    return judge(layers, held.trusted_entries(trusted), labels)
