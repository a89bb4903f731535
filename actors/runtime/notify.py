"""systemd's service notifications (sd_notify(3)) without libsystemd: one datagram per
message to the unix socket named by ``$NOTIFY_SOCKET``. Under ``Type=notify`` systemd
counts the service started at ``READY=1`` and, with ``WatchdogSec=``, kills and restarts it
when ``WATCHDOG=1`` stops coming: a hung or half-dead process is caught, not just a dead one.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

log = logging.getLogger(__name__)

READY = "READY=1"
WATCHDOG = "WATCHDOG=1"
STOPPING = "STOPPING=1"


def notify(message: str, env: Mapping[str, str] | None = None) -> bool:
    """Send ``message`` to ``$NOTIFY_SOCKET``; False when there is none (not under systemd,
    or not ``Type=notify``). A socket that refuses is logged, never raised: a notification
    is not worth stopping the agent for (the watchdog notices if they keep failing)."""
    address = (os.environ if env is None else env).get("NOTIFY_SOCKET", "")
    if not address:
        return False
    if address.startswith("@"):  # an abstract socket
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(message.encode())
    except OSError as exc:
        log.warning(
            "systemd notification failed", extra={"notification": message, "reason": str(exc)}
        )
        return False
    return True


def watchdog_interval(env: Mapping[str, str] | None = None) -> float | None:
    """How often to send ``WATCHDOG=1``: half of ``$WATCHDOG_USEC`` (as sd_watchdog_enabled(3)
    advises), or None when systemd set no watchdog for this process."""
    env = os.environ if env is None else env
    pid = env.get("WATCHDOG_PID", "")
    if pid and pid != str(os.getpid()):
        return None
    try:
        usec = int(env.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    return usec / 2 / 1_000_000 if usec > 0 else None
