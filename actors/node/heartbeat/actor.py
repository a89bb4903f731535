"""Heartbeat actor: folds the node's latest events into a signed Heartbeat on JetStream.

Each heartbeat carries ``Nats-TTL`` (the server deletes it, and drops a marker, if no
newer one comes) and ``Nats-Msg-Id: <node>:<boot_id>:<seq>`` (the server drops replays).
A change of schedulability is published at once, not at the next interval.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import Callable

import msgspec
import nats.errors

from actors.node.config import AgentConfig
from actors.node.events import NodeEvents
from actors.node.gpu.capacity import with_workloads
from actors.node.heartbeat.sequence import SequenceStore
from actors.node.labels import clashes, cloud_labels, found_labels, node_labels
from actors.node.tuning import retuned
from actors.runtime.bus import PUBLISH_TIMEOUT, Bus, publish_signed, unanswered
from actors.runtime.schedule import jittered, stop_if_cancelled, wait_or_timeout
from actors.runtime.subscriptions import listening
from schemas.base import Schedulability
from schemas.events import (
    CloudFacts,
    Engine,
    Event,
    Gateway,
    Health,
    Interruption,
    Jobs,
    Latency,
    NodeState,
    Sample,
    Scheduler,
    SpotStatus,
    Workloads,
)
from schemas.messages import MAX_HEARTBEAT_WORKLOADS, Heartbeat, WorkloadSummary
from schemas.settings import Settings, SettingsStatus
from schemas.subjects import Subjects
from schemas.version import AGENT_VERSION

log = logging.getLogger(__name__)

NOT_ACKNOWLEDGED_HINT = (
    " (has an aggregator created the fleet's streams?); retried every beat, logged again "
    "when the cause changes"
)
FIRST_SAMPLE_WAIT = 2.0
"""Seconds the first beat waits for the inventory's first sample and the command
executor's first state (each its own wait, within this bound)."""
ACK_WAIT_FRACTION = 0.5
"""A beat waits for its acknowledgement at most this fraction of the interval (and never
more than the bus's publish timeout): the next beat is due one interval after this one
started, acknowledged or not, so a stream without a leader for a few seconds costs the
beats of those seconds, not an interval plus a timeout each."""


def summarise(event: Workloads) -> list[WorkloadSummary]:
    """The heartbeat's view of the workloads: names, models and reasons cut to a name's
    length, GPU indices a node can have, at most MAX_HEARTBEAT_WORKLOADS."""
    return [
        WorkloadSummary(
            name=workload.name[:128],
            engine=workload.engine,
            state=workload.state,
            since=workload.since,
            port=min(workload.port, 65535),
            gpus=[gpu for gpu in workload.gpus if gpu < 64],
            model=workload.model[-128:],
            restarts=workload.restarts,
            reason=workload.reason[:128],
            container=workload.container[:128],
            placed=workload.placed,
        )
        for workload in event.workloads[:MAX_HEARTBEAT_WORKLOADS]
    ]


