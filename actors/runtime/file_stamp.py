"""When a file a process rereads while it runs (API keys, dashboard users) must be read
again: whenever its inode, size or modification time changed, and at every use while it
changed less than :data:`SETTLED_NS` before it was last read, since a rewrite within one
timestamp tick and of the same size (a key or password replaced by another) leaves all
three as they were."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Final

SETTLED_NS: Final = 2_000_000_000
"""A file read this long after its modification time is trusted to be unchanged while its
stamp is (2 s: the coarsest timestamps of a common file system)."""

Stamp = tuple[int, int, int]


class FileStamp:
    """The stamp of ``path`` as last read, and whether that read can be trusted."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._stamp: Stamp | None = None
        self._settled = False

    def due(self) -> Stamp | None:
        """The file's stamp now if it must be read again, else None (OSError if it cannot
        be looked at)."""
        info = os.stat(self.path)
        stamp = (info.st_ino, info.st_size, info.st_mtime_ns)
        return None if stamp == self._stamp and self._settled else stamp

    def is_new(self, stamp: Stamp) -> bool:
        """``stamp`` differs from the one last read (a change, not a settling reread)."""
        return stamp != self._stamp

    def read(self, stamp: Stamp) -> None:
        """The file was just read as it was at ``stamp``."""
        self._stamp = stamp
        self._settled = time.time_ns() - stamp[2] >= SETTLED_NS
