"""Engine actor: health and load of the node's inference engines, published as ``Engine``.

Schedulers and drains need to know whether the node's vLLM / SGLang / llama.cpp server is
up and how many requests it is working on. Every engine is probed concurrently, each HTTP
request bounded by ``engine_timeout``; an engine that hangs, refuses or talks nonsense is
reported unhealthy with the reason, never allowed to crash or stall the actor.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from typing import Literal, cast

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from actors.node.config import AgentConfig
from actors.node.events import NodeEvents
from actors.node.tuning import retuned
from actors.runtime.bus import Bus
from actors.runtime.schedule import sleep_jittered
from actors.runtime.subscriptions import listening
from schemas.base import MAX_ENGINES, MAX_MODELS, MAX_NAME
from schemas.events import Engine, EngineStatus, Event, Workloads
from schemas.settings import Settings
from schemas.subjects import EVENT_ENGINE, Subjects

log = logging.getLogger(__name__)

EngineKind = Literal["vllm", "sglang", "llamacpp"]

# Prometheus gauges (running, waiting) each engine exports on /metrics:
# vLLM docs "Production Metrics"; SGLang docs "Production Metrics";
# llama.cpp tools/server/README.md (/metrics, needs --metrics).
LOAD_METRICS: dict[EngineKind, tuple[str, str]] = {
    "vllm": ("vllm:num_requests_running", "vllm:num_requests_waiting"),
    "sglang": ("sglang:num_running_reqs", "sglang:num_queue_reqs"),
    "llamacpp": ("llamacpp:requests_processing", "llamacpp:requests_deferred"),
}


class ProbeFailed(Exception):
    """The engine answered in a way that makes it unusable; the message is the reason."""


def parse_specs(specs: list[str]) -> list[tuple[EngineKind, str]]:
    """``KIND=URL`` (already validated by the config pattern) to (kind, base URL)."""
    parsed = []
    for spec in specs:
        kind, url = spec.split("=", 1)
        parsed.append((cast(EngineKind, kind), url.rstrip("/")))
    return parsed


def load_from_metrics(text: str, running: str, waiting: str) -> tuple[int, int | None]:
    """Sum each gauge over its label sets (vLLM labels by model and engine).

    A real /metrics page is hundreds of histogram lines; only the two gauges' lines are
    parsed, so a probe costs the same however much else the engine exports. A page
    without the running gauge is not the engine we were told about: that is a failure.
    """
    names = (running, waiting)
    lines = [line for line in text.splitlines() if line.split("{", 1)[0].split(" ", 1)[0] in names]
    totals: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families("\n".join(lines) + "\n"):
            for sample in family.samples:
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    except ValueError as exc:
        raise ProbeFailed(f"/metrics is not Prometheus text: {exc}") from None
    if running not in totals:
        raise ProbeFailed(f"/metrics has no {running}")
    queued = totals.get(waiting)
    return _count(totals[running]), None if queued is None else _count(queued)


def _count(value: float) -> int:
    return max(0, round(value))


def workload_engines(event: Workloads) -> list[tuple[EngineKind, str]]:
    """The ready engine workloads the workload actor runs, to probe like configured ones."""
    return [
        (workload.engine, f"http://127.0.0.1:{workload.port}")
        for workload in event.workloads
        if workload.state == "ready" and workload.engine in LOAD_METRICS
    ]


class EngineActor:
    """Subscribes to fleet.evt.<node>.* (for the node's workloads), polls engines over HTTP;
    publishes Engine on fleet.evt.<node>.engine."""

    name = "engine"

    def __init__(self, config: AgentConfig, bus: Bus, events: NodeEvents) -> None:
        self.config = config
        self.bus = bus
        self.events = events
        self.engines = parse_specs(config.engines)
        self.workloads: list[tuple[EngineKind, str]] = []
        """Ready workloads of the node's workload actor, probed as well (no flag needed)."""
        self.subjects = Subjects(config.prefix)
        self.subject = self.subjects.event(config.node_id, EVENT_ENGINE)

    async def _on_event(self, event: Event) -> None:
        if isinstance(event, Workloads):
            self.workloads = workload_engines(event)
        elif isinstance(event, Settings):
            # The fleet's timing: interval and timeout are read at each probe.
            self.config = retuned(self.config, event)

    async def _get(self, session: aiohttp.ClientSession, url: str) -> tuple[int, str]:
        timeout = aiohttp.ClientTimeout(total=self.config.engine_timeout)
        async with session.get(url, timeout=timeout) as response:
            return response.status, await response.text()

    async def _load(
        self, session: aiohttp.ClientSession, kind: EngineKind, url: str
    ) -> tuple[int | None, int | None, str]:
        """(running, waiting, note) from /metrics; llama.cpp falls back to /slots."""
        running_name, waiting_name = LOAD_METRICS[kind]
        status, body = await self._get(session, f"{url}/metrics")
        if status == 200:
            running, waiting = load_from_metrics(body, running_name, waiting_name)
            return running, waiting, ""
        if kind == "llamacpp":
            # /slots is on by default while /metrics needs --metrics; it knows no queue.
            status, body = await self._get(session, f"{url}/slots")
            if status == 200:
                try:
                    slots = json.loads(body)
                    busy = sum(1 for slot in slots if slot.get("is_processing"))
                except (ValueError, TypeError, AttributeError):
                    raise ProbeFailed("/slots is not a JSON list of slots") from None
                return busy, None, ""
        return None, None, f"no load metrics (/metrics: HTTP {status})"

    async def _models(self, session: aiohttp.ClientSession, url: str) -> list[str]:
        """Served model names from the OpenAI-style ``/v1/models`` (vLLM, SGLang and
        llama.cpp all serve it); [] when it is missing or unreadable: a fact, not health."""
        try:
            status, body = await self._get(session, f"{url}/v1/models")
            if status != 200:
                return []
            names = [entry["id"] for entry in json.loads(body)["data"]]
        except (aiohttp.ClientError, TimeoutError, ValueError, LookupError, TypeError):
            return []
        return [name[:MAX_NAME] for name in names if isinstance(name, str) and name][:MAX_MODELS]

    async def _health(self, session: aiohttp.ClientSession, kind: EngineKind, url: str) -> None:
        status, body = await self._get(session, f"{url}/health")
        if kind == "llamacpp" and status == 503:
            raise ProbeFailed("loading model (/health: 503)")
        if status != 200:
            raise ProbeFailed(f"/health: HTTP {status}")
        if kind == "llamacpp":
            try:
                ok = json.loads(body).get("status") == "ok"
            except (ValueError, AttributeError):
                ok = False
            if not ok:
                raise ProbeFailed(f"/health: unexpected body {body[:80]!r}")

    async def probe(
        self, session: aiohttp.ClientSession, kind: EngineKind, url: str
    ) -> EngineStatus:
        """One engine's status; every failure becomes ``healthy=False`` with a reason."""
        models: list[str] = []
        try:
            await self._health(session, kind, url)
            models = await self._models(session, url)  # a fact even when load is unreadable
            running, waiting, note = await self._load(session, kind, url)
        except ProbeFailed as exc:
            reason = str(exc)
        except TimeoutError:
            reason = f"no answer within {self.config.engine_timeout:g}s"
        except aiohttp.ClientConnectorError as exc:
            reason = f"cannot connect: {exc.os_error.strerror or exc.os_error}"
        except aiohttp.ClientError as exc:
            reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        except ValueError as exc:  # e.g. a body that is not UTF-8
            reason = f"unreadable answer: {exc}"
        else:
            return EngineStatus(
                kind=kind,
                url=url,
                healthy=True,
                in_flight=running,
                waiting=waiting,
                reason=note,
                checked_at=time.time(),
                models=models,
            )
        log.debug("engine unhealthy", extra={"engine": kind, "url": url, "reason": reason})
        return EngineStatus(
            kind=kind, url=url, healthy=False, reason=reason, checked_at=time.time(), models=models
        )

    async def check(self, session: aiohttp.ClientSession | None) -> Engine:
        statuses: list[EngineStatus] = []
        targets = [*self.engines, *(t for t in self.workloads if t not in self.engines)]
        if session is not None:
            statuses = list(
                await asyncio.gather(*(self.probe(session, kind, url) for kind, url in targets))
            )
        counted = [status.in_flight for status in statuses if status.in_flight is not None]
        # Every engine's load counts toward drains; the list is bounded on the wire.
        return Engine(
            ts=time.time(),
            engines=statuses[:MAX_ENGINES],
            in_flight=sum(counted) if counted else None,
        )

    async def run(self, ready: Callable[[], None]) -> None:
        routes = {
            self.subjects.events(self.config.node_id): self.events.decoding(
                self.name, self._on_event
            )
        }
        # Always a session: a workload may be deployed on a node configured with no engine.
        session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.config.engine_timeout)
        )
        try:
            async with listening(self.bus, routes, ready):
                while True:
                    engine = await self.check(session)
                    await self.events.publish(self.bus, self.subject, engine)
                    await sleep_jittered(self.config.engine_interval)
        finally:
            await session.close()
