"""Gateway actor: a local OpenAI-compatible API in front of the node's workloads.

Clients on the node (or a proxy in front of it) call one port, ``127.0.0.1:gateway_port``,
whatever engine serves a model and wherever it listens; beyond loopback (``gateway_host``)
it serves TLS and checks API keys or client certificates (:mod:`actors.node.gateway.access`)
and its URL goes out in the ``gateway`` event, for the heartbeat to advertise.
``GET /v1/models`` lists the models of the ready workloads; ``POST /v1/chat/completions``
and ``/v1/completions`` are passed, body untouched, to a ready workload serving the
requested ``model`` (its ``model`` or its ``name``), and the answer comes back as the
workload sends it, chunk by chunk (server-sent
events are never buffered). The workload is chosen by: fewest requests in flight and
waiting at the gateway, then most free memory on its GPUs. Each workload takes
``gateway_max_in_flight`` requests at once; up to its ``max_pending`` more wait; beyond
that the answer is 429. A model whose workloads are still loading answers 503, an unknown
one 404, and a draining node 503 to every new request while those it holds finish: the
gateway publishes what it holds as the ``gateway`` event, and a drain waits for it.

Everything the gateway knows it learns from the node's signed events, like any actor:
the workloads from ``workloads``, schedulability from ``state``, free GPU memory from
``sample``. Errors are OpenAI's JSON (``{"error": {"message", "type", "param", "code"}}``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Final

import aiohttp
import msgspec
import nats.errors
from aiohttp import web

from actors.node.config import AgentConfig
from actors.node.events import NodeEvents
from actors.node.gateway.access import Access, Refusal
from actors.node.gateway.autostart import Autostart
from actors.node.gateway.lanes import Lane, matching, served_as
from actors.node.gateway.upstream import pass_through
from actors.runtime.atomic_file import write_atomically
from actors.runtime.bus import Bus
from actors.runtime.schedule import Backoff, wait_or_timeout
from actors.runtime.subscriptions import listening
from actors.runtime.supervisor import FatalError
from actors.runtime.web import HttpLimits, serving
from schemas.base import MAX_TEXT
from schemas.events import Event, Gateway, NodeState, Sample, Workload, Workloads
from schemas.subjects import EVENT_GATEWAY, Subjects

log = logging.getLogger(__name__)

PORT_FILE: Final = "gateway.port"
PROXIED: Final = ("/v1/chat/completions", "/v1/completions")
REFUSING: Final = ("draining", "drained")
"""Schedulabilities in which no new request is routed (a cordon keeps serving: it stops
new workloads from being placed, not the ones there from answering)."""
RETRY_LOADING: Final = 5
RETRY_BUSY: Final = 1
RETRY_LATER: Final = 30
UNKNOWN_MODEL: Final = "unknown"
"""The metrics' model label for a request naming no model this node serves."""
BIND_RETRY_MAX: Final = 60.0
PUBLISH_MIN_INTERVAL: Final = 0.1
"""Least seconds between two ``gateway`` events (a drain sees a change at most that late)."""


class _Body(msgspec.Struct):
    """What routing reads of a request body; the body itself is passed on untouched."""

    model: str = ""