class HeartbeatActor:
    """Subscribes to fleet.evt.<node>.*; publishes signed Heartbeat on fleet.hb.<cluster>.<node>."""

    name = "heartbeat"

    def __init__(
        self,
        config: AgentConfig,
        bus: Bus,
        events: NodeEvents,
        sequence: SequenceStore,
    ) -> None:
        self.config = config
        self.bus = bus
        self.events = events
        self.key = events.key
        self.sequence = sequence
        self.metrics = events.metrics
        self.subjects = Subjects(config.prefix)
        self.subject = self.subjects.heartbeat(config.cluster, config.node_id)
        self.boot_id = uuid.uuid4().hex[:16]
        self.sample: Sample | None = None
        self.health: Health | None = None
        self.latency: Latency | None = None
        self.engine: Engine | None = None
        self.cloud: dict[str, str] = {}
        self.state = NodeState(ts=time.time(), schedulability="schedulable")
        provider = config.spot_provider
        # A configured cloud shows at once; `auto` shows once a notice names the cloud.
        self.spot = SpotStatus(provider=provider if provider in ("aws", "gcp", "azure") else "none")
        self.workloads: list[WorkloadSummary] = []
        self.capabilities: list[str] | None = None
        """What the node can run, as its workload actor last said (None before it did)."""
        self.endpoint = ""
        """The gateway's URL for clients outside the node, from its event."""
        self.scheduler: Scheduler | None = None
        self.settings: SettingsStatus | None = None
        """What the node made of the fleet's settings (from the settings actor)."""
        self.stopping = False
        """Set by :meth:`goodbye`: its beat is the last; the loop beats no more."""
        self._one_beat = asyncio.Lock()
        """Held while a beat is built and sent: the goodbye waits for a beat in flight and
        is never sent beside one (two beats a moment apart on a subject that keeps one)."""
        self._last_ts: float | None = None
        self._failing = ""
        """Why the last beat was not acknowledged ("" when it was)."""
        self._clashed: set[str] = set()
        """Label keys whose clash with the operator's label was logged."""
        self._beat_now = asyncio.Event()
        self._first_sample = asyncio.Event()
        self._first_state = asyncio.Event()

    async def _on_event(self, event: Event) -> None:
        match event:
            case Sample():
                self.sample = event
                self._first_sample.set()
            case Health():
                self.health = event
            case Latency():
                self.latency = event
            case Engine():
                self.engine = event
            case CloudFacts():
                self.cloud = cloud_labels(event)
            case Interruption():
                self.spot = SpotStatus(provider=event.provider, notice=event)
                self._beat_now.set()
            case Workloads():
                self.workloads = summarise(event)
                self.capabilities = event.capabilities
            case Gateway():
                self.endpoint = event.endpoint if event.serving else ""
            case Scheduler():
                before = self.schedulability()
                self.scheduler = event if event.kind == "slurm" else None
                # Slurm's own drains change what the heartbeat says at once.
                if self.schedulability() != before:
                    self._beat_now.set()
            case Settings():
                # heartbeat_interval and stale_after are read at each beat.
                self.config = retuned(self.config, event)
                self.settings = event.status
            case NodeState():
                changed = (event.schedulability, event.deregistering) != (
                    self.state.schedulability,
                    self.state.deregistering,
                )
                self.state = event
                self._first_state.set()
                if changed:
                    self._beat_now.set()

    def schedulability(self) -> tuple[Schedulability, str, str]:
        """Ours, unless we have the node schedulable and Slurm has it drained (an admin, or
        an agent before a restart): then Slurm's drain shows, with Slurm's reason, as
        ``cordoned`` while jobs run and ``drained`` once none does. Slurm's drain is only
        reported here, never lifted. The third item says who (NodeState.by, or ``slurm``)."""
        state, reason = self.state.schedulability, self.state.reason
        by = self.state.by if state != "schedulable" else ""
        slurm = self.scheduler
        if state == "schedulable" and slurm is not None and slurm.drain:
            state = "drained" if slurm.jobs.running_count == 0 else "cordoned"
            reason = f"slurm: {slurm.state_reason or slurm.slurm_state}"
            by = "slurm"
        return state, reason, by

    def labels(self) -> dict[str, str]:
        """The operator's labels, then the node's own (actors/node/labels.py); the first
        time a node label is left out for an operator's label of another value, a warning
        names both (the operator's is kept, whatever the node finds)."""
        given = self.config.labels
        found = found_labels(self.sample, self.cloud, self.engine)
        for key, (kept, left) in clashes(given, found).items():
            if key not in self._clashed:
                self._clashed.add(key)
                log.warning(
                    "an operator's label overrides what the node found",
                    extra={"label": key, "operator": kept, "found": left},
                )
        return node_labels(given, found)

    def sample_now(self) -> Sample | None:
        """The latest sample, with the GPUs the workloads pin taken and, where Slurm
        answers, the cores its jobs have not allocated as ``cpu_cores_available`` (what
        an HPC scheduler places by; the sample's own is the idle share)."""
        if self.sample is None:
            return None
        sample = with_workloads(self.sample, self.workloads)
        slurm = self.scheduler
        if slurm is None or not slurm.reachable or slurm.cpus_total is None:
            return sample
        free = max(0, slurm.cpus_total - (slurm.cpus_allocated or 0))
        capacity = msgspec.structs.replace(sample.capacity, cpu_cores_available=free)
        return msgspec.structs.replace(sample, capacity=capacity)

    def build(self) -> Heartbeat:
        running = self.engine.in_flight if self.engine and self.engine.in_flight else 0
        # Requests queued in the engines (vLLM/SGLang waiting, llama.cpp deferred): what a
        # scheduler places by, next to what runs.
        waiting = sum(status.waiting or 0 for status in self.engine.engines) if self.engine else 0
        schedulability, reason, by = self.schedulability()
        now, previous = time.time(), self._last_ts
        self._last_ts = now
        return Heartbeat(
            node_id=self.config.node_id,
            cluster=self.config.cluster,
            seq=self.sequence.next(),
            boot_id=self.boot_id,
            ts=now,
            agent_version=AGENT_VERSION,
            interval=self.config.heartbeat_interval,
            stale_after=self.config.stale_after,
            schedulability=schedulability,
            schedulability_reason=reason,
            schedulability_by=by,
            sample=self.sample_now(),
            health=self.health,
            latency=self.latency,
            engine=self.engine,
            jobs=Jobs(running=running, waiting=waiting),
            spot=self.spot,
            deregistering=self.state.deregistering,
            workloads=self.workloads,
            labels=self.labels(),
            scheduler=self.scheduler,
            stopping=self.stopping,
            previous_ts=previous,
            endpoint=self.endpoint,
            capabilities=self.capabilities,
            settings=self.settings,
            started=self.metrics.started,
        )

    @property
    def ack_wait(self) -> float:
        """How long a beat waits for its acknowledgement: a fraction of the interval in
        force (the fleet may change it live), at most a publish's timeout."""
        return min(PUBLISH_TIMEOUT, ACK_WAIT_FRACTION * self.config.heartbeat_interval)

    async def beat(self) -> Heartbeat | None:
        """One beat of the loop; none once the goodbye is said."""
        async with self._one_beat:
            if self.stopping:
                return None
            return await self._send()

    async def _send(self, ack_wait: float | None = None) -> Heartbeat | None:
        """Build, sign and publish a beat, waiting ``ack_wait`` (:attr:`ack_wait` if None)
        for its acknowledgement; the beat, or None if it was not acknowledged."""
        heartbeat = self.build()
        self.metrics.observe_heartbeat(heartbeat)
        try:
            ack, size = await publish_signed(
                self.bus,
                self.subject,
                heartbeat,
                self.key,
                f"{heartbeat.node_id}:{heartbeat.boot_id}:{heartbeat.seq}",
                headers={"Nats-TTL": str(math.ceil(self.config.stale_after))},
                # The command executor waits for its deregistering beat: tagged, it can
                # tell this process's beat from one sent with a copy of the node key.
                tag=self.events.session.headers,
                timeout=self.ack_wait if ack_wait is None else ack_wait,
            )
        except (nats.errors.Error, TimeoutError) as exc:
            if unanswered(exc):
                self.bus.jetstream_answered(False)
            self.metrics.heartbeat_failures.inc()
            reason = str(exc) or type(exc).__name__
            # Once per cause, not once per beat: a server without FLEET_HB yet (no
            # aggregator started) would otherwise log every beat until one comes.
            level = logging.WARNING if reason != self._failing else logging.DEBUG
            self._failing = reason
            log.log(
                level,
                "heartbeat not acknowledged" + NOT_ACKNOWLEDGED_HINT,
                extra={"seq": heartbeat.seq, "reason": reason},
            )
            return None
        self.bus.jetstream_answered(True)
        if self._failing:
            log.info("heartbeats acknowledged again", extra={"seq": heartbeat.seq})
            self._failing = ""
        health = heartbeat.health
        log.debug(
            "heartbeat sent and acknowledged",
            extra={
                "seq": heartbeat.seq,
                "stream_seq": ack.seq,
                "bytes": size,
                "health": health.status if health is not None else None,
                "health_score": health.score if health is not None else None,
            },
        )
        self.metrics.heartbeats.inc()
        self.metrics.sequence.set(heartbeat.seq)
        return heartbeat

    async def goodbye(self) -> None:
        """The last heartbeat of this boot, marked ``stopping``, for a requested stop: the
        aggregators mark the node ``stopped`` instead of calling it stale when the
        heartbeat's TTL runs out. Sent only by an actor that has beaten (one that never
        did has no record to say goodbye to); a failure is logged, as any beat's. It and
        the beat in flight it waits for share one :attr:`ack_wait`, so a stop takes no
        longer than before (systemd's TimeoutStopSec counts it); one left no time is
        still sent, its acknowledgement not waited for."""
        if self._last_ts is None:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.ack_wait
        async with self._one_beat:
            self.stopping = True
            await self._send(ack_wait=max(0.0, deadline - loop.time()))

    async def run(self, ready: Callable[[], None]) -> None:
        routes = {
            self.subjects.events(self.config.node_id): self.events.decoding(
                self.name, self._on_event
            )
        }
        async with listening(self.bus, routes, ready):
            # A first beat without inventory would show a node with no GPUs; wait briefly.
            if not await wait_or_timeout(self._first_sample, FIRST_SAMPLE_WAIT):
                log.warning("no inventory sample yet; beating without one")
            # Nor one saying "schedulable" for a node restarted cordoned or drained: the
            # command executor publishes the state it restored when it starts.
            if not await wait_or_timeout(self._first_state, FIRST_SAMPLE_WAIT):
                log.warning("no node state from the command executor yet; beating without it")
            # Back on the bus after an outage: beat at once, not an interval later, so the
            # aggregators see it alive before its marker is judged.
            self.bus.on_reconnect(self._beat_now.set)
            loop = asyncio.get_running_loop()
            while True:
                self._beat_now.clear()
                due = loop.time() + jittered(self.config.heartbeat_interval)
                await self.beat()
                stop_if_cancelled()  # a stop asked as the ack came must not be lost
                await wait_or_timeout(self._beat_now, max(0.0, due - loop.time()))
