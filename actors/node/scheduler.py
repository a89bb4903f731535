"""Scheduler actor: the node as its workload manager (Slurm) sees it, published as ``Scheduler``.

On HPC nodes Slurm places the work, so the fleet must see what Slurm sees: the node's state
and reason (an admin's drain included), the jobs running and pending on it, the jobs that
ended in the last 24 h (when accounting is configured), and whether ``slurmd``, ``munged``
and a container runtime are there. Every Slurm tool runs as a subprocess with a timeout,
off the heartbeat path; a missing or failing Slurm is reported with its reason (the health
actor makes it a finding), never raised. With ``--scheduler auto`` a node where Slurm has
never answered reports ``kind: none``: it is not an HPC node.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from actors.node import slurm
from actors.node.config import AgentConfig
from actors.node.events import NodeEvents
from actors.node.tuning import retuned
from actors.runtime.bus import Bus
from actors.runtime.schedule import sleep_jittered
from actors.runtime.subscriptions import listening
from schemas.events import Event, Scheduler, SchedulerJobs
from schemas.settings import Settings
from schemas.subjects import EVENT_SCHEDULER, EVENT_SETTINGS, Subjects

log = logging.getLogger(__name__)

SLOW_EVERY = 300.0
"""``sacct`` (a slurmdbd query) and the node's partitions (``sinfo``, which rarely change)
are asked at most this often; a fleet of thousands of nodes must not hammer slurmdbd."""


class SchedulerActor:
    """Subscribes to fleet.evt.<node>.settings (runs Slurm's tools); publishes Scheduler
    on fleet.evt.<node>.scheduler."""

    name = "scheduler"

    def __init__(self, config: AgentConfig, bus: Bus, events: NodeEvents) -> None:
        self.config = config
        self.bus = bus
        self.events = events
        self.subject = Subjects(config.prefix).event(config.node_id, EVENT_SCHEDULER)
        self.settings_subject = Subjects(config.prefix).event(config.node_id, EVENT_SETTINGS)
        self.node_name = config.slurm_node
        self.detected = config.scheduler == "slurm"
        """Slurm is this node's scheduler: configured so, or it answered once under auto."""
        self._slow_at: float | None = None
        self._history: tuple[int | None, int | None, str] = (None, None, "not asked yet")
        self._partitions: list[str] = []

    async def jobs(self) -> SchedulerJobs:
        """Running and pending now (squeue), completed and failed over 24 h (sacct, at most
        every SLOW_EVERY); each None when Slurm cannot say."""
        name, timeout = self.node_name, self.config.scheduler_timeout
        now = time.monotonic()
        if self._slow_at is None or now - self._slow_at >= SLOW_EVERY:
            self._slow_at = now
            self._history = await slurm.history(name, timeout)
            try:
                self._partitions = await slurm.partitions(name, timeout)
            except slurm.SlurmError as exc:
                log.debug("sinfo failed", extra={"reason": str(exc)})
        running: int | None = None
        pending: int | None = None
        try:
            running = await slurm.running_jobs(name, timeout)
            pending = await slurm.pending_jobs(self._partitions, timeout)
        except slurm.SlurmError as exc:
            log.debug("squeue failed", extra={"reason": str(exc)})
        completed, failed, reason = self._history
        return SchedulerJobs(
            running_count=running,
            pending_count=pending,
            completed_24h=completed,
            failed_24h=failed,
            history_reason=reason,
        )

    async def observe(self) -> Scheduler:
        """One look at Slurm; every failure is a reason in the event."""
        if self.config.scheduler == "none":
            return Scheduler(ts=time.time(), kind="none", reason="scheduler none configured")
        timeout = self.config.scheduler_timeout
        try:
            info = await slurm.node_info(self.node_name, timeout)
        except slurm.SlurmError as exc:
            if not self.detected:
                return Scheduler(ts=time.time(), kind="none", reason=f"no Slurm: {exc}")
            log.warning("Slurm not answering", extra={"node": self.node_name, "reason": str(exc)})
            return Scheduler(
                ts=time.time(),
                kind="slurm",
                node_name=self.node_name,
                reachable=False,
                reason=str(exc),
                services=await slurm.services(timeout),
            )
        if not self.detected:
            log.info("Slurm detected", extra={"node": self.node_name})
        self.detected = True
        jobs, services = await asyncio.gather(self.jobs(), slurm.services(timeout))
        return Scheduler(
            ts=time.time(),
            kind="slurm",
            node_name=self.node_name,
            reachable=True,
            slurm_state=info.state,
            state_reason=info.reason,
            drain=info.drain,
            ours=info.ours,
            jobs=jobs,
            services=services,
            cpus_total=info.cpus_total,
            cpus_allocated=info.cpus_allocated,
        )

    async def _on_settings(self, event: Event) -> None:
        """The fleet's interval and timeout for looks at Slurm (read at each look)."""
        if isinstance(event, Settings):
            self.config = retuned(self.config, event)

    async def run(self, ready: Callable[[], None]) -> None:
        routes = {self.settings_subject: self.events.decoding(self.name, self._on_settings)}
        async with listening(self.bus, routes, ready):
            await self._observe_forever()

    async def _observe_forever(self) -> None:
        while True:
            scheduler = await self.observe()
            await self.events.publish(self.bus, self.subject, scheduler)
            await sleep_jittered(self.config.scheduler_interval)
