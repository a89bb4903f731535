"""What an accepted command does to the node, one action at a time, and how it is reported.

Cordon (optionally lifted by a TTL), uncordon, drain (until in-flight work is done or the
deadline passes, reporting progress) and deregister (a drain, then a heartbeat that says
the node is leaving). The newest action wins: starting one cancels the one in progress,
which is answered ``failed``. Every step is a node-signed CommandResult on FLEET_EVENTS and
every change of schedulability a NodeState event; the command store keeps what a restart
must not lose, so :meth:`ActionRunner.resume` picks up an interrupted drain or cordon TTL.
Where commands come from, and when to act on a spot notice, is the command executor's
business (:mod:`actors.node.commands.actor`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import nats.errors

from actors.node import deregistration, slurm
from actors.node.commands.hooks import run_hook
from actors.node.commands.store import CommandStore
from actors.node.config import AgentConfig
from actors.node.events import NodeEvents
from actors.node.results import ResultPublisher
from actors.runtime.bus import Bus
from actors.runtime.schedule import wait_or_timeout
from schemas import events
from schemas.base import Schedulability
from schemas.events import Scheduler
from schemas.messages import (
    FINAL_STATUSES,
    Action,
    CommandStatus,
    Cordon,
    Deregister,
    Drain,
    Uncordon,
)
from schemas.subjects import EVENT_STATE, Subjects

log = logging.getLogger(__name__)

PROGRESS_EVERY = 2.0
"""A drain reports progress at least this often, and whenever in-flight work changes."""
SLURM_POLL = 1.0
"""A drain through Slurm asks squeue for the node's running jobs this often."""

Work = Coroutine[Any, Any, None]


