"""One node agent: connect, build the node's actors, supervise them, shut down in order."""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
from pathlib import Path

from actors.node.commands.actor import CommandsActor
from actors.node.config import AgentConfig
from actors.node.engine import EngineActor
from actors.node.events import NodeEvents
from actors.node.gateway.access import Access
from actors.node.gateway.actor import GatewayActor
from actors.node.health.actor import HealthActor
from actors.node.heartbeat.actor import HeartbeatActor
from actors.node.heartbeat.sequence import SequenceStore
from actors.node.http_api import HttpApiActor
from actors.node.inventory.actor import InventoryActor
from actors.node.latency import LatencyActor
from actors.node.metrics import AgentMetrics
from actors.node.scheduler import SchedulerActor
from actors.node.settings.actor import SettingsActor, at_start
from actors.node.settings.entries import Held
from actors.node.spot import SpotActor
from actors.node.standing import StandingActor
from actors.node.workloads.actor import WorkloadsActor
from actors.runtime import logs, notify
from actors.runtime.bus import NatsBus, move_backoff
from actors.runtime.config import Layers
from actors.runtime.supervisor import Actor, ActorStatus, Supervisor, unhealthy
from actors.runtime.tls import client_context
from schemas.signing import load_key_file

log = logging.getLogger(__name__)

STOP_STEP_TIMEOUT = 10.0
"""Longest stopping the actors, and then draining the connection, may each take once the
shutdown drain is over: a stop takes at most shutdown_timeout + 2 x this."""


def inbox_prefix(node_id: str) -> str:
    """Replies to a node arrive under a prefix of its own, so a server can let each node
    read only its own replies (deploy/nats/auth.conf), with a random token per connection,
    so no one can name this connection's inboxes without having been told one. (No node
    may publish to them anyway: only FLEET's answers land there.)"""
    return f"_INBOX.{node_id}.{secrets.token_hex(8)}"


