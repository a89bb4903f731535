"""What the command executor must remember across restarts, in one file of the state dir.

A cordon must survive a restart (and so must its TTL, as the absolute ``until``), a drain
interrupted by a restart resumes with its original deadline, and a command id seen once is
refused until its command has expired (the node refuses an expired command anyway; a
command's lifetime is capped, so the ids kept are those of at most one lifetime of accepted
commands, however many). The file records when it was created, so a node that lost it can
refuse commands issued before: their ids, and whether they ran, are gone with it. The file
is replaced atomically (write, fsync, rename).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import msgspec

from actors.runtime.atomic_file import write_atomically
from schemas.errors import FleetError
from schemas.events import NodeState

log = logging.getLogger(__name__)


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
    work_digest: str = ""
    """Digest of the command whose work is in progress, so results after a restart name it."""
    seen: list[str] = []
    """Ids written by agents before ``seen_until``; read once, kept for ``legacy_for``."""
    seen_until: dict[str, float] = {}
    """Executed command ids and when each may be forgotten (its command's expiry)."""
    created_at: float = 0.0
    """When this file's history began; 0 for a file written before it was recorded."""


class CommandStore:
    """The node's schedulability and the command ids already executed."""

    def __init__(self, state_dir: Path, legacy_for: float) -> None:
        """``legacy_for``: how long to keep ids read from an older file that has no expiry
        for them (a command lifetime: none of them can be valid for longer)."""
        self.path = state_dir / "commands.json"
        saved = self._read()
        self.state = saved.state
        self.drain_deadline = saved.drain_deadline
        self.deregister = saved.deregister
        self.work_digest = saved.work_digest
        self.created_at = saved.created_at
        self._seen = dict(saved.seen_until)
        legacy_until = time.time() + legacy_for
        for command_id in saved.seen:
            self._seen.setdefault(command_id, legacy_until)
        if not self.path.exists():
            # Recorded at once, so a restart before the first command keeps this time.
            self.save()

    def _read(self) -> Saved:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return self._fresh(NodeState(ts=time.time(), schedulability="schedulable"))
        except OSError as exc:
            raise StoreError(self.path, exc.strerror or str(exc)) from None
        try:
            return msgspec.json.decode(data, type=Saved)
        except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as exc:
            # Refusing to start would leave the node unmanageable; starting schedulable
            # could undo a cordon. Neither is safe, so say it loudly and stay cordoned.
            log.error("unreadable command state; starting cordoned", extra={"reason": str(exc)})
            state = NodeState(
                ts=time.time(), schedulability="cordoned", reason="unreadable state file"
            )
            return self._fresh(state)

    @staticmethod
    def _fresh(state: NodeState) -> Saved:
        """A history that begins now: whatever was remembered before is lost."""
        return Saved(state=state, created_at=time.time())

    def seen(self, command_id: str) -> bool:
        return command_id in self._seen

    def remember(self, command_id: str, until: float) -> None:
        """Record ``command_id`` as executed until ``until``, durably: it counts as seen
        only once the file holding it is written, so a save that fails (StoreError) leaves
        the command to run when it is delivered again. Expired ids are dropped."""
        now = time.time()
        kept = {old: end for old, end in self._seen.items() if end > now}
        kept[command_id] = until
        self._write(kept)
        self._seen = kept

    def save(self) -> None:
        self._write(self._seen)

    def _write(self, seen_until: dict[str, float]) -> None:
        saved = Saved(
            state=self.state,
            drain_deadline=self.drain_deadline,
            deregister=self.deregister,
            work_digest=self.work_digest,
            seen_until=seen_until,
            created_at=self.created_at,
        )
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            write_atomically(self.path, msgspec.json.encode(saved))
        except OSError as exc:
            raise StoreError(self.path, exc.strerror or str(exc)) from None
