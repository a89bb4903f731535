"""Replacing a small state file so that a crash leaves the old content or the new, never
a torn mix: write a scratch file beside it, fsync it, rename it over the original."""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path


def write_atomically(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` (its directory must exist), keeping the permission
    bits ``path`` had (a file an operator narrowed stays narrow); raises OSError."""
    scratch = path.with_suffix(".tmp")
    with scratch.open("wb") as handle:
        with contextlib.suppress(FileNotFoundError):
            os.fchmod(handle.fileno(), stat.S_IMODE(path.stat().st_mode))
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(scratch, path)
