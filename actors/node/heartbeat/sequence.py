"""Heartbeat sequence numbers that only ever grow, across restarts and crashes.

The state dir holds the highest number reserved so far. A start reserves the next block
and writes it down (atomically, fsync'd) before using any number of it, so a crash skips
at most one block and a restart never reuses a number the aggregators have seen.
"""

from __future__ import annotations

import logging
from pathlib import Path

from actors.runtime.atomic_file import write_atomically
from schemas.errors import FleetError

log = logging.getLogger(__name__)

BLOCK = 1000


class SequenceError(FleetError):
    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"sequence file {path}: {reason}")


class SequenceStore:
    def __init__(self, state_dir: Path, block: int = BLOCK) -> None:
        self.path = state_dir / "heartbeat.seq"
        self.block = block
        self._reserved = self._read()
        self._next = self._reserved + 1
        self._reserve(self._next)

    def _read(self) -> int:
        try:
            text = self.path.read_text().strip()
        except FileNotFoundError:
            return 0
        except OSError as exc:
            raise SequenceError(self.path, exc.strerror or str(exc)) from None
        if not text.isdigit():
            raise SequenceError(self.path, f"holds {text[:40]!r}, not a number")
        return int(text)

    def _reserve(self, upto_from: int) -> None:
        """Persist ``upto_from + block - 1`` as reserved; raise SequenceError if we cannot."""
        target = upto_from + self.block - 1
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            write_atomically(self.path, f"{target}\n".encode())
        except OSError as exc:
            raise SequenceError(self.path, exc.strerror or str(exc)) from None
        self._reserved = target

    def next(self) -> int:
        """The next number. If a new block cannot be written (full disk), the number is
        still returned and the failure logged: liveness beats perfect replay safety."""
        seq = self._next
        if seq > self._reserved:
            try:
                self._reserve(seq)
            except SequenceError as exc:
                log.error("cannot reserve sequence block", extra={"reason": str(exc)})
        self._next = seq + 1
        return seq