class NodeAgent:
    """The node's actors around one NATS connection."""

    def __init__(self, config: AgentConfig, layers: Layers[AgentConfig] | None = None) -> None:
        self.config = config
        """The node's own config until it starts; from then on, with the fleet's settings
        taken at start (what its actors start with)."""
        self.layers = layers or Layers.of(config)
        """Where ``config`` came from, for the fleet's settings to go in between."""
        self.key = load_key_file(config.key_path)
        self.tls = client_context(config.tls_ca, config.tls_cert, config.tls_key)
        self.gateway_access = Access(config)
        self.sequence = SequenceStore(Path(config.state_dir))
        self.metrics = AgentMetrics()
        self.metrics.identify(config.node_id, config.cluster)
        self.events = NodeEvents(config, self.key, self.metrics)
        """The actors' event channel, with this process's session: what they act on."""
        self.held = Held(Path(config.state_dir), self.key.public_key)
        """The fleet's settings entries this node took (and keeps across restarts)."""
        self.bus: NatsBus | None = None
        self.supervisor: Supervisor | None = None
        self.commands: CommandsActor | None = None
        self.inventory: InventoryActor | None = None
        self.standing: StandingActor | None = None
        self.heartbeat: HeartbeatActor | None = None

    def build_actors(self, bus: NatsBus) -> list[Actor]:
        events = self.events
        self.commands = CommandsActor(self.config, bus, events)
        self.inventory = InventoryActor(self.config, bus, events)
        self.standing = standing = StandingActor(self.config, bus)
        self.heartbeat = HeartbeatActor(self.config, bus, events, self.sequence)
        return [
            self.inventory,
            self.heartbeat,
            SettingsActor(self.config, bus, events, self.layers, self.held),
            HealthActor(self.config, bus, events),
            EngineActor(self.config, bus, events),
            LatencyActor(self.config, bus, events),
            HttpApiActor(self.config, bus, events, self.actor_status, standing.message),
            # Before the command executor: subscribed before the first order can come.
            WorkloadsActor(self.config, bus, events),
            self.commands,
            SpotActor(self.config, bus, events),
            GatewayActor(self.config, bus, events, self.gateway_access),
            SchedulerActor(self.config, bus, events),
            standing,
        ]

    def actor_status(self) -> dict[str, ActorStatus]:
        """The supervisor's view of every actor (runtime state, handed to the http actor)."""
        return self.supervisor.check() if self.supervisor is not None else {}

    async def start(self) -> None:
        # Every task started here (the connection's, the actors') logs with this node's
        # id as a field; the binding ends with this call, so a process running several
        # agents (fleetctl up) tags each agent's lines with its own node.
        with logs.bound(node=self.config.node_id):
            await self._start()

    async def _start(self) -> None:
        self.bus = await NatsBus.connect(
            self.config.server,
            name=f"node-agent:{self.config.node_id}",
            nkey_seed=self.key.seed if self.config.nkey_auth else None,
            connect_timeout=self.config.connect_timeout,
            retry_forever=True,
            inbox_prefix=inbox_prefix(self.config.node_id),
            js_api_prefix=self.config.js_api_prefix,
            tls=self.tls,
            move_backoff=move_backoff(self.config.stale_after),
        )
        await self.take_fleet_settings(self.bus)
        self.supervisor = Supervisor(self.build_actors(self.bus))
        self.supervisor.start()
        log.info(
            "node agent started",
            extra={
                "node": self.config.node_id,
                "cluster": self.config.cluster,
                "public_key": self.key.public_key,
            },
        )

    async def take_fleet_settings(self, bus: NatsBus) -> None:
        """Start with the fleet's settings for this node (those read only at start
        included): the held ones and one read of the bucket."""
        outcome = await at_start(bus, self.layers, self.held, self.metrics)
        if outcome.config.log_level != self.config.log_level:
            logging.getLogger().setLevel(outcome.config.log_level.upper())
        self.config = outcome.config
        if outcome.status.applied or outcome.status.refused:
            log.info(
                "fleet settings taken at start",
                extra={
                    "revision": outcome.status.revision,
                    "applied": sorted(outcome.status.applied),
                    "refused": outcome.status.refused,
                },
            )

    async def stop(self, goodbye: bool = True) -> None:
        """Stop taking commands and drain, finish or deregister within the shutdown
        timeout, send the goodbye heartbeat (unless not ``goodbye``: an agent that leaves
        as a crashed one would, for tests of stale detection in one process), then stop
        actors, then drain the connection, each of those two bounded by STOP_STEP_TIMEOUT
        (systemd's TimeoutStopSec must exceed the sum)."""
        with logs.bound(node=self.config.node_id):
            await self._stop(goodbye)

    async def _stop(self, goodbye: bool) -> None:
        timeout = self.config.shutdown_timeout
        if self.commands is not None:
            await self.commands.shutdown(
                timeout, self.config.deregister_on_shutdown, self.config.shutdown_drain
            )
        step = min(timeout, STOP_STEP_TIMEOUT)
        if self.heartbeat is not None and goodbye:
            # A requested stop is not a crash: say goodbye, so the node shows stopped.
            await self.heartbeat.goodbye()
        if self.supervisor is not None:
            await self.supervisor.stop(step)
        if self.inventory is not None:
            # nvmlShutdown, once the inventory no longer reads (waits for a read in flight).
            await asyncio.to_thread(self.inventory.close)
            self.inventory = None
        if self.bus is not None:
            await self.bus.close(step)
        log.info("node agent stopped", extra={"node": self.config.node_id})

    async def run_until(self, stop: asyncio.Event) -> None:
        """Run until ``stop`` is set or an actor finishes or fails fatally. ``stop`` is
        honoured in every phase, the first connection's retries included (under systemd a
        stop that waited for NATS would end in SIGKILL)."""
        with logs.bound(node=self.config.node_id):
            await self._run_until(stop)

    async def _run_until(self, stop: asyncio.Event) -> None:
        starting = asyncio.create_task(self.start())
        stopping_early = asyncio.create_task(stop.wait())
        await asyncio.wait({starting, stopping_early}, return_when=asyncio.FIRST_COMPLETED)
        stopping_early.cancel()
        if not starting.done():
            starting.cancel()
            await asyncio.gather(starting, return_exceptions=True)
            log.info("node agent stopped before connecting", extra={"node": self.config.node_id})
            return
        starting.result()  # raises what start raised
        assert self.supervisor is not None
        finished = asyncio.create_task(self.supervisor.finished.wait())
        stopping = asyncio.create_task(stop.wait())
        systemd = asyncio.create_task(self.notify_systemd(self.supervisor))
        try:
            await asyncio.wait({finished, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (finished, stopping, systemd):
                task.cancel()
            await asyncio.gather(finished, stopping, systemd, return_exceptions=True)
            notify.notify(notify.STOPPING)
            await self.stop()

    async def notify_systemd(self, supervisor: Supervisor) -> None:
        """``READY=1`` once every actor runs, then ``WATCHDOG=1`` at half the watchdog
        interval while ``/healthz`` would answer 200 (no-ops outside systemd's
        ``Type=notify``). An agent whose actors stay down or broken stops feeding the
        watchdog, and systemd restarts it."""
        await supervisor.wait_ready(math.inf)
        notify.notify(notify.READY)
        log.info("node agent ready", extra={"node": self.config.node_id})
        interval = notify.watchdog_interval()
        if interval is None:
            return
        while True:
            if not unhealthy(supervisor.check()):
                notify.notify(notify.WATCHDOG)
            await asyncio.sleep(interval)
