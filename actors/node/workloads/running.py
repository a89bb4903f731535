"""One workload as the workload actor supervises it: its saved entry, its state, and the
deploy whose final result is still owed."""

from __future__ import annotations

import asyncio
import time
from collections import deque

from actors.node.workloads.store import Entry
from schemas.events import Workload, WorkloadState
from schemas.workloads import Deploy

FINAL_STATES = ("failed", "crashloop", "stopped")
SWITCHABLE = ("ready", "failed", "crashloop")
"""States of a workload another model's deploy may take the GPUs of (not one loading or
stopping)."""


class Running:
    """One workload as the actor supervises it."""

    def __init__(self, entry: Entry) -> None:
        self.entry = entry
        self.state: WorkloadState = "starting"
        self.since = time.time()
        self.reason = ""
        self.crashes: deque[float] = deque()
        self.command_id = ""
        """The deploy whose final result is still to come ("" after a restart)."""
        self.digest = ""
        self.task: asyncio.Task[None] | None = None
        self.container = ""
        """The podman container's id, once podman has written it."""

    @property
    def deploy(self) -> Deploy:
        return self.entry.deploy

    def describe(self) -> Workload:
        return Workload(
            name=self.deploy.name,
            engine=self.deploy.engine,
            state=self.state,
            since=self.since,
            port=self.entry.port,
            gpus=list(self.deploy.gpus),
            model=self.deploy.model,
            restarts=self.entry.restarts,
            reason=self.reason[:1024],
            max_pending=self.deploy.max_pending,
            container=self.container,
            placed=self.deploy.placed,
        )
