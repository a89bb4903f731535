"""On-demand servers: the gateway, asked for a model no workload serves but that the node's
model directory holds, has one started (``gateway_autostart``, off by default).

The model is a file directly in ``model_dir`` named by the request (``x.gguf``, or ``x``
for ``x.gguf``; no path, nothing hidden, nothing outside the directory, symlinks
resolved). The server is a workload like any deploy, named ``auto-<file stem>``, of
``gateway_autostart_engine``, shared (``--share``) on the GPU with the most free memory
among those that run only such servers and fewer than ``gateway_servers_per_gpu`` of them.
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

    def gpu(self, workloads: Iterable[Workload], free_memory: dict[int, int]) -> int:
        """The GPU a new server goes on; Refusal 503 when none has room."""
        servers: dict[int, int] = dict.fromkeys(free_memory, 0)
        for workload in workloads:
            if workload.state not in LIVE:
                continue
            for gpu in workload.gpus:
                if not workload.name.startswith(PREFIX):
                    servers.pop(gpu, None)  # an operator's workload keeps its GPU
                elif gpu in servers:
                    servers[gpu] += 1
        room = [g for g, n in servers.items() if n < self.config.gateway_servers_per_gpu]
        if not room:
            raise Refusal(
                503,
                f"no GPU has room for another server ({self.config.gateway_servers_per_gpu} "
                "a GPU, GPUs of deployed workloads excluded)",
                "unavailable_error",
                "no_capacity",
                30,
            )
        return max(room, key=lambda g: (free_memory[g], -g))

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
            share=True,
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
        log.info("gateway starts a server", extra={"model": str(path), "gpu": gpu, "name": name})
        return name

    def overdue(self, name: str) -> bool:
        """Whether the order for ``name`` went out long enough ago that it should show."""
        asked = self.ordered.get(name)
        return asked is None or time.monotonic() - asked > APPEAR_WITHIN
