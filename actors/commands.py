"""Command executor actor: runs operators' signed commands (cordon, drain, uncordon,
deregister) and the node's own reaction to spot interruption notices.

Commands come from a durable pull consumer on FLEET_CMD filtered to this node's subject,
so a command sent while the agent was down runs when it comes back. A command runs only
if it is signed by a trusted operator key, addressed to this node, unexpired and never seen
before (seen ids persist in the state dir); anything else is answered ``rejected`` and
changes nothing. Every answer is a node-signed CommandResult on FLEET_EVENTS. The node's
schedulability persists too, so a restart keeps a cordon, its TTL and a drain's deadline.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import nats.errors
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from actors.bus import Bus, unsubscribe_quietly
from actors.command_checks import Rejection, check_command
from actors.command_store import CommandStore
from actors.config import AgentConfig
from actors.hooks import run_hook
from actors.records import notice_key
from schemas import codec, events
from schemas import subjects as names
from schemas.base import Schedulability
from schemas.errors import DecodeError
from schemas.messages import (
    CommandResult,
    CommandStatus,
    Cordon,
    Deregister,
    Drain,
    Heartbeat,
    Uncordon,
)
from schemas.signing import KeyPair
from schemas.subjects import Subjects

log = logging.getLogger(__name__)

PUBLISH_TIMEOUT = 5.0
FETCH_WAIT = 5.0
PROGRESS_EVERY = 2.0
"""A drain reports progress at least this often, and whenever in-flight work changes."""
REBALANCE_TTL = 600.0
"""A rebalance or maintenance notice cordons the node for this long."""
TERMINAL_NOTICES = ("terminate", "stop", "hibernate", "preempt")

Work = Coroutine[Any, Any, None]


class CommandExecutor:
    name = "commands"

    def __init__(self, config: AgentConfig, bus: Bus, key: KeyPair) -> None:
        self.config = config
        self.bus = bus
        self.key = key
        self.subjects = Subjects(config.prefix)
        self.command_subject = self.subjects.command(config.cluster, config.node_id)
        self.result_subject = self.subjects.result(config.cluster, config.node_id)
        self.store = CommandStore(Path(config.state_dir))
        self.in_flight = 0
        self._engine_changed = asyncio.Event()
        self._deregistered_beat = asyncio.Event()
        self._finished = asyncio.Event()
        self._lock = asyncio.Lock()
        self._work: asyncio.Task[None] | None = None
        self._work_id = ""
        self._ttl: asyncio.Task[None] | None = None
        self._fetcher: asyncio.Task[None] | None = None
        self._counts: dict[tuple[str, str], int] = {}

    async def run(self, ready: Callable[[], None]) -> None:
        # Subscribed first, before any await on the network: the agent starts this actor
        # before the spot watcher, so on one connection our SUB precedes its first notice.
        subscriptions: list[Any] = [
            await self.bus.subscribe(self.subjects.events(self.config.node_id), self._on_event)
        ]
        republisher = asyncio.create_task(self._republish_forever(), name="commands-state")
        try:
            subscriptions.append(
                await self.bus.subscribe(
                    self.subjects.heartbeat(self.config.cluster, self.config.node_id),
                    self._on_beat,
                )
            )
            consumer = await self.bus.js.pull_subscribe(
                self.command_subject,
                durable=f"cmd_{self.config.cluster}_{self.config.node_id}",
                stream=self.subjects.stream_name(names.STREAM_COMMANDS),
                config=ConsumerConfig(
                    ack_policy=AckPolicy.EXPLICIT, deliver_policy=DeliverPolicy.ALL, ack_wait=30
                ),
            )
            subscriptions.append(consumer)
            await self.bus.flush()
            await self._publish_state()
            await self._resume()
            self._fetcher = asyncio.create_task(self._fetch_forever(consumer), name="commands")
            ready()
            await self._finished.wait()
        finally:
            tasks = [
                task
                for task in (republisher, self._fetcher, self._ttl, self._work)
                if task is not None
            ]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for subscription in subscriptions:
                await unsubscribe_quietly(subscription)

    async def shutdown(self, timeout: float, deregister: bool) -> None:
        """Stop taking commands, finish the work in progress (deregistering first when
        asked), all within ``timeout``."""
        if self._fetcher is not None:
            self._fetcher.cancel()
        if deregister and not self._finished.is_set() and not self.store.deregister:
            async with self._lock:
                await self._supersede("shutdown")
                await self._result("shutdown", "accepted", "agent shutting down: deregister")
                self._begin(
                    "shutdown",
                    self._drain("shutdown", "agent shutdown", time.time() + timeout / 2, True),
                )
        if self._work is not None and not self._work.done():
            _, pending = await asyncio.wait({self._work}, timeout=timeout)
            if pending:
                log.warning("command work unfinished at shutdown", extra={"id": self._work_id})

    # Commands --------------------------------------------------------------------------

    async def _fetch_forever(self, consumer: Any) -> None:
        while True:
            try:
                batch = await consumer.fetch(1, timeout=FETCH_WAIT)
            except (nats.errors.TimeoutError, TimeoutError):
                continue
            except nats.errors.ConnectionClosedError:
                raise
            except nats.errors.Error as exc:
                log.warning("command fetch failed", extra={"reason": str(exc)})
                await asyncio.sleep(1.0)
                continue
            for msg in batch:
                await self._handle(msg)

    async def _handle(self, msg: Msg) -> None:
        try:
            command = check_command(msg, self.subjects, self.config, self.store.seen)
        except Rejection as refusal:
            log.warning(
                "command refused", extra={"id": refusal.command_id, "reason": refusal.reason}
            )
            await self._result(refusal.command_id, "rejected", refusal.reason)
            await msg.ack()
            return
        async with self._lock:
            self.store.remember(command.id)
            self.store.save()
            await self._result(command.id, "accepted", command.reason)
            await msg.ack()
            log.info("command accepted", extra={"id": command.id, "action": command.action})
            await self._start(command.id, command.reason, command.action)

    async def _start(
        self, command_id: str, reason: str, action: Any, deadline: float | None = None
    ) -> None:
        """Begin an accepted action; called with the lock held. ``deadline`` (absolute)
        overrides the drain deadline the action carries."""
        current = self.store.state.schedulability
        if self.store.deregister and not isinstance(action, Deregister):
            await self._result(command_id, "failed", "node is deregistering")
        elif isinstance(action, Cordon):
            if current in ("draining", "drained"):
                await self._result(command_id, "done", f"already {current}")
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

    async def _supersede(self, command_id: str) -> None:
        """Cancel the work in progress and its TTL timer: the newest command wins."""
        if self._ttl is not None:
            self._ttl.cancel()
            self._ttl = None
        work, old_id = self._work, self._work_id
        if work is not None and not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            await self._result(old_id, "failed", f"superseded by {command_id}")

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
            await self._result(command_id, "failed", str(exc) or type(exc).__name__)

    # Actions ---------------------------------------------------------------------------

    async def _cordon(self, command_id: str, reason: str, ttl: float | None) -> None:
        until = time.time() + ttl if ttl else None
        notes = await self._hook("cordon", command_id, reason, until)
        await self._set_state("cordoned", command_id, reason, until=until)
        if until is not None:
            self._arm_ttl(until, command_id)
        lifted = f"; uncordons at {time.strftime('%H:%M:%S', time.localtime(until))}"
        await self._result(command_id, "done", "cordoned" + (lifted if until else "") + notes)

    async def _uncordon(self, command_id: str, reason: str) -> None:
        self.store.drain_deadline = None
        notes = await self._hook("uncordon", command_id, reason, None)
        await self._set_state("schedulable", command_id, reason)
        await self._result(command_id, "done", "schedulable" + notes)

    async def _drain(
        self, command_id: str, reason: str, deadline: float, deregister: bool, resumed: bool = False
    ) -> None:
        notes = "" if resumed else await self._hook("drain", command_id, reason, deadline)
        self.store.drain_deadline = deadline
        self.store.deregister = deregister
        if self.store.state.schedulability != "drained" or resumed:
            await self._set_state("draining", command_id, reason)
        reported_count, reported_at = -1, 0.0
        while self.in_flight > 0 and time.time() < deadline:
            now = time.time()
            if reported_count != self.in_flight or now - reported_at >= PROGRESS_EVERY:
                reported_count, reported_at = self.in_flight, now
                left = deadline - now
                await self._result(
                    command_id,
                    "in_progress",
                    f"draining: {self.in_flight} in flight, {left:.0f}s to deadline",
                    self.in_flight,
                )
            self._engine_changed.clear()
            try:
                await asyncio.wait_for(
                    self._engine_changed.wait(), min(deadline - now, PROGRESS_EVERY)
                )
            except TimeoutError:
                pass
        left_over = self.in_flight
        notes += await self._hook("drained", command_id, reason, deadline)
        self.store.drain_deadline = None
        await self._set_state("drained", command_id, reason)
        summary = "drained" if left_over == 0 else f"deadline passed with {left_over} in flight"
        if not deregister:
            await self._result(command_id, "done", summary + notes, left_over)
            return
        await self._result(command_id, "in_progress", summary + "; deregistering", left_over)
        await self._deregister(command_id, reason)

    async def _deregister(self, command_id: str, reason: str) -> None:
        """Tell the aggregators through a heartbeat that says so, then end the agent."""
        self._deregistered_beat.clear()
        state = events.NodeState(
            ts=time.time(),
            schedulability="drained",
            reason=reason,
            command_id=command_id,
            deregistering=True,
        )
        await self._publish_state(state)
        wait = 2 * self.config.heartbeat_interval + 5.0
        try:
            await asyncio.wait_for(self._deregistered_beat.wait(), wait)
            detail = "deregistered"
        except TimeoutError:
            detail = f"deregistered, but no heartbeat carried it within {wait:g}s"
            log.warning("deregistration not seen in a heartbeat")
        # A restart after this starts drained (safe) and not deregistering.
        self.store.deregister = False
        self.store.save()
        await self._result(command_id, "done", detail)
        log.info("deregistered; the agent stops", extra={"id": command_id})
        self._finished.set()

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
        await self._result(command_id, "in_progress", outcome.detail)
        return "" if outcome.ok else f"; {outcome.detail}"

    def _arm_ttl(self, until: float, command_id: str) -> None:
        self._ttl = asyncio.create_task(self._ttl_expiry(until, command_id), name="cordon-ttl")

    async def _ttl_expiry(self, until: float, command_id: str) -> None:
        await asyncio.sleep(max(0.0, until - time.time()))
        async with self._lock:
            self._ttl = None
            expiry_id = f"{command_id}:ttl"
            await self._result(expiry_id, "accepted", f"cordon TTL of {command_id} expired")
            await self._start(expiry_id, "cordon TTL expired", Uncordon())

    async def _resume(self) -> None:
        """Pick up what a restart interrupted: a drain, or a cordon's TTL."""
        state = self.store.state
        if state.schedulability == "draining" and self.store.drain_deadline is not None:
            log.info("resuming drain after restart", extra={"id": state.command_id})
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

    # Events ----------------------------------------------------------------------------

    async def _on_event(self, msg: Msg) -> None:
        kind = msg.subject.rsplit(".", 1)[-1]
        try:
            if kind == names.EVENT_ENGINE:
                engine = codec.decode(msg.data, events.Engine, msg.subject)
                self.in_flight = engine.in_flight or 0
                self._engine_changed.set()
            elif kind == names.EVENT_INTERRUPTION:
                notice = codec.decode(msg.data, events.Interruption, msg.subject)
                await self._on_interruption(notice)
        except DecodeError as exc:
            log.warning("ignoring malformed event", extra={"reason": str(exc)})

    async def _on_interruption(self, notice: events.Interruption) -> None:
        """A termination notice drains before its deadline and deregisters; a rebalance
        or maintenance notice cordons for a while. Each notice acts once, ever."""
        command_id = f"spot:{notice_key(notice)}"
        async with self._lock:
            if self.store.seen(command_id) or self._finished.is_set():
                return
            self.store.remember(command_id)
            self.store.save()
            reason = f"{notice.provider} {notice.kind} notice"
            if notice.kind in TERMINAL_NOTICES:
                if self.store.deregister:
                    return
                deadline = (notice.deadline or time.time()) - self.config.spot_safety_margin
                await self._result(command_id, "accepted", f"{reason}: drain and deregister")
                await self._start(command_id, reason, Deregister(), deadline)
            elif self.store.state.schedulability == "schedulable":
                await self._result(command_id, "accepted", f"{reason}: cordon")
                await self._start(command_id, reason, Cordon(ttl=REBALANCE_TTL))

    async def _on_beat(self, msg: Msg) -> None:
        try:
            heartbeat = codec.decode(msg.data, Heartbeat, msg.subject)
        except DecodeError:
            return
        if heartbeat.deregistering:
            self._deregistered_beat.set()

    # Publishing ------------------------------------------------------------------------

    async def _set_state(
        self,
        schedulability: Schedulability,
        command_id: str,
        reason: str,
        until: float | None = None,
    ) -> None:
        self.store.state = events.NodeState(
            ts=time.time(),
            schedulability=schedulability,
            reason=reason,
            command_id=command_id,
            until=until,
        )
        self.store.save()
        await self._publish_state()
        log.info("schedulability changed", extra={"state": schedulability, "id": command_id})

    async def _publish_state(self, state: events.NodeState | None = None) -> None:
        body = codec.encode(state or self.store.state)
        try:
            subject = self.subjects.event(self.config.node_id, names.EVENT_STATE)
            await self.bus.publish(subject, body)
        except nats.errors.Error as exc:
            log.warning("state not published", extra={"reason": str(exc)})

    async def _republish_forever(self) -> None:
        """State is a level, not an edge: repeating it lets a heartbeat actor that started
        (or restarted) after the last change learn it."""
        while True:
            await asyncio.sleep(self.config.heartbeat_interval)
            if not self._finished.is_set():
                await self._publish_state()

    async def _result(
        self, command_id: str, status: CommandStatus, detail: str = "", in_flight: int | None = None
    ) -> None:
        n = self._counts[command_id, status] = self._counts.get((command_id, status), 0) + 1
        if status in ("rejected", "done", "failed"):
            for other in ("accepted", "in_progress", status):
                self._counts.pop((command_id, other), None)
        result = CommandResult(
            command_id=command_id,
            node_id=self.config.node_id,
            cluster=self.config.cluster,
            status=status,
            ts=time.time(),
            detail=detail,
            schedulability=self.store.state.schedulability,
            in_flight=in_flight,
        )
        body = codec.encode(result)
        headers = self.key.headers(body)
        headers["Nats-Msg-Id"] = f"{command_id}:{status}:{n}"
        try:
            await self.bus.js.publish(
                self.result_subject, body, timeout=PUBLISH_TIMEOUT, headers=headers
            )
        except (nats.errors.Error, TimeoutError) as exc:
            log.warning(
                "command result not published", extra={"id": command_id, "reason": str(exc)}
            )
