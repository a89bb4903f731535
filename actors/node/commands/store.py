"""What the command executor must remember across restarts, in one file of the state dir.

A cordon must survive a restart (and so must its TTL, as the absolute ``until``), a drain
interrupted by a restart resumes with its original deadline, and a command id seen once is
refused forever after (bounded: the newest ``MAX_SEEN`` ids), so a redelivered or replayed
command never runs twice. The file is replaced atomically (write, fsync, rename).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from pathlib import Path

import msgspec

from actors.runtime.atomic_file import write_atomically
from schemas.errors import FleetError
from schemas.events import NodeState

log = logging.getLogger(__name__)

MAX_SEEN = 4096


class StoreError(FleetError):
    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"command state file {path}: {reason}")


class Saved(msgspec.Struct, kw_only=True):
    """The file's content: local bookkeeping, not a wire type."""

    state: NodeState
    drain_deadline: float | None = None
    """Absolute end of a drain in progress (None when not draining)."""
    deregister: bool = False
    """The drain in progress ends in deregistration."""
    seen: list[str] = []


class CommandStore:
    """The node's schedulability and the command ids already executed."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / "commands.json"
        saved = self._read()
        self.state = saved.state
        self.drain_deadline = saved.drain_deadline
        self.deregister = saved.deregister
        self._seen: OrderedDict[str, None] = OrderedDict.fromkeys(saved.seen[-MAX_SEEN:])

    def _read(self) -> Saved:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return Saved(state=NodeState(ts=time.time(), schedulability="schedulable"))
        except OSError as exc:
            raise StoreError(self.path, exc.strerror or str(exc)) from None
        try:
            return msgspec.json.decode(data, type=Saved)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            # Refusing to start would leave the node unmanageable; starting schedulable
            # could undo a cordon. Neither is safe, so say it loudly and stay cordoned.
            log.error("unreadable command state; starting cordoned", extra={"reason": str(exc)})
            return Saved(
                state=NodeState(
                    ts=time.time(), schedulability="cordoned", reason="unreadable state file"
                )
            )

    def seen(self, command_id: str) -> bool:
        return command_id in self._seen

    def remember(self, command_id: str) -> None:
        self._seen[command_id] = None
        while len(self._seen) > MAX_SEEN:
            self._seen.popitem(last=False)

    def save(self) -> None:
        saved = Saved(
            state=self.state,
            drain_deadline=self.drain_deadline,
            deregister=self.deregister,
            seen=list(self._seen),
        )
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            write_atomically(self.path, msgspec.json.encode(saved))
        except OSError as exc:
            raise StoreError(self.path, exc.strerror or str(exc)) from None
