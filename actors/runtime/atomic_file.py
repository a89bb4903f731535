"""Replacing a small state file so that a crash leaves the old content or the new, never
a torn mix: write a scratch file beside it, fsync it, rename it over the original."""

from __future__ import annotations

import os
from pathlib import Path


def write_atomically(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` (its directory must exist); raises OSError."""
    scratch = path.with_suffix(".tmp")
    with scratch.open("wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(scratch, path)
