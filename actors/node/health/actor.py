"""Health actor: turns the node's own events into a scored, explained ``Health`` event.

It listens to the node's ``sample``, ``engine``, ``latency``, ``scheduler`` and ``settings``
(the fleet's live settings: thresholds, intervals, expected GPUs) events and publishes
``Health`` on ``fleet.evt.<node>.health`` every ``health_interval`` (jittered, so a fleet
never reports in lock-step). Sample-driven checks (boot, nvml, xid, and the GPU hardware
checks of :mod:`.gpu_checks`) are judged on every sample and pass through a latch, so a
condition clears only after ``clear_after_samples`` good samples in a row; the score's
status and the dependencies check go through the same latch once per published Health.
Freshness is judged on the agent's own monotonic clock (time of receipt), never on the
senders' timestamps.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from actors.node.config import AgentConfig
from actors.node.events import NodeEvents
from actors.node.gpu.thresholds import parse_gpu_thresholds, thresholds
from actors.node.gpu.xid import XidTracker, parse_thresholds
from actors.node.health import checks, gpu_checks, scoring
from actors.node.tuning import retuned
from actors.runtime.bus import Bus
from actors.runtime.schedule import sleep_jittered
from actors.runtime.subscriptions import listening
from schemas.events import Engine, Event, Health, HealthCheck, Latency, Sample, Scheduler
from schemas.settings import Settings
from schemas.subjects import (
    EVENT_ENGINE,
    EVENT_HEALTH,
    EVENT_LATENCY,
    EVENT_SAMPLE,
    EVENT_SCHEDULER,
    EVENT_SETTINGS,
    Subjects,
)

log = logging.getLogger(__name__)


FIRST_REPORT_DELAY = 1.0


class HealthActor:
    """Subscribes to fleet.evt.<node>.{sample,engine,latency,scheduler,settings}; publishes
    Health on fleet.evt.<node>.health."""

    name = "health"

    def __init__(
        self,
        config: AgentConfig,
        bus: Bus,
        events: NodeEvents,
        *,
        search_path: str | None = None,
        proc_modules: Path = Path("/proc/modules"),
        sys_module: Path = Path("/sys/module"),
    ) -> None:
        self.config = config
        self.bus = bus
        self.events = events
        self.search_path = search_path
        self.proc_modules = proc_modules
        self.sys_module = sys_module
        subjects = Subjects(config.prefix)
        self.subject = subjects.event(config.node_id, EVENT_HEALTH)
        self.sources = {
            EVENT_SAMPLE: subjects.event(config.node_id, EVENT_SAMPLE),
            EVENT_ENGINE: subjects.event(config.node_id, EVENT_ENGINE),
            EVENT_LATENCY: subjects.event(config.node_id, EVENT_LATENCY),
            EVENT_SCHEDULER: subjects.event(config.node_id, EVENT_SCHEDULER),
            EVENT_SETTINGS: subjects.event(config.node_id, EVENT_SETTINGS),
        }
        self.latch = checks.Latch(config.clear_after_samples)
        self.xids = XidTracker(parse_thresholds(config.xid_thresholds))
        self.gpu_judge = gpu_checks.GpuJudge(parse_gpu_thresholds(config.gpu_thresholds))
        self.started = time.monotonic()
        self.sample: Sample | None = None
        self.engine: Engine | None = None
        self.latency: Latency | None = None
        self.scheduler: Scheduler | None = None
        self.received: dict[str, float] = {}
        self.sample_checks: dict[str, HealthCheck] = {}

    async def _on_event(self, event: Event) -> None:
        match event:
            case Sample():
                self.observe_sample(event)
                kind = EVENT_SAMPLE
            case Engine():
                self.engine = event
                kind = EVENT_ENGINE
            case Latency():
                self.latency = event
                kind = EVENT_LATENCY
            case Scheduler():
                self.scheduler = event if event.kind == "slurm" else None
                kind = EVENT_SCHEDULER
            case Settings():
                self.retune(event)
                return
            case _:
                return
        self.received[kind] = time.monotonic()

    def retune(self, event: Settings) -> None:
        """Take the fleet's live settings: intervals, the GPU count, dependencies and the
        clearing count are read where used; the thresholds are rebuilt (rates and XID
        counts seen so far are kept)."""
        config = retuned(self.config, event)
        if config is self.config:
            return
        self.config = config
        self.latch.clear_after = config.clear_after_samples
        self.xids.thresholds = parse_thresholds(config.xid_thresholds)
        self.gpu_judge.table = thresholds(parse_gpu_thresholds(config.gpu_thresholds))

    def hot_limit(self) -> float | None:
        """The temperature above which a GPU degrades the nvml check (None: off)."""
        entry = self.gpu_judge.table.get("temperature")
        return entry.limit if entry is not None else None

    def observe_sample(self, sample: Sample) -> None:
        """Judge the sample-driven checks on this sample, through the latch."""
        self.sample = sample
        self.xids.observe(sample.gpus)
        gpu_found = self.gpu_judge.checks(sample)
        if not gpu_found:
            # No GPU readings (none on the node, or NVML failing: the nvml check says so):
            # no GPU hardware verdict, rather than the last one kept for ever.
            for name in gpu_checks.CHECK_NAMES:
                self.sample_checks.pop(name, None)
        for check in (
            checks.boot_check(sample, self.config.expected_gpus),
            checks.nvml_check(sample, self.config.expected_gpus, self.hot_limit()),
            self.xids.check(time.time()),
            *gpu_found,
        ):
            self.sample_checks[check.name] = self.latch.update(check)

    def feeds(self) -> dict[str, checks.Feed]:
        """The event streams the score depends on; engine only when engines are configured."""
        periods = {
            EVENT_SAMPLE: self.config.sample_interval,
            EVENT_LATENCY: self.config.probe_interval,
        }
        if self.config.engines:
            periods[EVENT_ENGINE] = self.config.engine_interval
        return {
            name: checks.Feed(name=name, period=period, received_at=self.received_since(name))
            for name, period in periods.items()
        }

    def received_since(self, name: str) -> float | None:
        """When the feed last counted as received: its latest event, or the moment the
        bus came back if later (the node's own events travel over the bus: an outage
        delays them, it does not make the sensors stale; the bus outage is one event of
        its own)."""
        received = self.received.get(name)
        back = self.bus.reconnected_at
        if received is None or back is None:
            return received
        return max(received, back)

    def assess(self) -> Health:
        now = time.monotonic()
        feeds = self.feeds()

        def fresh(name: str) -> bool:
            return name in feeds and feeds[name].fresh(now)

        def missing(name: str) -> str:
            return checks.missing_reason(feeds[name], now, self.started)

        sample = self.sample if fresh(EVENT_SAMPLE) else None
        engine = self.engine if fresh(EVENT_ENGINE) else None
        latency = self.latency if fresh(EVENT_LATENCY) else None
        engine_missing = missing(EVENT_ENGINE) if EVENT_ENGINE in feeds else ""
        components = [
            scoring.engine_component(engine, len(self.config.engines), engine_missing),
            scoring.temperature_component(sample, missing(EVENT_SAMPLE)),
            scoring.vram_component(sample, missing(EVENT_SAMPLE)),
            scoring.cpu_component(sample, missing(EVENT_SAMPLE)),
            scoring.latency_component(latency, missing(EVENT_LATENCY)),
        ]
        score = sum(component.points for component in components)
        score_check = self.latch.update(scoring.score_check(score))
        dependencies = self.latch.update(
            checks.dependencies_check(
                self.config.required_binaries,
                self.config.required_modules,
                search_path=self.search_path,
                proc_modules=self.proc_modules,
                sys_module=self.sys_module,
            )
        )
        scheduler = []
        if self.scheduler is not None:
            scheduler.append(self.latch.update(checks.scheduler_check(self.scheduler)))
        found = [
            *self.sample_checks.values(),
            dependencies,
            *scheduler,
            checks.freshness_check(feeds.values(), now, self.started),
        ]
        status = checks.overall([score_check, *found])
        return Health(
            ts=time.time(),
            status=status,
            score=scoring.capped(score, status),
            components=components,
            checks=found,
        )

    async def run(self, ready: Callable[[], None]) -> None:
        routes = {
            subject: self.events.decoding(self.name, self._on_event)
            for subject in self.sources.values()
        }
        async with listening(self.bus, routes, ready):
            # The first report comes early (once the first samples are in), not a whole
            # interval after start.
            delay = min(self.config.health_interval, FIRST_REPORT_DELAY)
            while True:
                await sleep_jittered(delay)
                health = self.assess()
                await self.events.publish(self.bus, self.subject, health)
                delay = self.config.health_interval