class GatewayActor:
    """Subscribes to fleet.evt.<node>.*; publishes Gateway on fleet.evt.<node>.gateway and
    serves the OpenAI-compatible API on gateway_host:gateway_port."""

    name = "gateway"

    def __init__(
        self, config: AgentConfig, bus: Bus, events: NodeEvents, access: Access | None = None
    ) -> None:
        self.config = config
        self.bus = bus
        self.events = events
        self.metrics = events.metrics.gateway
        self.subjects = Subjects(config.prefix)
        self.subject = self.subjects.event(config.node_id, EVENT_GATEWAY)
        self.access = access or Access(config)
        """TLS and client checks (built by the agent before it connects, so a bad file is
        a one-line error at start)."""
        self.autostart = Autostart(config, bus, events) if config.gateway_autostart else None
        self._lanes_changed = asyncio.Event()
        self.lanes: dict[str, Lane] = {}
        self.schedulability = "schedulable"
        self.deregistering = False
        self.free_memory: dict[int, int] = {}
        self.in_flight = 0
        self.waiting = 0
        self.held_by_port: dict[int, int] = {}
        """Requests held per workload port (a lane replaced by a restart keeps counting)."""
        self.port: int | None = None
        """The bound port while serving (``gateway_port = 0`` picks a free one)."""
        self._problem = ""
        self._wanted = asyncio.Event()
        self.always = config.gateway == "on" or (
            config.gateway == "auto" and self.autostart is not None
        )
        """Listening from the start: ``on``, or ``auto`` with servers started on demand."""
        if self.always:
            self._wanted.set()
        self._changed = asyncio.Event()
        """Set when what the gateway holds changes (the publisher waits for it)."""
        self._wake = asyncio.Event()
        """Set when it may be time to stop listening (the server waits for it)."""
        self._session: aiohttp.ClientSession | None = None

    def problem(self) -> str:
        """Why the gateway should listen and does not ("" when all is well)."""
        return self._problem

    # What the node says ------------------------------------------------------------------

    async def _on_event(self, event: Event) -> None:
        match event:
            case Workloads():
                self._observe_workloads(event.workloads)
            case NodeState():
                self.schedulability = event.schedulability
                self.deregistering = event.deregistering
            case Sample():
                self.free_memory = {
                    gpu.index: max(0, gpu.memory_total - gpu.memory_used)
                    for gpu in event.gpus
                    if not gpu.lost
                }

    def _observe_workloads(self, workloads: list[Workload]) -> None:
        lanes: dict[str, Lane] = {}
        for workload in workloads:
            if workload.state == "stopped":
                continue
            lane = self.lanes.get(workload.name)
            # A workload restarted on another port is a new lane; requests still held by
            # the old one finish there and are counted by the actor's own totals.
            if lane is None or lane.workload.port != workload.port:
                lane = Lane(workload, asyncio.Semaphore(self.config.gateway_max_in_flight))
            lane.workload = workload
            lanes[workload.name] = lane
        self.lanes = lanes
        self._lanes_changed.set()
        # A workload leaving ``ready`` (a model switch) waits for what the gateway holds
        # of it: say it now, not at the next period.
        self._changed.set()
        if self.config.gateway != "auto" or self.always or bool(lanes) == self._wanted.is_set():
            return
        if lanes:
            log.info("gateway starts: the node runs a workload")
            self._wanted.set()
        else:
            log.info("gateway stops once idle: the node runs no workload")
            self._wanted.clear()
        self._wake.set()

    # Routing -----------------------------------------------------------------------------

    def choose(self, model: str) -> Lane:
        """The lane a new request for ``model`` goes to; :class:`Refusal` if none."""
        if self.schedulability in REFUSING or self.deregistering:
            raise Refusal(
                503,
                f"this node is {self.schedulability}: it takes no new requests",
                "unavailable_error",
                "node_draining",
                RETRY_LATER,
            )
        matching = self._matching(model)
        if not matching:
            raise Refusal(
                404,
                f"the model {model!r} does not exist on this node",
                "invalid_request_error",
                "model_not_found",
            )
        ready = [lane for lane in matching if lane.workload.state == "ready"]
        if not ready:
            if any(lane.workload.state == "starting" for lane in matching):
                raise Refusal(
                    503,
                    f"the model {model!r} is loading",
                    "unavailable_error",
                    "model_loading",
                    RETRY_LOADING,
                )
            states = ", ".join(sorted({lane.workload.state for lane in matching}))
            raise Refusal(
                503,
                f"the model {model!r} is not being served ({states})",
                "unavailable_error",
                "model_unavailable",
                RETRY_LATER,
            )
        limit = self.config.gateway_max_in_flight
        room = [lane for lane in ready if lane.load < limit + lane.workload.max_pending]
        if not room:
            raise Refusal(
                429,
                f"every workload serving {model!r} is busy and its queue is full",
                "rate_limit_error",
                "queue_full",
                RETRY_BUSY,
            )
        return min(room, key=lambda lane: (lane.load, -self._free(lane.workload)))

    def _matching(self, model: str) -> list[Lane]:
        return matching(self.lanes.values(), model)

    async def _autostarted(self, model: str, autostart: Autostart) -> None:
        """Have a server for ``model`` started if nothing serves it and model_dir holds it,
        and wait (at most gateway_autostart_timeout) until one serving it is ready or
        failed; :meth:`choose` then answers as for any model."""
        deadline = time.monotonic() + self.config.gateway_autostart_timeout
        name = ""
        while (left := deadline - time.monotonic()) > 0:
            states = {lane.workload.state for lane in self._matching(model)}
            if "ready" in states or (states and "starting" not in states):
                return
            if not states:
                if self.schedulability in REFUSING or self.deregistering:
                    return
                if not name:
                    path = autostart.model_file(model)
                    if path is None:
                        return
                    if self.schedulability != "schedulable":
                        raise Refusal(
                            503,
                            f"this node is {self.schedulability}: it starts no new server",
                            "unavailable_error",
                            "node_cordoned",
                            RETRY_LATER,
                        )
                    loads = [(lane.workload, lane.load) for lane in self.lanes.values()]
                    name = await autostart.start(path, loads, self.free_memory)
                elif autostart.overdue(name):
                    raise Refusal(
                        503,
                        f"the server for {model!r} was not started (the node's command "
                        "results say why)",
                        "unavailable_error",
                        "model_unavailable",
                        RETRY_LATER,
                    )
            self._lanes_changed.clear()
            await wait_or_timeout(self._lanes_changed, min(left, 1.0))

    def _free(self, workload: Workload) -> int:
        return sum(self.free_memory.get(gpu, 0) for gpu in workload.gpus)

    # Serving -----------------------------------------------------------------------------

    async def models(self, request: web.Request) -> web.Response:
        seen: dict[str, Workload] = {}
        for lane in self.lanes.values():
            if lane.workload.state == "ready":
                seen.setdefault(served_as(lane.workload), lane.workload)
        data = [
            {"id": model, "object": "model", "created": int(w.since), "owned_by": w.engine}
            for model, w in seen.items()
        ]
        return web.json_response({"object": "list", "data": data})

    async def proxy(self, request: web.Request) -> web.StreamResponse:
        started = time.monotonic()
        label = UNKNOWN_MODEL
        status = 500
        try:
            try:
                body = await request.read()
                # JSON is UTF-8 (RFC 8259); msgspec raises UnicodeDecodeError for bad bytes
                # inside a string it reads and skips those in a field it does not.
                body.decode("utf-8")
                model = msgspec.json.decode(body, type=_Body).model
            except (msgspec.DecodeError, UnicodeDecodeError) as exc:
                raise Refusal(
                    400,
                    f"the body is not a JSON request: {exc}",
                    "invalid_request_error",
                    "invalid_json",
                ) from None
            if not model:
                raise Refusal(
                    400, "the request names no model", "invalid_request_error", "model_missing"
                )
            if len(model) > MAX_TEXT or not model.isprintable():
                raise Refusal(
                    400,
                    f"a model's name is at most {MAX_TEXT} printable characters (no control "
                    "characters, NUL included)",
                    "invalid_request_error",
                    "invalid_model",
                )
            if self.autostart is not None:
                await self._autostarted(model, self.autostart)
            matching = self._matching(model)
            if matching:  # one label per model, whether asked for by model or by name
                label = served_as(matching[0].workload)
            lane = self.choose(model)
            response = await self._forward(request, lane, body, label)
            status = response.status
            return response
        except Refusal as refusal:
            status = refusal.status
            return refusal.response()
        except web.HTTPException as exc:  # e.g. 413 from reading an oversized body
            status = exc.status
            raise
        finally:
            self.metrics.requests.labels(label, str(status)).inc()
            self.metrics.latency.labels(label).observe(time.monotonic() - started)

    async def _forward(
        self, request: web.Request, lane: Lane, body: bytes, label: str
    ) -> web.StreamResponse:
        self._count(lane, label, waiting=1)
        try:
            async with asyncio.timeout(self.config.gateway_queue_timeout):
                await lane.slots.acquire()
        except TimeoutError:
            raise Refusal(
                429,
                f"waited {self.config.gateway_queue_timeout:g}s for workload "
                f"{lane.workload.name!r}",
                "rate_limit_error",
                "queue_timeout",
                RETRY_BUSY,
            ) from None
        finally:
            self._count(lane, label, waiting=-1)
        self._count(lane, label, in_flight=1)
        try:
            assert self._session is not None
            # A gateway that checks API keys keeps them: the engine never sees a client's key.
            return await pass_through(
                self._session,
                request,
                lane.workload,
                body,
                keep_authorization=self.access.keys is None,
                read_timeout=self.config.gateway_read_timeout,
            )
        finally:
            lane.slots.release()
            self._count(lane, label, in_flight=-1)

    def _count(self, lane: Lane, label: str, *, in_flight: int = 0, waiting: int = 0) -> None:
        lane.in_flight += in_flight
        lane.waiting += waiting
        port = lane.workload.port
        held = self.held_by_port.get(port, 0) + in_flight + waiting
        if held:
            self.held_by_port[port] = held
        else:
            self.held_by_port.pop(port, None)
        self.in_flight += in_flight
        self.waiting += waiting
        self.metrics.in_flight.labels(label).inc(in_flight)
        self.metrics.queue_depth.labels(label).inc(waiting)
        self._changed.set()
        self._wake.set()

    def app(self) -> web.Application:
        middlewares = [self.access.browser_guard()]
        if self.access.checks:
            middlewares.append(self.access.middleware())
        app = web.Application(
            client_max_size=self.config.gateway_max_request_bytes, middlewares=middlewares
        )
        app.router.add_get("/v1/models", self.models)
        for path in PROXIED:
            app.router.add_post(path, self.proxy)
        return app

    # Running -----------------------------------------------------------------------------

    async def run(self, ready: Callable[[], None]) -> None:
        routes = {
            self.subjects.events(self.config.node_id): self.events.decoding(
                self.name, self._on_event
            )
        }
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(
                total=None,
                connect=self.config.gateway_connect_timeout,
                sock_read=self.config.gateway_read_timeout,
            ),
            # Bounded by the lanes' slots, not by the connector.
            connector=aiohttp.TCPConnector(limit=0),
        )
        try:
            async with listening(self.bus, routes):
                tasks = [
                    asyncio.create_task(self._publish_forever(), name="gateway-publish"),
                    asyncio.create_task(self._serve_forever(), name="gateway-serve"),
                ]
                ready()
                try:
                    await asyncio.gather(*tasks)
                finally:
                    for task in tasks:
                        task.cancel()
                    await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            await self._session.close()
            self._session = None

    async def _serve_forever(self) -> None:
        """Listen once wanted; a port that cannot be bound is a problem (``/healthz``
        says so) retried with backoff, never the end of the agent."""
        limits = HttpLimits(
            max_connections=self.config.gateway_max_connections,
            request_timeout=self.config.gateway_request_timeout,
            header_timeout=self.config.gateway_header_timeout,
            max_request_bytes=self.config.gateway_max_request_bytes,
        )
        backoff = Backoff(1.0, BIND_RETRY_MAX)
        while True:
            await self._wanted.wait()
            try:
                async with serving(
                    self.app(),
                    self.config.gateway_host,
                    self.config.gateway_port,
                    limits,
                    self.access.tls,
                ) as port:
                    self.port = port
                    self._problem = ""
                    backoff.reset()
                    self._changed.set()
                    self.port_file.parent.mkdir(parents=True, exist_ok=True)
                    write_atomically(self.port_file, f"{port}\n".encode())
                    await self._until_unwanted()
            except FatalError as exc:
                self._problem = str(exc)
                log.error("gateway not serving", extra={"reason": str(exc)})
                await asyncio.sleep(backoff.next())
            finally:
                if self.port is not None:
                    self.port = None
                    self._changed.set()
                    self.port_file.unlink(missing_ok=True)

    async def _until_unwanted(self) -> None:
        """Return once the gateway should no longer listen and holds no request (under
        ``auto``, when the last workload is gone); never under ``on``."""
        while self._wanted.is_set() or self.in_flight or self.waiting:
            self._wake.clear()
            await self._wake.wait()
        log.info("gateway stops listening: no workload left")

    async def _publish_forever(self) -> None:
        """Publish what the gateway holds whenever it changes, and every heartbeat
        interval (a level, so an actor that starts late learns it)."""
        while True:
            self._changed.clear()
            held = self.in_flight + self.waiting
            event = Gateway(
                ts=time.time(),
                serving=self.port is not None,
                in_flight=self.in_flight,
                waiting=self.waiting,
                held_by_port=dict(self.held_by_port),
                endpoint=self.access.endpoint(self.port) if self.port is not None else "",
            )
            try:
                await self.events.publish(self.bus, self.subject, event)
            except nats.errors.Error as exc:
                log.warning("gateway event not published", extra={"reason": str(exc)})
            published_at = time.monotonic()
            await wait_or_timeout(self._changed, self.config.heartbeat_interval)
            if held == 0 and self.in_flight + self.waiting:
                continue  # idle to busy goes out at once: a drain starting now must see it
            # Other changes within PUBLISH_MIN_INTERVAL go out together: under load each
            # request would otherwise be two signed events for each of the node's actors.
            await asyncio.sleep(max(0.0, published_at + PUBLISH_MIN_INTERVAL - time.monotonic()))

    @property
    def port_file(self) -> Path:
        """``<state_dir>/gateway.port``: the bound port, for clients of a gateway whose
        port was picked for it (``gateway_port = 0``)."""
        return Path(self.config.state_dir) / PORT_FILE
