"""Workload actor: runs what accepted Deploy and Stop commands ask, and reports it.

The command executor hands it each accepted order as a node-signed ``workload_order``
event. A deploy is checked against the node (allowed engine and binary, GPUs it has and no
other workload uses unless shared, a free name and port), started with
``CUDA_VISIBLE_DEVICES`` pinned, and is ready when its ``/health`` answers 200 and its
``/v1/models`` names the model, within the deploy's ready timeout; every step is a signed
CommandResult. A workload that exits is restarted after a capped backoff, and left in
``crashloop`` after ``workload_crash_limit`` exits within ``workload_crash_window``. Stop
is SIGTERM to the process group, SIGKILL after ``workload_stop_grace``. A deploy of another
model onto the GPUs (or the name) of a workload that is not loading switches it
(:mod:`actors.node.workloads.admission`): the old one goes ``stopping`` (the gateway
routes it nothing new), the requests the gateway holds of it finish, it is stopped, and
the new one starts and goes through readiness like any deploy. The desired set is
saved in the state dir; a new agent adopts the processes still running (pid and start
time) and starts the others again. Every change publishes ``Workloads`` (and so does each
heartbeat period, so a restarted heartbeat actor learns the set).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
import nats.errors

from actors.node.config import AgentConfig
from actors.node.events import NodeEvents
from actors.node.results import ResultPublisher
from actors.node.workloads import container, listeners, processes
from actors.node.workloads.admission import admit
from actors.node.workloads.launch import LOOPBACK_ENV, NotAllowed, capabilities, command_line
from actors.node.workloads.readiness import readiness
from actors.node.workloads.running import Running
from actors.node.workloads.store import Entry, WorkloadStore
from actors.runtime.bus import Bus
from actors.runtime.schedule import Backoff, wait_or_timeout
from actors.runtime.subscriptions import listening
from schemas.base import Schedulability
from schemas.events import Event, Gateway, NodeState, Sample, Workloads, WorkloadState
from schemas.messages import CommandStatus
from schemas.subjects import EVENT_WORKLOADS, Subjects
from schemas.workloads import Deploy, Stop, WorkloadOrder

log = logging.getLogger(__name__)

POLL = 0.25
"""Seconds between two looks at a running workload's process (while it starts, its
endpoints are probed every workload_ready_interval)."""
HTTP_TIMEOUT = 2.0
LISTEN_CHECK_EVERY = 8
"""Looks at a running workload (POLL apart) between two checks of where it listens."""


class WorkloadsActor:
    """Subscribes to fleet.evt.<node>.*; publishes Workloads on fleet.evt.<node>.workloads and
    CommandResult on fleet.result.<cluster>.<node>."""

    name = "workloads"

    def __init__(self, config: AgentConfig, bus: Bus, events: NodeEvents) -> None:
        self.config = config
        self.bus = bus
        self.events = events
        self.subjects = Subjects(config.prefix)
        self.subject = self.subjects.event(config.node_id, EVENT_WORKLOADS)
        self.results = ResultPublisher(config, bus, events.key)
        self.store = WorkloadStore(Path(config.state_dir))
        self.running: dict[str, Running] = {}
        self.gpus: set[int] | None = None
        """GPU indices of the last inventory sample (None until one arrives)."""
        self.schedulability: Schedulability = "schedulable"
        self.gateway = Gateway(ts=0.0)
        """The gateway's latest event: which workloads it holds requests of."""
        self._gateway_said = asyncio.Event()
        self._session: aiohttp.ClientSession | None = None
        self._stops: set[asyncio.Task[None]] = set()

    async def run(self, ready: Callable[[], None]) -> None:
        routes = {
            self.subjects.events(self.config.node_id): self.events.decoding(
                self.name, self._on_event
            )
        }
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=HTTP_TIMEOUT))
        try:
            async with listening(self.bus, routes):
                for entry in self.store.load():
                    self._supervise(Running(entry), adopt=True)
                await self.publish()
                ready()
                while True:
                    await asyncio.sleep(self.config.heartbeat_interval)
                    await self.publish()
        finally:
            # The processes are left running: the next agent adopts them.
            tasks = [w.task for w in self.running.values() if w.task is not None]
            tasks += list(self._stops)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._session.close()

    # Events ----------------------------------------------------------------------------

    async def _on_event(self, event: Event) -> None:
        match event:
            case Sample():
                self.gpus = {gpu.index for gpu in event.gpus}
            case NodeState():
                self.schedulability = event.schedulability
                if event.deregistering and self.running:
                    # The node leaves the fleet: nothing of it may keep running or hold GPUs.
                    await self._stop_all(f"node deregistering ({event.command_id})")
            case Gateway():
                self.gateway = event
                self._gateway_said.set()
            case WorkloadOrder():
                await self._on_order(event)

    async def _on_order(self, order: WorkloadOrder) -> None:
        action = order.action
        if isinstance(action, Stop):
            await self._stop(order, action)
            return
        admission = admit(action, self.running, self.gpus)
        refusal = admission.refusal
        port = action.port or processes.free_port()
        if not refusal:
            try:
                command_line(self.config, action, port)
            except NotAllowed as exc:
                refusal = str(exc)
        if refusal:
            log.warning("deploy refused", extra={"workload": action.name, "reason": refusal})
            await self.result(order.command_id, "rejected", refusal, order.command_digest)
            return
        await self.result(
            order.command_id, "accepted", f"deploy {action.name}", order.command_digest
        )
        for displaced in admission.displaced:
            # Taken at once: a second deploy meanwhile must not switch it out again.
            displaced.state = "stopping"
        old = self.running.pop(action.name, None)
        if old is not None and old.task is not None and old not in admission.displaced:
            old.task.cancel()
        workload = Running(Entry(deploy=action, port=port))
        workload.command_id, workload.digest = order.command_id, order.command_digest
        self._supervise(workload, adopt=False, displacing=admission.displaced)
        self._save()

    # Supervision -----------------------------------------------------------------------

    def _supervise(
        self, workload: Running, adopt: bool, displacing: list[Running] | None = None
    ) -> None:
        self.running[workload.deploy.name] = workload
        workload.task = asyncio.create_task(
            self._keep(workload, adopt, displacing or []), name=f"workload-{workload.deploy.name}"
        )

    async def _keep(self, workload: Running, adopt: bool, displacing: list[Running]) -> None:
        """Switch out what it replaces, start (or adopt), wait for readiness, watch,
        restart after a crash, give up."""
        for old in displacing:
            # Shielded: a stop of the new workload meanwhile must not leave the old one
            # half stopped and unsupervised.
            await asyncio.shield(self._switch_out(old, workload.deploy, workload))
        entry = workload.entry
        backoff = Backoff(1.0, self.config.workload_backoff_max)
        log_path = self.store.log_path(workload.deploy.name)
        if adopt and not processes.alive(entry.pid, entry.started):
            log.info(
                "workload gone after restart; starting it", extra={"workload": entry.deploy.name}
            )
            adopt = False
        while True:
            if not adopt:
                try:
                    await self._start(workload, log_path)
                except (OSError, NotAllowed, container.ContainerError) as exc:
                    await self._final(workload, "failed", f"cannot start: {exc}")
                    return
            else:
                log.info(
                    "workload adopted", extra={"workload": entry.deploy.name, "pid": entry.pid}
                )
            adopt = False
            if not await self._until_ready(workload, log_path):
                return
            strays = await self._until_exit(workload, log_path)
            if strays:
                await self._end(workload)
                processes.reap(entry.pid)
                await self._final(
                    workload,
                    "failed",
                    f"stopped: listening on {', '.join(strays)}, beyond 127.0.0.1 where "
                    "the node lets workloads listen",
                )
                return
            exit_code = processes.reap(entry.pid)
            # What the leader left behind (an engine's workers) would hold its GPUs and
            # port against the restart.
            await self._end(workload)
            now = time.time()
            workload.crashes.append(now)
            while (
                workload.crashes and workload.crashes[0] < now - self.config.workload_crash_window
            ):
                workload.crashes.popleft()
            detail = f"exited (code {exit_code})" if exit_code is not None else "exited"
            if len(workload.crashes) >= self.config.workload_crash_limit:
                tail = processes.tail(log_path)
                await self._final(
                    workload,
                    "crashloop",
                    f"{len(workload.crashes)} crashes within "
                    f"{self.config.workload_crash_window:g}s; last {detail}; log: {tail}",
                )
                return
            entry.restarts += 1
            delay = backoff.next()
            log.warning(
                "workload exited; restarting",
                extra={"workload": entry.deploy.name, "code": exit_code, "delay": delay},
            )
            await self._set(workload, "starting", f"{detail}; restart {entry.restarts}")
            await asyncio.sleep(delay)

    async def _start(self, workload: Running, log_path: Path) -> None:
        deploy, entry = workload.deploy, workload.entry
        if not deploy.port and entry.restarts and processes.port_in_use(entry.port):
            # The port this agent chose was free at the deploy; another process took it
            # since (the workload down meanwhile): restarting on it would only crash-loop.
            log.warning(
                "workload port taken meanwhile; starting on another",
                extra={"workload": deploy.name, "port": entry.port},
            )
            entry.port = processes.free_port()
        argv = command_line(self.config, deploy, entry.port)
        env = {
            **deploy.env,
            **LOOPBACK_ENV,
            "CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in deploy.gpus),
        }
        if deploy.image:
            await container.ensure_image(
                self.config, deploy.image, lambda line: self._progress(workload, line)
            )
            cidfile = self.store.cid_path(deploy.name)
            cidfile.unlink(missing_ok=True)
            cdi = container.cdi_available()
            argv = container.run_argv(
                self.config, deploy, entry.port, argv, cidfile, {**deploy.env, **LOOPBACK_ENV}, cdi
            )
            env = {}
        entry.pid, entry.started = processes.spawn(argv, env, log_path)
        workload.container = ""
        self._save()
        log.info("workload started", extra={"workload": deploy.name, "pid": entry.pid})
        await self._set(workload, "starting", f"pid {entry.pid}")
        await self._progress(workload, f"starting: pid {entry.pid} on 127.0.0.1:{entry.port}")

    async def _until_ready(self, workload: Running, log_path: Path) -> bool:
        """Whether the workload became ready within its timeout; if not, it is failed (and
        its group killed) or it exited (then False is not final: the caller restarts)."""
        entry = workload.entry
        deadline = time.monotonic() + workload.deploy.ready_timeout
        loading_said = False
        looks = 0
        while time.monotonic() < deadline:
            if not processes.alive(entry.pid, entry.started):
                return True  # _until_exit returns at once and the crash is counted
            assert self._session is not None
            status = await readiness(self._session, workload.entry.port, workload.deploy.model)
            if workload.deploy.image and not workload.container:
                workload.container = container.container_id(self.store.cid_path(entry.deploy.name))
            checked = status == "ready" or looks % LISTEN_CHECK_EVERY == 0
            looks += 1
            if checked and listeners.strays(entry.pid):
                return True  # _until_exit finds them at once and stops the workload
            if status == "ready":
                backoff_note = f" after {entry.restarts} restarts" if entry.restarts else ""
                await self._set(workload, "ready", "")
                await self._answer(
                    workload, "done", f"ready on 127.0.0.1:{entry.port}{backoff_note}"
                )
                return True
            if status and not loading_said:
                loading_said = True
                await self._progress(workload, f"loading: {status}")
            await asyncio.sleep(self.config.workload_ready_interval)
        await self._end(workload)
        processes.reap(entry.pid)
        tail = processes.tail(log_path)
        await self._final(
            workload,
            "failed",
            f"not ready within {workload.deploy.ready_timeout:g}s; log: {tail}",
        )
        return False

    async def _until_exit(self, workload: Running, log_path: Path) -> list[str]:
        """Watch until the workload exits ([]) or is found listening beyond loopback
        (where, ``address:port``), checked at once and every LISTEN_CHECK_EVERY looks."""
        entry = workload.entry
        looks = 0
        while processes.alive(entry.pid, entry.started):
            if looks % LISTEN_CHECK_EVERY == 0:
                strays = listeners.strays(entry.pid)
                if strays:
                    return strays
            looks += 1
            processes.rotate(log_path, self.config.workload_log_bytes)
            await asyncio.sleep(POLL)
        return []

    # Stop ------------------------------------------------------------------------------

    async def _stop(self, order: WorkloadOrder, stop: Stop) -> None:
        workload = self.running.get(stop.name)
        if workload is None:
            await self.result(
                order.command_id, "rejected", f"no workload named {stop.name}", order.command_digest
            )
            return
        await self.result(order.command_id, "accepted", f"stop {stop.name}", order.command_digest)
        task = asyncio.create_task(self._stopping(order, workload), name=f"stop-{stop.name}")
        self._stops.add(task)
        task.add_done_callback(self._stops.discard)

    async def _stopping(self, order: WorkloadOrder, workload: Running) -> None:
        await self.result(order.command_id, "in_progress", "SIGTERM sent", order.command_digest)
        left = await self._halt(workload, f"stop {order.command_id}")
        detail = "stopped" if not left else f"stopped; {len(left)} processes would not die"
        if order.reason:
            detail = f"{detail}: {order.reason}"
        await self.result(
            order.command_id, "done" if not left else "failed", detail, order.command_digest
        )

    async def _switch_out(self, old: Running, deploy: Deploy, new: Running) -> None:
        """Stop ``old`` for ``deploy``: no new requests (it is ``stopping``), those the
        gateway holds of it answered first (up to workload_switch_grace), then its group."""
        what = f"{old.deploy.name} (model {old.deploy.model or '-'})"
        await self._progress(new, f"switching: {what} takes no new requests")
        await self._halt(old, f"switching to {deploy.model}", drain=True)
        await self._progress(new, f"switching: {what} stopped")

    async def _halt(self, workload: Running, why: str, drain: bool = False) -> list[int]:
        """Stop supervising ``workload``, say it is stopping, (with ``drain``) wait for
        the gateway's requests of it, kill its group, forget it; the pids left alive."""
        if workload.task is not None and workload.task is not asyncio.current_task():
            workload.task.cancel()
            await asyncio.gather(workload.task, return_exceptions=True)
        if workload.command_id:
            await self._answer(workload, "failed", f"stopped: {why}")
        await self._set(workload, "stopping", why)
        if drain:
            await self._until_gateway_lets_go(workload)
        left = await self._end(workload)
        processes.reap(workload.entry.pid)
        await self._set(workload, "stopped", "")
        if self.running.get(workload.deploy.name) is workload:
            del self.running[workload.deploy.name]
        self._save()
        await self.publish()
        return left

    async def _until_gateway_lets_go(self, workload: Running) -> None:
        """Wait until a gateway event sent after ``workload`` became ``stopping`` holds no
        request of its port (or the gateway is not serving), at most workload_switch_grace;
        a gateway silent for two heartbeat periods is taken for none."""
        port = workload.entry.port
        deadline = time.monotonic() + self.config.workload_switch_grace
        silent = 2 * self.config.heartbeat_interval
        while (left := deadline - time.monotonic()) > 0:
            self._gateway_said.clear()
            if not await wait_or_timeout(self._gateway_said, min(left, silent)):
                if left > silent:
                    log.info("no gateway event; switching", extra={"port": port})
                    return
                break
            if not self.gateway.serving or not self.gateway.held_by_port.get(port):
                return
        log.warning(
            "switching with requests still held",
            extra={"workload": workload.deploy.name, "grace": self.config.workload_switch_grace},
        )

    async def _stop_all(self, reason: str) -> None:
        """End every workload (process groups ended, GPUs freed) and forget them, so no
        later agent adopts one; each stop runs beside the others, within one grace."""
        workloads = list(self.running.values())
        log.info("stopping every workload", extra={"reason": reason, "count": len(workloads)})
        for workload in workloads:
            if workload.task is not None:
                workload.task.cancel()
        await asyncio.gather(
            *(w.task for w in workloads if w.task is not None), return_exceptions=True
        )
        lefts = await asyncio.gather(*(self._end(w) for w in workloads))
        for workload, left in zip(workloads, lefts, strict=True):
            processes.reap(workload.entry.pid)
            await self._answer(workload, "failed", reason)
            if left:
                log.error(
                    "workload would not die",
                    extra={"workload": workload.deploy.name, "pids": left},
                )
            if self.running.get(workload.deploy.name) is workload:
                del self.running[workload.deploy.name]
        self._save()
        await self.publish()

    async def _end(self, workload: Running) -> list[int]:
        """Kill the workload's group (and remove its container); the pids left alive."""
        left = await self._kill(workload.entry.pid)
        if workload.deploy.image:
            await container.remove(self.config, workload.deploy)
        return left

    async def _kill(self, pgid: int) -> list[int]:
        return await processes.end_group(pgid, self.config.workload_stop_grace)

    # Reporting -------------------------------------------------------------------------

    async def _set(self, workload: Running, state: WorkloadState, reason: str) -> None:
        if state != workload.state:
            workload.since = time.time()
        workload.state, workload.reason = state, reason
        self._save()
        await self.publish()

    async def _final(self, workload: Running, state: WorkloadState, reason: str) -> None:
        log.warning(
            "workload %s", state, extra={"workload": workload.deploy.name, "reason": reason}
        )
        await self._set(workload, state, reason)
        await self._answer(workload, "failed", f"{state}: {reason}")

    async def _progress(self, workload: Running, detail: str) -> None:
        if workload.command_id:
            await self.result(workload.command_id, "in_progress", detail, workload.digest)

    async def _answer(self, workload: Running, status: CommandStatus, detail: str) -> None:
        """The deploy's final result, once."""
        if workload.command_id:
            command_id, workload.command_id = workload.command_id, ""
            await self.result(command_id, status, detail, workload.digest)

    def _save(self) -> None:
        self.store.save(
            [w.entry for w in self.running.values() if w.state not in ("stopping", "stopped")]
        )

    async def publish(self) -> None:
        workloads = Workloads(
            ts=time.time(),
            workloads=[w.describe() for w in self.running.values()],
            capabilities=capabilities(self.config),
        )
        try:
            await self.events.publish(self.bus, self.subject, workloads)
        except nats.errors.Error as exc:
            log.warning("workloads not published", extra={"reason": str(exc)})

    async def result(
        self, command_id: str, status: CommandStatus, detail: str, digest: str
    ) -> None:
        """A node-signed CommandResult (:class:`ResultPublisher`)."""
        await self.results.publish(
            command_id, status, detail, digest=digest, schedulability=self.schedulability
        )
