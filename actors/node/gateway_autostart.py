"""On-demand servers: the gateway, asked for a model no workload serves but that the node's
model directory holds, has one started (``gateway_autostart``, off by default).

The model is a file directly in ``model_dir`` named by the request (``x.gguf``, or ``x``
for ``x.gguf``; no path, nothing hidden, nothing outside the directory, symlinks
resolved). The server is a workload like any deploy, named ``auto-<file stem>``, of
``gateway_autostart_engine``, on the GPU with the most free memory among those that run
only such servers and fewer than ``gateway_servers_per_gpu`` of them (shared when that is
more than one). With one server a GPU and none free, a ready server holding no request is
switched out for it, as a deploy of another model switches a GPU
(:mod:`actors.node.workloads.admission`).
The gateway asks for it as the command executor does, with a node-signed
``workload_order`` event, so the workload actor checks, starts, watches and reports it as
any other; the request waits (at most ``gateway_autostart_timeout``) until it is ready.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Final

import nats.errors

from actors.node.config import AgentConfig
from actors.node.events import NodeEvents
from actors.node.gateway_access import Refusal
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


def workload_name(path: Path) -> str:
    """``auto-`` and the file's stem, cut to a workload name's 63 characters."""
    stem = re.sub(r"[^A-Za-z0-9_-]", "-", path.stem) or "model"
    return (PREFIX + stem)[:63]


class Autostart:
    """What the gateway starts on demand, and when it last asked for each model."""

    def __init__(self, config: AgentConfig, bus: Bus, events: NodeEvents) -> None:
        self.config = config
        self.bus = bus
        self.events = events
        self.subject = Subjects(config.prefix).event(config.node_id, EVENT_WORKLOAD_ORDER)
        self.ordered: dict[str, float] = {}
        """Workload name -> monotonic time its order went out (so one is asked for once)."""

    def model_file(self, model: str) -> Path | None:
        """The file in model_dir ``model`` names, None when there is none."""
        directory = Path(self.config.model_dir)
        if not self.config.model_dir or not model or "/" in model or model.startswith("."):
            return None
        for name in (model, model + MODEL_SUFFIX):
            path = directory / name
            try:
                resolved, base = path.resolve(strict=True), directory.resolve(strict=True)
            except (OSError, RuntimeError):
                continue
            if resolved.parent == base and resolved.is_file():
                return path
        return None

    def gpu(self, workloads: Iterable[tuple[Workload, int]], free_memory: dict[int, int]) -> int:
        """The GPU a new server goes on, given each workload and the requests the gateway
        holds of it. With one server a GPU and every GPU full, the GPU of a server that is
        ready and holds no request (the one with the most free memory): the deploy there
        switches that server out. Refusal 503 when there is none."""
        servers: dict[int, list[tuple[Workload, int]]] = {gpu: [] for gpu in free_memory}
        blocked: set[int] = set()
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
            (gpu, workload.name)
            for gpu, held in usable.items()
            for workload, load in held
            if per_gpu == 1 and workload.state == "ready" and load == 0
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

    async def order(self, path: Path, gpu: int) -> str:
        """Ask the workload actor for a server of ``path`` on ``gpu``, once while it
        comes up; the workload's name."""
        name = workload_name(path)
        asked = self.ordered.get(name)
        if asked is not None and time.monotonic() - asked < APPEAR_WITHIN:
            return name
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
            raise Refusal(
                503, f"cannot start {path.name}: {exc}", "unavailable_error", "model_unavailable", 5
            ) from None
        self.ordered[name] = time.monotonic()
        log.info(
            "gateway starts a server", extra={"model": str(path), "gpu": gpu, "workload": name}
        )
        return name

    def overdue(self, name: str) -> bool:
        """Whether the order for ``name`` went out long enough ago that it should show."""
        asked = self.ordered.get(name)
        return asked is None or time.monotonic() - asked > APPEAR_WITHIN
