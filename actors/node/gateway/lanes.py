"""What the gateway routes to: a lane per workload (its slots, the requests it holds),
and which lanes serve a model a request names."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from schemas.events import Workload


@dataclass
class Lane:
    """One workload as the gateway uses it: its slots, and the requests holding or
    waiting for one."""

    workload: Workload
    slots: asyncio.Semaphore
    in_flight: int = 0
    waiting: int = 0

    @property
    def load(self) -> int:
        return self.in_flight + self.waiting


def served_as(workload: Workload) -> str:
    """The model id a workload is listed and addressed by: its model, else its name."""
    return workload.model or workload.name


def matching(lanes: Iterable[Lane], model: str) -> list[Lane]:
    """Lanes serving ``model``: by their model, its file name or stem, or their name."""
    found = []
    for lane in lanes:
        served = served_as(lane.workload)
        path = Path(served)
        if model in (served, lane.workload.name, path.name, path.stem):
            found.append(lane)
    return found
