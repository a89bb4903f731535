"""The workloads a node should run, in one file of the state dir, so an agent restart
finds them again (and the processes, by pid and start time). Replaced atomically."""

from __future__ import annotations

import logging
from pathlib import Path

import msgspec

from actors.runtime.atomic_file import write_atomically
from schemas.workloads import Deploy

log = logging.getLogger(__name__)


class Entry(msgspec.Struct, kw_only=True):
    """One desired workload: local bookkeeping, not a wire type."""

    deploy: Deploy
    port: int
    pid: int = 0
    started: float = 0.0
    """The process's start time (psutil), which tells it from a later one with its pid."""
    restarts: int = 0


class Saved(msgspec.Struct, kw_only=True):
    workloads: list[Entry] = []


class WorkloadStore:
    """``<state_dir>/workloads.json``: the desired set."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / "workloads.json"
        self.logs = state_dir / "workloads"

    def load(self) -> list[Entry]:
        try:
            return msgspec.json.decode(self.path.read_bytes(), type=Saved).workloads
        except FileNotFoundError:
            return []
        except (OSError, msgspec.DecodeError) as exc:
            # Losing the list loses supervision, not the processes: say so loudly.
            log.error(
                "workload state unreadable", extra={"path": str(self.path), "reason": str(exc)}
            )
            return []

    def save(self, entries: list[Entry]) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_atomically(self.path, msgspec.json.encode(Saved(workloads=entries)))
        except OSError as exc:
            log.error(
                "workload state not saved", extra={"path": str(self.path), "reason": str(exc)}
            )

    def log_path(self, name: str) -> Path:
        return self.logs / f"{name}.log"

    def cid_path(self, name: str) -> Path:
        """Where podman writes the id of the workload's container."""
        return self.logs / f"{name}.cid"
