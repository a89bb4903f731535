"""The node's record that it deregistered, in its state dir, so deregistration is terminal.

Under systemd (``Restart=always``) an agent that deregistered and stopped would be started
again and come back as ``drained``. So deregistering writes ``<state dir>/deregistered``;
``node-agent start`` refuses to run while it is there and exits with EXIT_DEREGISTERED,
which the unit names in ``RestartPreventExitStatus=`` (systemd then leaves it stopped).
``node-agent start --rejoin`` removes it, once an operator re-admitted the node
(``fleetctl approve NODE``); the aggregators refuse a deregistered node's heartbeats until
then (alert ``deregistered_node_beating``).
"""

from __future__ import annotations

import time
from pathlib import Path

import msgspec

from actors.runtime.atomic_file import write_atomically
from schemas.errors import FleetError

EXIT_DEREGISTERED = 78
"""``node-agent start``'s exit status for a deregistered node (78 is sysexits' EX_CONFIG:
a restart cannot help, the configuration (here: the operator) must change)."""
MARKER = "deregistered"


class Marker(msgspec.Struct, kw_only=True):
    """The file's content: local bookkeeping, not a wire type."""

    at: float
    reason: str = ""
    command_id: str = ""


def marker_path(state_dir: Path) -> Path:
    return state_dir / MARKER


def mark(state_dir: Path, reason: str, command_id: str) -> None:
    """Record that the node deregistered (written before the agent stops)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    marker = Marker(at=time.time(), reason=reason, command_id=command_id)
    write_atomically(marker_path(state_dir), msgspec.json.encode(marker))


def read(state_dir: Path) -> Marker | None:
    """The marker, None when the node is not deregistered. An unreadable marker still
    counts as one (the file is only ever written on deregistration)."""
    path = marker_path(state_dir)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise FleetError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        return msgspec.json.decode(data, type=Marker)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return Marker(at=0.0, reason="unreadable marker")


def clear(state_dir: Path) -> bool:
    """Remove the marker (``--rejoin``); True if there was one."""
    try:
        marker_path(state_dir).unlink()
    except FileNotFoundError:
        return False
    return True


def refusal(state_dir: Path, node_id: str) -> str | None:
    """The one-line message ``node-agent start`` exits with, None when not deregistered."""
    marker = read(state_dir)
    if marker is None:
        return None
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(marker.at)) if marker.at else "?"
    why = f" ({marker.reason})" if marker.reason else ""
    return (
        f"node {node_id} deregistered at {when}{why}; not starting. To rejoin: "
        f"'fleetctl approve {node_id}' on the operator side, then "
        "'node-agent start --rejoin' here once"
    )
