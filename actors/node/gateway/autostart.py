"""On-demand servers: the gateway, asked for a model no workload serves but that the node's
model directory holds, has one started (``gateway_autostart``, off by default).

The model is a file directly in ``model_dir`` named by the request (``x.gguf``, or ``x``
for ``x.gguf``; no path, nothing hidden, nothing outside the directory, symlinks
resolved), passed to the engine by its absolute path. The server is a workload like any
deploy, named ``auto-<file stem>`` (a stem that is not a workload name as it stands gets a
hash of the file name, so two files never share a name), of ``gateway_autostart_engine``,
on the GPU with the most free memory among those that run only such servers and fewer
than ``gateway_servers_per_gpu`` of them (shared when that is more than one); a server
ordered and not yet in the workloads event counts on its GPU, so requests for many models
at once start no more than that bound a GPU. With one server a GPU and none free, a
ready server holding no request is switched out for it, as a deploy of another model
switches a GPU (:mod:`actors.node.workloads.admission`).
The gateway asks for it as the command executor does, with a node-signed
``workload_order`` event, so the workload actor checks, starts, watches and reports it as
any other; the request waits (at most ``gateway_autostart_timeout``) until it is ready.
"""

from __future__ import annotations

import hashlib
import logging
import re
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import nats.errors

from actors.node.config import AgentConfig
from actors.node.events import NodeEvents
from actors.node.gateway.access import Refusal
from actors.runtime.bus import Bus
from schemas.events import Workload
from schemas.subjects import EVENT_WORKLOAD_ORDER, Subjects
from schemas.workloads import Deploy, WorkloadOrder

log = logging.getLogger(__name__)

PREFIX: Final = "auto-"
"""Names of the workloads the gateway starts (and the only ones it shares a GPU with)."""
MODEL_SUFFIX: Final = ".gguf"
APPEAR_WITHIN: Final = 10.0
"""Seconds an ordered server has to show up in the workloads event; a deploy the workload
actor refused never does."""
LIVE: Final = ("starting", "ready", "stopping")


PLAIN_STEM: Final = re.compile(r"[A-Za-z0-9_-]{1,58}")
"""A ``.gguf`` file's stem that is a workload name after ``auto-`` as it stands."""
HASHED_STEM: Final = 49
"""Characters of any other stem kept, before ``-`` and 8 hex digits of its file name's hash."""


def workload_name(path: Path) -> str:
    """``auto-`` and the file's stem for ``<stem>.gguf`` with a plain stem; for any other
    file name (other characters, too long, no ``.gguf``) the stem made plain and cut,
    and a hash of the whole name, so two files never map to one server's name."""
    if path.suffix == MODEL_SUFFIX and PLAIN_STEM.fullmatch(path.stem):
        return PREFIX + path.stem
    plain = re.sub(r"[^A-Za-z0-9_-]", "-", path.stem)[:HASHED_STEM] or "model"
    return f"{PREFIX}{plain}-{hashlib.sha256(path.name.encode()).hexdigest()[:8]}"


@dataclass(frozen=True)
class Order:
    """A server the gateway asked for: its GPU, and when (monotonic)."""

    gpu: int
    at: float


