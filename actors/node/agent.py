"""One node agent: connect, build the node's actors, supervise them, shut down in order."""

from __future__ import annotations

import asyncio
import logging
import math
from pathlib import Path

from actors.node.commands.actor import CommandsActor
from actors.node.config import AgentConfig
from actors.node.engine import EngineActor
from actors.node.events import NodeEvents
from actors.node.health.actor import HealthActor
from actors.node.heartbeat.actor import HeartbeatActor
from actors.node.heartbeat.sequence import SequenceStore
from actors.node.http_api import HttpApiActor
from actors.node.inventory.actor import InventoryActor
from actors.node.latency import LatencyActor
from actors.node.metrics import AgentMetrics
from actors.node.spot import SpotActor
from actors.node.standing import StandingActor
from actors.runtime import notify
from actors.runtime.bus import NatsBus
from actors.runtime.supervisor import Actor, ActorStatus, Supervisor, unhealthy
from actors.runtime.tls import client_context
from schemas.signing import load_key_file

log = logging.getLogger(__name__)


def inbox_prefix(node_id: str) -> str:
    """Replies to a node arrive under a prefix of its own, so a server can let each node
    read only its own replies (deploy/nats/auth.conf)."""
    return f"_INBOX.{node_id}"


class NodeAgent:
    """The node's actors around one NATS connection."""

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.key = load_key_file(config.key_path)
        self.tls = client_context(config.tls_ca, config.tls_cert, config.tls_key)
        self.sequence = SequenceStore(Path(config.state_dir))
        self.metrics = AgentMetrics()
        self.bus: NatsBus | None = None
        self.supervisor: Supervisor | None = None
        self.commands: CommandsActor | None = None
        self.standing: StandingActor | None = None

    def build_actors(self, bus: NatsBus) -> list[Actor]:
        events = NodeEvents(self.config, self.key, self.metrics)
        self.commands = CommandsActor(self.config, bus, events)
        self.standing = standing = StandingActor(self.config, bus)
        return [
            InventoryActor(self.config, bus, events),
            HeartbeatActor(self.config, bus, events, self.sequence),
            HealthActor(self.config, bus, events),
            EngineActor(self.config, bus, events),
            LatencyActor(self.config, bus, events),
            HttpApiActor(self.config, bus, events, self.actor_status, standing.message),
            self.commands,
            SpotActor(self.config, bus, events),
            standing,
        ]

    def actor_status(self) -> dict[str, ActorStatus]:
        """The supervisor's view of every actor (runtime state, handed to the http actor)."""
        return self.supervisor.check() if self.supervisor is not None else {}

    async def start(self) -> None:
        self.bus = await NatsBus.connect(
            self.config.server,
            name=f"node-agent:{self.config.node_id}",
            nkey_seed=self.key.seed if self.config.nkey_auth else None,
            connect_timeout=self.config.connect_timeout,
            retry_forever=True,
            inbox_prefix=inbox_prefix(self.config.node_id),
            js_api_prefix=self.config.js_api_prefix,
            tls=self.tls,
        )
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

    async def stop(self) -> None:
        """Stop taking commands and finish (or deregister) within the shutdown timeout,
        then stop actors, then drain the connection, each bounded by that timeout."""
        timeout = self.config.shutdown_timeout
        if self.commands is not None:
            await self.commands.shutdown(timeout, self.config.deregister_on_shutdown)
        if self.supervisor is not None:
            await self.supervisor.stop(timeout)
        if self.bus is not None:
            await self.bus.close(timeout)
        log.info("node agent stopped", extra={"node": self.config.node_id})

    async def run_until(self, stop: asyncio.Event) -> None:
        """Run until ``stop`` is set or an actor finishes or fails fatally. ``stop`` is
        honoured in every phase, the first connection's retries included (under systemd a
        stop that waited for NATS would end in SIGKILL)."""
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