class ActionRunner:
    """The node's schedulability: the action in progress, its TTL timer, its reports."""

    def __init__(
        self, config: AgentConfig, bus: Bus, node_events: NodeEvents, store: CommandStore
    ) -> None:
        self.config = config
        self.bus = bus
        self.node_events = node_events
        """Where the node's state is published: tagged by this process, which its actors
        act on."""
        self.store = store
        self.subjects = Subjects(config.prefix)
        self.results = ResultPublisher(config, bus, node_events.key)
        self.lock = asyncio.Lock()
        """Held from deciding on an action until it has started, so decisions never interleave."""
        self.finished = asyncio.Event()
        """Set once the node has deregistered: the agent's work is over."""
        self.in_flight = 0
        self.placed = 0
        """Workloads placed by the fleet still here: a drain waits for the fleet to move them."""
        self.scheduler: Scheduler | None = None
        """The scheduler actor's latest word: whether Slurm is this node's scheduler."""
        self._engine_changed = asyncio.Event()
        self._deregistered_beat = asyncio.Event()
        self._leaving: events.NodeState | None = None
        """The deregistering state while a deregistration waits for its heartbeat: what is
        republished then (the stored state is the drained one a restart comes back to)."""
        self._work: asyncio.Task[None] | None = None
        self._work_id = ""
        self._ttl: asyncio.Task[None] | None = None
        self._digests: dict[str, str] = {}
        self._by: dict[str, str] = {}
        """Command id -> the key that signed it, for NodeState.by (dropped with the digest)."""
        """Digest of each command with results still to come, which its results name."""

    def observe_in_flight(self, in_flight: int) -> None:
        """The engines' in-flight request count changed (a drain waits for it to reach 0)."""
        self.in_flight = in_flight
        self._engine_changed.set()

    def observe_placed(self, placed: int) -> None:
        """The count of fleet-placed workloads on the node changed (a drain waits for 0)."""
        self.placed = placed
        self._engine_changed.set()

    def observe_scheduler(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    async def _slurm_on(self) -> bool:
        """Drains go through Slurm when it is configured, or auto found it (asked here
        when the scheduler actor has not said yet, e.g. a drain resumed at start)."""
        if self.config.scheduler != "auto":
            return self.config.scheduler == "slurm"
        if self.scheduler is not None:
            return self.scheduler.kind == "slurm"
        try:
            await slurm.node_info(self.config.slurm_node, self.config.scheduler_timeout)
        except slurm.SlurmError:
            return False
        return True

    async def _slurm_drain(self, command_id: str, reason: str) -> str:
        """Drain the node in Slurm with our marker; a note for the result ("" when off)."""
        if not await self._slurm_on():
            return ""
        name = self.config.slurm_node
        try:
            info = await slurm.node_info(name, self.config.scheduler_timeout)
            if info.drain and not info.ours:
                # An admin's drain stays theirs: overwriting its reason would make it ours,
                # and a later uncordon would lift it.
                return f"; Slurm already drained by its admin: {info.reason or info.state}"
            await slurm.update_node(
                name, self.config.scheduler_timeout, "drain", slurm.drain_reason(reason, command_id)
            )
        except slurm.SlurmError as exc:
            log.warning("Slurm drain failed", extra={"node": name, "reason": str(exc)})
            return f"; Slurm not drained: {exc}"
        return f"; Slurm node {name} drained"

    async def _slurm_resume(self) -> str:
        """Resume the node in Slurm only if the drain there is ours; a note for the result."""
        if not await self._slurm_on():
            return ""
        name, timeout = self.config.slurm_node, self.config.scheduler_timeout
        try:
            info = await slurm.node_info(name, timeout)
            if not info.drain:
                return ""
            if not info.ours:
                log.info("admin's Slurm drain left alone", extra={"reason": info.reason})
                return f"; Slurm drain not ours, left alone: {info.reason or info.state}"
            await slurm.update_node(name, timeout, "resume")
        except slurm.SlurmError as exc:
            log.warning("Slurm resume failed", extra={"node": name, "reason": str(exc)})
            return f"; Slurm not resumed: {exc}"
        return f"; Slurm node {name} resumed"

    async def _slurm_jobs(self) -> int | None:
        """Jobs running on the node in Slurm; None when off or Slurm cannot say."""
        if not await self._slurm_on():
            return None
        try:
            return await slurm.running_jobs(self.config.slurm_node, self.config.scheduler_timeout)
        except slurm.SlurmError as exc:
            log.warning("squeue failed during drain", extra={"reason": str(exc)})
            return None

    def observe_deregistering_beat(self) -> None:
        """A heartbeat carrying ``deregistering`` and no workload went out: the aggregators
        are told, and the workload actor has ended every workload."""
        self._deregistered_beat.set()

    async def start(
        self,
        command_id: str,
        reason: str,
        action: Action,
        deadline: float | None = None,
        digest: str = "",
        by: str = "",
    ) -> None:
        """Begin an accepted action; called with the lock held. ``deadline`` (absolute)
        overrides the drain deadline the action carries; ``digest`` names the command's
        body in every result (empty for the node's own actions); ``by`` is the key that
        signed the command (empty: the node's own action, ``spot`` or ``agent``)."""
        if digest:
            self._digests[command_id] = digest
        if by:
            self._by[command_id] = by
        current = self.store.state.schedulability
        if self.store.deregister and not isinstance(action, Deregister):
            await self.result(command_id, "failed", "node is deregistering")
        elif isinstance(action, Cordon):
            if current in ("draining", "drained"):
                await self.result(command_id, "done", f"already {current}")
                return
            await self._supersede(command_id)
            self._begin(command_id, self._cordon(command_id, reason, action.ttl))
        elif isinstance(action, Uncordon):
            await self._supersede(command_id)
            self._begin(command_id, self._uncordon(command_id, reason))
        elif isinstance(action, Drain | Deregister):
            await self._supersede(command_id)
            if deadline is None:
                deadline = time.time() + action.deadline
            deregister = isinstance(action, Deregister)
            self._begin(command_id, self._drain(command_id, reason, deadline, deregister))

    async def deregister_at_shutdown(self, within: float) -> None:
        """The agent is stopping and must deregister first, draining for at most ``within``
        seconds; called with the lock held."""
        await self._supersede("shutdown")
        await self.result("shutdown", "accepted", "agent shutting down: deregister")
        self._begin(
            "shutdown", self._drain("shutdown", "agent shutdown", time.time() + within, True)
        )

    def busy(self) -> bool:
        """An action is in progress (a drain or deregistration that shutdown waits for)."""
        return self._work is not None and not self._work.done()

    async def drain_at_shutdown(self, within: float) -> int:
        """SIGTERM: tell the fleet the node is draining and wait, at most ``within``
        seconds, for the engines' in-flight requests to finish; what was left. The state
        is published, never stored: a restarted agent comes back as it was, not drained."""
        deadline = time.monotonic() + within
        if self.store.state.schedulability in ("schedulable", "cordoned"):
            await self.publish_state(
                events.NodeState(
                    ts=time.time(),
                    schedulability="draining",
                    reason="agent shutting down",
                    command_id="shutdown",
                )
            )
        log.info("draining before shutdown", extra={"in_flight": self.in_flight, "within": within})
        while self.in_flight > 0 and (left := deadline - time.monotonic()) > 0:
            self._engine_changed.clear()
            await wait_or_timeout(self._engine_changed, left)
        if self.in_flight:
            log.warning(
                "shutdown drain timed out; stopping with work in flight",
                extra={"in_flight": self.in_flight, "within": within},
            )
        else:
            log.info("drained before shutdown")
        return self.in_flight

    async def wait_for_work(self, timeout: float) -> None:
        """Let the action in progress finish, for at most ``timeout`` seconds."""
        if self._work is not None and not self._work.done():
            _, pending = await asyncio.wait({self._work}, timeout=timeout)
            if pending:
                log.warning("command work unfinished at shutdown", extra={"id": self._work_id})

    def tasks(self) -> list[asyncio.Task[None]]:
        """The action in progress and the TTL timer, for the actor to cancel on its way out."""
        return [task for task in (self._ttl, self._work) if task is not None]

    async def resume(self) -> None:
        """Pick up what a restart interrupted: a drain, or a cordon's TTL."""
        state = self.store.state
        if state.schedulability == "draining" and self.store.drain_deadline is not None:
            log.info("resuming drain after restart", extra={"id": state.command_id})
            self._digests[state.command_id] = self.store.work_digest
            self._begin(
                state.command_id,
                self._drain(
                    state.command_id,
                    state.reason,
                    self.store.drain_deadline,
                    self.store.deregister,
                    resumed=True,
                ),
            )
        elif state.schedulability == "cordoned" and state.until is not None:
            self._arm_ttl(state.until, state.command_id)

    async def _supersede(self, command_id: str) -> None:
        """Cancel the work in progress and its TTL timer: the newest command wins."""
        if self._ttl is not None:
            self._ttl.cancel()
            self._ttl = None
        work, old_id = self._work, self._work_id
        if work is not None and not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            await self.result(old_id, "failed", f"superseded by {command_id}")

    def _begin(self, command_id: str, work: Work) -> None:
        self._work_id = command_id
        self._work = asyncio.create_task(self._perform(command_id, work), name="command-work")

    async def _perform(self, command_id: str, work: Work) -> None:
        try:
            await work
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.error("command failed", exc_info=True, extra={"id": command_id})
            await self.result(command_id, "failed", str(exc) or type(exc).__name__)

    # Actions ---------------------------------------------------------------------------

    async def _cordon(self, command_id: str, reason: str, ttl: float | None) -> None:
        until = time.time() + ttl if ttl else None
        notes = await self._hook("cordon", command_id, reason, until)
        notes += await self._slurm_drain(command_id, reason)
        await self._set_state("cordoned", command_id, reason, until=until)
        if until is not None:
            self._arm_ttl(until, command_id)
        lifted = f"; uncordons at {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(until))}"
        await self.result(command_id, "done", "cordoned" + (lifted if until else "") + notes)

    async def _uncordon(self, command_id: str, reason: str) -> None:
        self.store.drain_deadline = None
        notes = await self._hook("uncordon", command_id, reason, None)
        notes += await self._slurm_resume()
        await self._set_state("schedulable", command_id, reason)
        await self.result(command_id, "done", "schedulable" + notes)

    async def _drain(
        self, command_id: str, reason: str, deadline: float, deregister: bool, resumed: bool = False
    ) -> None:
        notes = "" if resumed else await self._hook("drain", command_id, reason, deadline)
        notes += await self._slurm_drain(command_id, reason)
        self.store.drain_deadline = deadline
        self.store.deregister = deregister
        if self.store.state.schedulability != "drained" or resumed:
            await self._set_state("draining", command_id, reason)
        reported: tuple[int, int, int | None] = (-1, -1, None)
        reported_at = 0.0
        jobs = await self._slurm_jobs()
        while (self.in_flight or self.placed or jobs) and time.time() < deadline:
            now = time.time()
            counts = (self.in_flight, self.placed, jobs)
            if reported != counts or now - reported_at >= PROGRESS_EVERY:
                reported, reported_at = counts, now
                left = deadline - now
                running = "" if jobs is None else f", {jobs} Slurm jobs running"
                if self.placed:
                    running += f", {self.placed} placed workloads to move"
                await self.result(
                    command_id,
                    "in_progress",
                    f"draining: {self.in_flight} in flight{running}, {left:.0f}s to deadline",
                    self.in_flight,
                    jobs_running=jobs,
                    placed=self.placed or None,
                )
            self._engine_changed.clear()
            wait = PROGRESS_EVERY if jobs is None else SLURM_POLL
            await wait_or_timeout(self._engine_changed, min(deadline - now, wait))
            if jobs is not None:
                # A failed poll keeps the last count: a drain never ends early because
                # Slurm stopped answering, only at the deadline.
                polled = await self._slurm_jobs()
                jobs = jobs if polled is None else polled
        left_over = self.in_flight
        if self.placed:
            notes += f"; {self.placed} placed workloads not moved by the deadline"
        notes += await self._hook("drained", command_id, reason, deadline)
        self.store.drain_deadline = None
        await self._set_state("drained", command_id, reason)
        summary = "drained" if left_over == 0 else f"deadline passed with {left_over} in flight"
        if jobs:
            summary = f"deadline passed with {jobs} Slurm jobs running" + (
                f", {left_over} in flight" if left_over else ""
            )
        if not deregister:
            await self.result(
                command_id,
                "done",
                summary + notes,
                left_over,
                jobs_running=jobs,
                placed=self.placed or None,
            )
            return
        await self.result(
            command_id, "in_progress", summary + "; deregistering", left_over, jobs_running=jobs
        )
        await self._deregister(command_id, reason)

    async def _deregister(self, command_id: str, reason: str) -> None:
        """Tell the aggregators through a heartbeat that says so and shows the workloads
        ended (the workload actor stops them all on this state), then end the agent."""
        self._deregistered_beat.clear()
        state = events.NodeState(
            ts=time.time(),
            schedulability="drained",
            reason=reason,
            command_id=command_id,
            deregistering=True,
        )
        self._leaving = state
        await self.publish_state(state)
        # Two beats, and the workloads' stop: a grace, then the SIGKILL's wait.
        wait = 2 * self.config.heartbeat_interval + 5.0 + self.config.workload_stop_grace + 5.0
        if await wait_or_timeout(self._deregistered_beat, wait):
            detail = "deregistered"
        else:
            detail = f"deregistered, but no heartbeat carried it within {wait:g}s"
            log.warning("deregistration not seen in a heartbeat")
        # A restart after this starts drained (safe) and not deregistering; the marker
        # keeps it from starting at all until an operator re-admits it.
        self.store.deregister = False
        self.store.save()
        deregistration.mark(Path(self.config.state_dir), reason, command_id)
        await self.result(command_id, "done", detail)
        log.info("deregistered; the agent stops", extra={"id": command_id})
        self.finished.set()

    async def _hook(self, action: str, command_id: str, reason: str, deadline: float | None) -> str:
        """Run the action's hook; report it as progress; a failure is noted, not fatal
        (a load balancer that cannot be told must not keep a node from draining)."""
        outcome = await run_hook(
            f"on_{action}",
            getattr(self.config, f"on_{action}"),
            {
                "FLEET_NODE_ID": self.config.node_id,
                "FLEET_CLUSTER": self.config.cluster,
                "FLEET_ACTION": action,
                "FLEET_REASON": reason,
                "FLEET_COMMAND_ID": command_id,
                "FLEET_DEADLINE": "" if deadline is None else f"{deadline:.3f}",
            },
            self.config.hooks_timeout,
        )
        if outcome is None:
            return ""
        await self.result(command_id, "in_progress", outcome.detail)
        return "" if outcome.ok else f"; {outcome.detail}"

    def _arm_ttl(self, until: float, command_id: str) -> None:
        self._ttl = asyncio.create_task(self._ttl_expiry(until, command_id), name="cordon-ttl")

    async def _ttl_expiry(self, until: float, command_id: str) -> None:
        await asyncio.sleep(max(0.0, until - time.time()))
        async with self.lock:
            self._ttl = None
            expiry_id = f"{command_id}:ttl"
            await self.result(expiry_id, "accepted", f"cordon TTL of {command_id} expired")
            await self.start(expiry_id, "cordon TTL expired", Uncordon())

    # Reporting -------------------------------------------------------------------------

    async def _set_state(
        self,
        schedulability: Schedulability,
        command_id: str,
        reason: str,
        until: float | None = None,
    ) -> None:
        self.store.work_digest = self._digests.get(command_id, "")
        by = self._by.get(command_id) or ("spot" if command_id.startswith("spot:") else "agent")
        if command_id == self.store.state.command_id and not self._by.get(command_id):
            by = self.store.state.by or by  # a drain resumed after a restart keeps its signer
        self.store.state = events.NodeState(
            ts=time.time(),
            schedulability=schedulability,
            reason=reason,
            command_id=command_id,
            until=until,
            by=by,
        )
        self.store.save()
        await self.publish_state()
        log.info("schedulability changed", extra={"state": schedulability, "id": command_id})

    async def publish_state(self, state: events.NodeState | None = None) -> None:
        """Publish ``state`` (default: the one of a deregistration under way, else the
        stored one) as the node's ``state`` event."""
        try:
            subject = self.subjects.event(self.config.node_id, EVENT_STATE)
            current = state or self._leaving or self.store.state
            await self.node_events.publish(self.bus, subject, current)
        except nats.errors.Error as exc:
            log.warning("state not published", extra={"reason": str(exc)})

    async def result(
        self,
        command_id: str,
        status: CommandStatus,
        detail: str = "",
        in_flight: int | None = None,
        digest: str = "",
        jobs_running: int | None = None,
        *,
        signer: str = "",
        claimed_id: str = "",
        placed: int | None = None,
    ) -> None:
        """Publish a node-signed CommandResult (:class:`ResultPublisher`: sent again while
        it is not acknowledged, then a failure logged, not raised). ``digest`` and
        ``signer`` default to those of the command started under ``command_id``. A refusal
        of a message with no usable id is published under its digest, so the stream keeps
        one refusal per distinct message within its duplicate window; ``claimed_id`` is the
        id such a message claims."""
        digest = digest or self._digests.get(command_id, "")
        signer = signer or self._by.get(command_id, "")
        if status in FINAL_STATUSES:
            self._digests.pop(command_id, None)
            self._by.pop(command_id, None)
        await self.results.publish(
            command_id,
            status,
            detail,
            digest=digest,
            schedulability=self.store.state.schedulability,
            in_flight=in_flight,
            jobs_running=jobs_running,
            signer=signer,
            claimed_id=claimed_id,
            placed=placed,
        )