class Autostart:
    """What the gateway starts on demand, and when it last asked for each model."""

    def __init__(self, config: AgentConfig, bus: Bus, events: NodeEvents) -> None:
        self.config = config
        self.bus = bus
        self.events = events
        self.subject = Subjects(config.prefix).event(config.node_id, EVENT_WORKLOAD_ORDER)
        self.ordered: dict[str, Order] = {}
        """Workload name -> its order, while it may still show up (so one is asked for
        once, and counted on its GPU until the workloads event has it)."""

    def model_file(self, model: str) -> Path | None:
        """The file in model_dir ``model`` names, by its path in the resolved directory
        (absolute: never read as an engine's option); None when there is none."""
        if not self.config.model_dir or not model or "/" in model or model.startswith("."):
            return None
        try:
            base = Path(self.config.model_dir).resolve(strict=True)
        except (OSError, RuntimeError):
            return None
        for name in (model, model + MODEL_SUFFIX):
            path = base / name
            try:
                resolved = path.resolve(strict=True)
            except (OSError, RuntimeError, ValueError):  # ValueError: a NUL in the name
                continue
            if resolved.parent == base and resolved.is_file():
                return path
        return None

    def _reserved(self, workloads: list[tuple[Workload, int]]) -> dict[str, int]:
        """Servers ordered and not yet among ``workloads`` -> their GPU (orders that
        never showed within APPEAR_WITHIN are forgotten: the workload actor refused them)."""
        now = time.monotonic()
        self.ordered = {
            name: order for name, order in self.ordered.items() if now - order.at <= APPEAR_WITHIN
        }
        seen = {workload.name for workload, _ in workloads}
        return {name: order.gpu for name, order in self.ordered.items() if name not in seen}

    def gpu(self, workloads: Iterable[tuple[Workload, int]], free_memory: dict[int, int]) -> int:
        """The GPU a new server goes on, given each workload and the requests the gateway
        holds of it. With one server a GPU and every GPU full, the GPU of a server that is
        ready and holds no request (the one with the most free memory): the deploy there
        switches that server out. Refusal 503 when there is none."""
        workloads = list(workloads)
        servers: dict[int, list[tuple[Workload, int] | None]] = {gpu: [] for gpu in free_memory}
        blocked: set[int] = set()
        for gpu in self._reserved(workloads).values():
            if gpu in servers:
                servers[gpu].append(None)  # on its way: counts, and is switched out by none
        for workload, load in workloads:
            if workload.state not in LIVE:
                continue
            for gpu in workload.gpus:
                if not workload.name.startswith(PREFIX):
                    blocked.add(gpu)  # an operator's workload keeps its GPU
                elif gpu in servers:
                    servers[gpu].append((workload, load))
        usable = {gpu: held for gpu, held in servers.items() if gpu not in blocked}
        per_gpu = self.config.gateway_servers_per_gpu
        room = [gpu for gpu, held in usable.items() if len(held) < per_gpu]
        if room:
            return max(room, key=lambda g: (free_memory[g], -g))
        idle = [
            (gpu, server[0].name)
            for gpu, held in usable.items()
            if per_gpu == 1 and None not in held
            for server in held
            if server is not None and server[0].state == "ready" and server[1] == 0
        ]
        if idle:
            gpu, name = max(idle, key=lambda entry: (free_memory[entry[0]], -entry[0]))
            log.info("gateway switches a server out", extra={"gpu": gpu, "workload": name})
            return gpu
        raise Refusal(
            503,
            f"no GPU has room for another server ({per_gpu} a GPU, every one busy; GPUs of "
            "deployed workloads excluded)",
            "unavailable_error",
            "no_capacity",
            30,
        )

    async def start(
        self, path: Path, workloads: list[tuple[Workload, int]], free_memory: dict[int, int]
    ) -> str:
        """Ask the workload actor for a server of ``path`` on the GPU :meth:`gpu` picks,
        once while it comes up; the workload's name. The GPU is reserved before the
        order goes out, so a request arriving meanwhile counts it."""
        name = workload_name(path)
        if not self.overdue(name):
            return name
        gpu = self.gpu(workloads, free_memory)
        self.ordered[name] = Order(gpu, time.monotonic())
        deploy = Deploy(
            name=name,
            engine=self.config.gateway_autostart_engine,
            model=str(path),
            gpus=[gpu],
            # One server a GPU: its own GPU, so a deploy onto a full one switches the
            # idle server there out (stop after its requests, then start).
            share=self.config.gateway_servers_per_gpu > 1,
            ready_timeout=self.config.gateway_autostart_timeout,
        )
        order = WorkloadOrder(
            ts=time.time(), command_id=f"gateway-{uuid.uuid4().hex}", action=deploy
        )
        try:
            await self.events.publish(self.bus, self.subject, order)
        except nats.errors.Error as exc:
            del self.ordered[name]
            raise Refusal(
                503, f"cannot start {path.name}: {exc}", "unavailable_error", "model_unavailable", 5
            ) from None
        log.info(
            "gateway starts a server", extra={"model": str(path), "gpu": gpu, "workload": name}
        )
        return name

    def overdue(self, name: str) -> bool:
        """Whether the order for ``name`` went out long enough ago that it should show."""
        order = self.ordered.get(name)
        return order is None or time.monotonic() - order.at > APPEAR_WITHIN
