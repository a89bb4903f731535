"""HTTP actor: the agent's local window for Prometheus, liveness probes and operators.

``/metrics`` is the agent's own registry, ``/healthz`` is 200 only while every actor runs
and none reports a problem (its command consumer missing, say: what systemd watchdogs
and Kubernetes probes want), ``/status`` is the node as its actors see it, in JSON, and
``/v1/node/inventory`` what the node has (``NodeInventory``: GPUs, passthrough GPUs,
capacity, engines, workloads, labels). What it shows it learns like any other actor,
from the node's own events on the bus; actor phases come from the runtime's supervisor
through ``actor_status``.
Bound to 127.0.0.1 by default: nothing here is meant for the network at large.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import web

from actors.node.config import HTTP_PORT_FILE, AgentConfig
from actors.node.events import NodeEvents
from actors.node.gpu.capacity import with_workloads
from actors.node.labels import cloud_labels, found_labels, node_labels
from actors.runtime.atomic_file import write_atomically
from actors.runtime.bus import Bus
from actors.runtime.subscriptions import listening
from actors.runtime.supervisor import StatusSource
from actors.runtime.web import HttpLimits, health_page, prometheus_page, serving
from schemas.events import (
    CloudFacts,
    Engine,
    Event,
    Health,
    Latency,
    NodeState,
    Sample,
    Scheduler,
    Workloads,
)
from schemas.inventory import NodeInventory
from schemas.subjects import Subjects
from schemas.version import AGENT_VERSION

log = logging.getLogger(__name__)


class HttpApiActor:
    """Subscribes to fleet.evt.<node>.*; publishes nothing, serves /metrics, /healthz,
    /status, /v1/node/inventory."""

    name = "http_api"

    def __init__(
        self,
        config: AgentConfig,
        bus: Bus,
        events: NodeEvents,
        actor_status: StatusSource,
        refused: Callable[[], str] | None = None,
    ) -> None:
        self.config = config
        self.bus = bus
        self.events = events
        self.metrics = events.metrics
        self.actor_status = actor_status
        self.refused = refused
        """Says "heartbeats refused by the aggregator: <kind>" while they are (standing actor)."""
        self.subjects = Subjects(config.prefix)
        self.port: int | None = None
        """The bound port once serving (``http_port = 0`` picks a free one)."""
        self.health: Health | None = None
        self.engine: Engine | None = None
        self.latency: Latency | None = None
        self.state: NodeState | None = None
        self.scheduler: Scheduler | None = None
        self.workloads: Workloads | None = None
        self.sample: Sample | None = None
        self.cloud: dict[str, str] = {}
        self.gpus_seen_at: float | None = None

    async def _on_event(self, event: Event) -> None:
        match event:
            case Sample():
                self.metrics.observe_gpus(event.gpus)
                self.sample = event
                self.gpus_seen_at = event.ts
            case CloudFacts():
                self.cloud = cloud_labels(event)
            case Health():
                self.health = event
                self.metrics.observe_health(event)
            case Engine():
                self.engine = event
                self.metrics.observe_engine(event)
            case Latency():
                self.latency = event
            case NodeState():
                self.state = event
            case Scheduler():
                self.scheduler = event if event.kind == "slurm" else None
            case Workloads():
                self.workloads = event

    async def metrics_page(self, request: web.Request) -> web.Response:
        return prometheus_page(self.metrics.registry)

    async def healthz(self, request: web.Request) -> web.Response:
        return health_page(self.actor_status())

    def status(self) -> dict[str, Any]:
        seq = self.metrics.value("node_agent_sequence_number")
        return {
            "node": self.config.node_id,
            "cluster": self.config.cluster,
            "agent_version": AGENT_VERSION,
            "uptime_s": round(time.time() - self.metrics.started, 1),
            "schedulability": self.state.schedulability if self.state else "schedulable",
            "schedulability_reason": self.state.reason if self.state else "",
            "seq": int(seq) if seq else None,
            "refused": self.refused() if self.refused is not None else "",
            "health": self.health,
            "engine": self.engine,
            "latency": self.latency,
            "scheduler": self.scheduler,
            "workloads": self.workloads.workloads if self.workloads else [],
            "gpu_source": self.sample.gpu_source if self.sample else None,
            "gpus": self.sample.gpus if self.sample else [],
            "passthrough_gpus": self.sample.passthrough_gpus if self.sample else [],
            "actors": {
                name: {
                    "phase": s.phase,
                    "restarts": s.restarts,
                    "last_error": s.last_error,
                    "problem": s.problem,
                }
                for name, s in self.actor_status().items()
            },
        }

    async def status_page(self, request: web.Request) -> web.Response:
        return web.Response(
            body=msgspec.json.encode(self.status()), content_type="application/json"
        )

    def inventory(self) -> NodeInventory:
        """What the node has, as its actors last said: the sample (with the GPUs its
        workloads pin taken), engines, workloads and labels (as in the heartbeat)."""
        workloads = self.workloads.workloads if self.workloads else []
        found = found_labels(self.sample, self.cloud, self.engine)
        return NodeInventory(
            node_id=self.config.node_id,
            cluster=self.config.cluster,
            ts=time.time(),
            sample=with_workloads(self.sample, workloads) if self.sample else None,
            engine=self.engine,
            workloads=workloads,
            labels=node_labels(self.config.labels, found),
            found_labels=found,
        )

    async def inventory_page(self, request: web.Request) -> web.Response:
        return web.Response(
            body=msgspec.json.encode(self.inventory()), content_type="application/json"
        )

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/metrics", self.metrics_page)
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/status", self.status_page)
        app.router.add_get("/v1/node/inventory", self.inventory_page)
        return app

    async def run(self, ready: Callable[[], None]) -> None:
        limits = HttpLimits(
            max_connections=self.config.http_max_connections,
            request_timeout=self.config.http_request_timeout,
        )
        routes = {
            self.subjects.events(self.config.node_id): self.events.decoding(
                self.name, self._on_event
            )
        }
        try:
            # Ready only once serving, so the port is known and /healthz answers.
            async with (
                listening(self.bus, routes),
                serving(self.app(), self.config.http_host, self.config.http_port, limits) as port,
            ):
                self.port = port
                self.port_file.parent.mkdir(parents=True, exist_ok=True)
                write_atomically(self.port_file, f"{port}\n".encode())
                ready()
                await asyncio.Event().wait()  # serve until cancelled
        finally:
            self.port = None
            self.port_file.unlink(missing_ok=True)

    @property
    def port_file(self) -> Path:
        """``<state_dir>/http.port``: the bound port, so ``node-agent status`` finds an
        agent serving on a port picked for it (``http_port = 0``, as in ``fleetctl up``)."""
        return Path(self.config.state_dir) / HTTP_PORT_FILE
