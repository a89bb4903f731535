"""The actor shape and the supervisor that keeps actors running.

A crashing actor is logged, backed off (capped, jittered) and restarted while the others
keep running. Cancellation always propagates: stopping the supervisor stops every actor.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from typing import Literal, Protocol, runtime_checkable

import msgspec

from actors.runtime.bus import bus_fault
from actors.runtime.schedule import Backoff

log = logging.getLogger(__name__)

ActorPhase = Literal["starting", "running", "backoff", "finished", "stopped"]


class Actor(Protocol):
    """Constructed with its config and the bus; ``run`` subscribes, flushes, calls
    ``ready()`` (:func:`actors.runtime.subscriptions.listening` does these three), then loops until
    cancelled. Returning means the actor's work is done."""

    name: str

    async def run(self, ready: Callable[[], None]) -> None: ...


@runtime_checkable
class SelfChecking(Protocol):
    """An actor that can run and still not do its work (its durable consumer is gone and
    cannot be created again, say): ``problem()`` says why, "" when all is well."""

    def problem(self) -> str: ...


class FatalError(Exception):
    """An actor cannot do its work and restarting it will not help (its configured port
    is taken, say): the supervisor stops restarting it and sets ``finished`` with
    ``fatal``, so the process exits with the reason instead of running half-blind."""


class ActorStatus(msgspec.Struct, kw_only=True):
    name: str
    phase: ActorPhase = "starting"
    restarts: int = 0
    last_error: str = ""
    started_at: float = 0.0
    problem: str = ""
    """What a running :class:`SelfChecking` actor last said is wrong."""


StatusSource = Callable[[], Mapping[str, ActorStatus]]


def unhealthy(statuses: Mapping[str, ActorStatus]) -> dict[str, str]:
    """Each actor that is not running, or running with a problem, and why: what a
    ``/healthz`` endpoint answers non-200 for."""
    return {
        name: status.problem if status.phase == "running" else status.phase
        for name, status in statuses.items()
        if status.phase != "running" or status.problem
    }


class Supervisor:
    """Runs actors as tasks; restarts each on failure with exponential backoff.

    ``then`` are actors that need what the first ones make before they start (the
    streams and buckets the aggregator provisions): they start once each of ``actors``
    has been ready once, and are then kept like the others. Each actor says it is ready
    only after its own start-up, so this orders the start by readiness itself, not by
    a delay or by a retry of the actors that would have read too early."""

    def __init__(
        self,
        actors: list[Actor],
        *,
        then: list[Actor] | None = None,
        backoff_initial: float = 0.5,
        backoff_max: float = 30.0,
        healthy_after: float = 60.0,
    ) -> None:
        self.first = list(actors)
        self.actors = self.first + (then or [])
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.healthy_after = healthy_after
        self.status = {actor.name: ActorStatus(name=actor.name) for actor in self.actors}
        self._tasks: list[asyncio.Task[None]] = []
        self._first_ready = asyncio.Event()
        self.finished = asyncio.Event()
        """Set when an actor returns on its own (e.g. after deregistering) or fails fatally."""
        self.fatal = ""
        """Why an actor raised :class:`FatalError`; "" while none has."""

    def start(self) -> None:
        if not self.first:
            self._first_ready.set()
        for actor in self.first:
            self._keep_task(actor)
        if len(self.actors) > len(self.first):
            self._tasks.append(asyncio.create_task(self._then(), name="actors:then"))

    def _keep_task(self, actor: Actor) -> None:
        self._tasks.append(asyncio.create_task(self._keep(actor), name=f"actor:{actor.name}"))

    async def _then(self) -> None:
        """Start the ``then`` actors once every first actor has been ready."""
        await self._first_ready.wait()
        for actor in self.actors[len(self.first) :]:
            self._keep_task(actor)

    def check(self) -> dict[str, ActorStatus]:
        """Every actor's status, with the problems of self-checking actors asked afresh."""
        for actor in self.actors:
            if isinstance(actor, SelfChecking):
                self.status[actor.name].problem = actor.problem()
        return self.status

    @property
    def all_running(self) -> bool:
        return all(status.phase == "running" for status in self.status.values())

    async def wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self.all_running:
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.02)
        return True

    async def stop(self, timeout: float = 5.0) -> None:
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            _, pending = await asyncio.wait(self._tasks, timeout=timeout)
            for task in pending:
                log.warning("actor did not stop in time", extra={"task": task.get_name()})
        for status in self.status.values():
            if status.phase != "finished":
                status.phase = "stopped"

    async def _keep(self, actor: Actor) -> None:
        status = self.status[actor.name]
        backoff = Backoff(self.backoff_initial, self.backoff_max)
        while True:
            status.phase = "starting"
            status.started_at = time.time()

            def ready(status: ActorStatus = status) -> None:
                status.phase = "running"
                if all(self.status[first.name].phase == "running" for first in self.first):
                    self._first_ready.set()

            try:
                await actor.run(ready)
            except asyncio.CancelledError:
                raise
            except FatalError as exc:
                status.phase = "stopped"
                status.last_error = self.fatal = str(exc)
                log.error("actor failed fatally", extra={"actor": actor.name, "reason": str(exc)})
                self.finished.set()
                return
            except Exception as exc:
                ran_for = time.time() - status.started_at
                if ran_for >= self.healthy_after:
                    backoff.reset()
                delay = backoff.next()
                status.restarts += 1
                status.last_error = f"{type(exc).__name__}: {exc}"
                status.phase = "backoff"
                fields = {
                    "actor": actor.name,
                    "restarts": status.restarts,
                    "retry_in_s": round(delay, 2),
                }
                if bus_fault(exc):
                    # The cluster failing (a timeout while a leader is elected, a server
                    # gone): said as such, no traceback; the restart is the recovery.
                    log.warning(
                        "actor stopped by a bus fault; restarting",
                        extra={**fields, "reason": _reason_of(exc)},
                    )
                else:
                    log.error("actor crashed; restarting", exc_info=True, extra=fields)
                await asyncio.sleep(delay)
            else:
                status.phase = "finished"
                log.info("actor finished", extra={"actor": actor.name})
                self.finished.set()
                return


def _reason_of(exc: BaseException) -> str:
    """One line for a bus fault: its type and text (a group's first)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}".rstrip(": ")
