"""Command executor actor: runs operators' signed commands (cordon, drain, uncordon,
deregister) and the node's own reaction to spot interruption notices.

Commands come from a durable pull consumer on FLEET_CMD filtered to this node's subject,
so a command sent while the agent was down runs when it comes back. A command runs only
if it is signed by a trusted operator key, addressed to this node, within its (capped)
lifetime and never seen before (seen ids persist in the state dir until their command
expires); anything else is answered ``rejected`` and changes nothing. Every answer is a
node-signed CommandResult on FLEET_EVENTS naming the digest of the exact body it answers.
A command counts as seen only once that is on disk: if the state file cannot be written the
message is redelivered and runs then, or, still unwritable at its last delivery, is
answered ``failed`` saying so. The node's schedulability persists too, so a restart
keeps a cordon, its TTL and a drain's deadline.
This module decides what to run; :mod:`actors.node.commands.actions` runs it and reports.
A ``deploy`` or ``stop`` is handed to the workload actor as a ``workload_order`` event,
tagged by this process (a deploy is refused here first when the node is not schedulable or
is unhealthy): the workload actor takes orders from this process only, so an operator's
deploy or stop reaches it through these checks or not at all.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path

import nats.errors
from nats.aio.msg import Msg

from actors.node.commands.actions import ActionRunner
from actors.node.commands.checks import Rejection, check_command
from actors.node.commands.store import CommandStore, StoreError
from actors.node.config import AgentConfig
from actors.node.events import NodeEvents
from actors.runtime.bus import DEFAULT_JS_API_PREFIX, Bus
from actors.runtime.consumer import (
    RECREATE_RETRY_MAX,
    DurableConsumer,
    consume_forever,
    pull_config,
)
from actors.runtime.subscriptions import listening
from schemas import codec
from schemas.errors import DecodeError
from schemas.events import (
    Engine,
    Event,
    Gateway,
    Health,
    Interruption,
    Scheduler,
    Workloads,
    notice_key,
)
from schemas.messages import Command, Cordon, Deregister, Heartbeat, command_digest
from schemas.signing import HEADER_KEY
from schemas.subjects import (
    COMMAND_ACK_WAIT,
    COMMAND_MAX_DELIVER,
    EVENT_WORKLOAD_ORDER,
    STREAM_COMMANDS,
    Subjects,
    command_consumer,
)
from schemas.workloads import Deploy, Stop, WorkloadOrder

log = logging.getLogger(__name__)

FETCH_WAIT = 5.0
REBALANCE_TTL = 600.0
"""A rebalance or maintenance notice cordons the node for this long."""
TERMINAL_NOTICES = ("terminate", "stop", "hibernate", "preempt")
REDELIVER_AFTER = 1.0
"""A command whose acceptance could not be saved comes back after this many seconds."""


class CommandsActor:
    """Subscribes to FLEET_CMD, fleet.evt.<node>.* and its own heartbeat; publishes NodeState
    on fleet.evt.<node>.state and CommandResult on fleet.result.<cluster>.<node>."""

    name = "commands"

    def __init__(self, config: AgentConfig, bus: Bus, events: NodeEvents) -> None:
        self.config = config
        self.bus = bus
        self.metrics = events.metrics
        self.subjects = Subjects(config.prefix)
        self.command_subject = self.subjects.command(config.cluster, config.node_id)
        # A node reaching JetStream through another account's imports (js_api_prefix, the
        # shipped permissions) may not create this consumer: the aggregator creates it
        # (actors/fleet/aggregator/command_queues.py). Elsewhere the node creates it, the same.
        # A new node looks for it at least once a heartbeat interval (the pace it already
        # talks to the bus at), so it takes commands within a heartbeat of the aggregator
        # creating it once admitted, not after a doubling wait of up to 15 s.
        durable = command_consumer(config.cluster, config.node_id)
        self.consumer = DurableConsumer(
            bus.js,
            self.subjects.stream_name(STREAM_COMMANDS),
            self.command_subject,
            durable,
            pull_config(
                durable,
                self.command_subject,
                ack_wait=COMMAND_ACK_WAIT,
                max_deliver=COMMAND_MAX_DELIVER,
            ),
            create=bus.js_api_prefix == DEFAULT_JS_API_PREFIX,
            retry_max=min(config.heartbeat_interval, RECREATE_RETRY_MAX),
        )
        self.store = CommandStore(
            Path(config.state_dir), config.max_command_lifetime + config.max_skew
        )
        self.events = events
        self.actions = ActionRunner(config, bus, events, self.store)
        self._fetcher: asyncio.Task[None] | None = None
        self._engine_in_flight = 0
        self._gateway_in_flight = 0
        self.health = ""
        """The node's last health status ("" until the health actor says)."""

    async def run(self, ready: Callable[[], None]) -> None:
        # Node events first, before any await on the network (listening subscribes in
        # this order): the agent starts this actor before the spot watcher, so on one
        # connection our SUB precedes its first notice.
        routes = {
            self.subjects.events(self.config.node_id): self.events.decoding(
                self.name, self._on_event
            ),
            self.subjects.heartbeat(self.config.cluster, self.config.node_id): self.events.own(
                self.name, self._on_beat
            ),
        }
        async with listening(self.bus, routes):
            republisher = asyncio.create_task(self._republish_forever(), name="commands-state")
            try:
                await self.consumer.try_open()
                await self.actions.publish_state()
                await self.actions.resume()
                self._fetcher = asyncio.create_task(
                    consume_forever(
                        self.consumer,
                        self._handle,
                        batch=1,
                        wait=FETCH_WAIT,
                        what="command",
                        dropped=self._count_drop,
                    ),
                    name="commands",
                )
                ready()
                await self._until_finished(self._fetcher)
            finally:
                tasks = [
                    task
                    for task in (republisher, self._fetcher, *self.actions.tasks())
                    if task is not None
                ]
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                await self.consumer.close()

    def problem(self) -> str:
        """Why no command can arrive while this actor runs ("" when they can)."""
        return self.consumer.missing

    async def _until_finished(self, fetcher: asyncio.Task[None]) -> None:
        """Wait until the node has deregistered. A fetcher that fails (the connection
        closed) raises here, so the supervisor restarts the
        actor rather than it silently taking no more commands; one that ``shutdown``
        cancelled does not end the wait."""
        finished = asyncio.create_task(self.actions.finished.wait(), name="commands-finished")
        try:
            await asyncio.wait({finished, fetcher}, return_when=asyncio.FIRST_COMPLETED)
            if fetcher.done() and not fetcher.cancelled():
                fetcher.result()
            await finished
        finally:
            finished.cancel()

    async def shutdown(self, timeout: float, deregister: bool, drain: bool = False) -> None:
        """Stop taking commands, finish the work in progress (deregistering first when
        asked; else, with ``drain``, letting in-flight requests finish), all within
        ``timeout``."""
        deadline = time.monotonic() + timeout
        if self._fetcher is not None:
            self._fetcher.cancel()
        if deregister and not self.actions.finished.is_set() and not self.store.deregister:
            async with self.actions.lock:
                await self.actions.deregister_at_shutdown(timeout / 2)
        elif drain and not self.actions.busy() and not self.actions.finished.is_set():
            # Not after a deregistration, whose drain ran already (and the node is gone).
            await self.actions.drain_at_shutdown(timeout)
        await self.actions.wait_for_work(max(0.0, deadline - time.monotonic()))

    # Commands --------------------------------------------------------------------------

    def _count_drop(self, reason: str) -> None:
        self.metrics.dropped.labels(reason).inc()

    async def _handle(self, msg: Msg) -> None:
        digest = command_digest(msg.data)
        try:
            command = check_command(msg, self.subjects, self.config, self.store)
        except Rejection as refusal:
            log.warning(
                "command refused",
                extra={"id": refusal.command_id, "digest": digest, "reason": refusal.reason},
            )
            await self.actions.result(
                refusal.command_id,
                "rejected",
                refusal.reason,
                digest=digest,
                signer=refusal.signer,
                claimed_id=refusal.claimed_id,
            )
            await msg.ack()
            return
        if isinstance(command.action, Deploy | Stop):
            await self._hand_over(msg, command, command.action, digest)
            return
        async with self.actions.lock:
            if not await self._remember(msg, command, digest):
                return
            signer = (msg.headers or {}).get(HEADER_KEY, "")
            await self.actions.result(
                command.id, "accepted", command.reason, digest=digest, signer=signer
            )
            await msg.ack()
            log.info("command accepted", extra={"id": command.id, "action": command.action})
            await self.actions.start(
                command.id, command.reason, command.action, digest=digest, by=signer
            )

    async def _remember(self, msg: Msg, command: Command, digest: str) -> bool:
        """Save the command's id, kept past its expiry by the skew bound in case this clock
        is stepped back; when the store cannot, the message is given back (nak) for later
        and False returned: a command is never acted on unsaved. At its last delivery the
        command is answered ``failed`` saying why and settled (term), so it never ends
        without a result."""
        try:
            self.store.remember(command.id, command.expires_at + self.config.max_skew)
        except StoreError as exc:
            if msg.metadata.num_delivered < COMMAND_MAX_DELIVER:
                log.error(
                    "command not saved; redelivery", extra={"id": command.id, "reason": str(exc)}
                )
                await msg.nak(delay=REDELIVER_AFTER)
                return False
            log.error("command not saved; not run", extra={"id": command.id, "reason": str(exc)})
            detail = f"not run: {exc} (tried {COMMAND_MAX_DELIVER} times); send it again once fixed"
            await self.actions.result(command.id, "failed", detail, digest=digest)
            await msg.term()
            return False
        return True

    async def _hand_over(
        self, msg: Msg, command: Command, action: Deploy | Stop, digest: str
    ) -> None:
        """A deploy or stop is the workload actor's: refuse a deploy the node's state
        forbids, else remember the id and hand the order over (the workload actor answers
        accepted or rejected, then every step)."""
        state = self.store.state.schedulability
        refusal = ""
        if isinstance(action, Deploy) and state != "schedulable":
            refusal = f"node is {state}: deploys refused (uncordon first)"
        elif isinstance(action, Deploy) and self.health == "unhealthy":
            refusal = "node is unhealthy: deploys refused"
        if refusal:
            log.warning("deploy refused", extra={"id": command.id, "reason": refusal})
            await self.actions.result(command.id, "rejected", refusal, digest=digest)
            await msg.ack()
            return
        async with self.actions.lock:
            if not await self._remember(msg, command, digest):
                return
        order = WorkloadOrder(
            ts=time.time(),
            command_id=command.id,
            action=action,
            command_digest=digest,
            reason=command.reason,
        )
        subject = self.subjects.event(self.config.node_id, EVENT_WORKLOAD_ORDER)
        try:
            await self.events.publish(self.bus, subject, order)
        except nats.errors.Error as exc:
            await self.actions.result(
                command.id, "failed", f"not handed to the workload actor: {exc}", digest=digest
            )
        await msg.ack()
        log.info("command handed to the workload actor", extra={"id": command.id})

    # Events ----------------------------------------------------------------------------

    async def _on_event(self, event: Event) -> None:
        match event:
            case Engine():
                self._engine_in_flight = event.in_flight or 0
                self.actions.observe_in_flight(self._engine_in_flight + self._gateway_in_flight)
            case Gateway():
                # Requests the gateway holds (queued ones too) count toward a drain.
                self._gateway_in_flight = event.in_flight + event.waiting
                self.actions.observe_in_flight(self._engine_in_flight + self._gateway_in_flight)
            case Health():
                self.health = event.status
            case Interruption():
                await self._on_interruption(event)
            case Scheduler():
                self.actions.observe_scheduler(event)
            case Workloads():
                # The fleet moves placed workloads off a draining node: the drain waits
                # for them to be stopped here.
                placed = [w for w in event.workloads if w.placed and w.state != "stopped"]
                self.actions.observe_placed(len(placed))

    async def _on_interruption(self, notice: Interruption) -> None:
        """A termination notice drains before its deadline and deregisters; a rebalance
        or maintenance notice cordons for a while. Each notice acts once (its key is kept
        for max_command_lifetime; the spot watcher publishes a notice once per run)."""
        command_id = f"spot:{notice_key(notice)}"
        age = time.time() - notice.ts
        if age > self.config.max_command_lifetime:
            # Its key may have left the store already: a captured notice sent again must
            # not drain the node a second time.
            log.warning("spot notice older than max_command_lifetime ignored", extra={"age": age})
            return
        async with self.actions.lock:
            if self.store.seen(command_id) or self.actions.finished.is_set():
                return
            try:
                self.store.remember(command_id, time.time() + self.config.max_command_lifetime)
            except StoreError as exc:
                # Acting matters more than remembering: a notice seen again acts again.
                log.error("spot notice not saved", extra={"id": command_id, "reason": str(exc)})
            reason = f"{notice.provider} {notice.kind} notice"
            if notice.kind in TERMINAL_NOTICES:
                if self.store.deregister:
                    return
                deadline = (notice.deadline or time.time()) - self.config.spot_safety_margin
                await self.actions.result(command_id, "accepted", f"{reason}: drain and deregister")
                await self.actions.start(command_id, reason, Deregister(), deadline)
            elif self.store.state.schedulability == "schedulable":
                await self.actions.result(command_id, "accepted", f"{reason}: cordon")
                await self.actions.start(command_id, reason, Cordon(ttl=REBALANCE_TTL))

    async def _on_beat(self, msg: Msg) -> None:
        """This process's own heartbeat, as it went out (``events.own`` passes no other: a
        copy of the node key may publish on this subject too)."""
        try:
            heartbeat = codec.decode(msg.data, Heartbeat, msg.subject)
        except DecodeError:
            return
        # Told, and nothing of the node's workloads left running: it may exit.
        if heartbeat.deregistering and not heartbeat.workloads:
            self.actions.observe_deregistering_beat()

    async def _republish_forever(self) -> None:
        """State is a level, not an edge: repeating it lets a heartbeat actor that started
        (or restarted) after the last change learn it."""
        while True:
            await asyncio.sleep(self.config.heartbeat_interval)
            if not self.actions.finished.is_set():
                await self.actions.publish_state()
