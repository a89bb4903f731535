"""Who besides its owner may use a file that gives a program its identity or its orders:
one check for key files and for the files that steer a program (settings, contexts,
policies, trusted keys). Such a file is still used (a chmod must not cut a fleet off),
but loudly warned about when it is read.

A key is exposed when group or others may read or write it (anyone who reads a seed is
that key); a steering file when group or others may write it (anyone who writes it
chooses the server, the key, the trusted operators or the hooks run). This is the rule
sshd's ``StrictModes`` applies to ``authorized_keys``.
"""

from __future__ import annotations

import logging
import stat
from pathlib import Path
from typing import Literal

log = logging.getLogger(__name__)

FileKind = Literal["key", "steering"]

EXPOSED: dict[FileKind, int] = {"key": 0o077, "steering": 0o022}
"""The permission bits that make each kind of file unsafe."""

WARNINGS: dict[FileKind, str] = {
    "key": "KEY FILE {path} IS ACCESSIBLE BY GROUP OR OTHERS (mode {mode}): anyone who "
    "reads it can act as this key; chmod 600 it",
    "steering": "SETTINGS FILE {path} IS WRITABLE BY GROUP OR OTHERS (mode {mode}): anyone "
    "who writes it chooses what this program connects to, trusts and runs; chmod go-w it",
}
"""The warning of each kind. It names the file in its text as well as in its fields:
fleetctl's commands log without a handler of their own, and Python's last-resort
handler prints the text alone."""


_warned: set[tuple[str, int]] = set()
"""(path, mode) already warned about by this process: a trust file is read at every
registration, and one warning a mode says it (a chmod that still exposes it warns again)."""


def warn_if_exposed(path: Path, kind: FileKind) -> bool:
    """Log a warning naming ``path`` and its mode when its permissions expose it (see the
    module's docstring), once per process and mode; whether they expose it. A file that
    cannot be stat'ed is left to the caller's read, which reports it."""
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except OSError:
        return False
    if not mode & EXPOSED[kind]:
        return False
    if (str(path), mode) in _warned:
        return True
    _warned.add((str(path), mode))
    shown = f"{mode:04o}"
    log.warning(
        WARNINGS[kind].format(path=path, mode=shown), extra={"path": str(path), "mode": shown}
    )
    return True
