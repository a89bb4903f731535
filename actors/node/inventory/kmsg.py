"""XIDs from the kernel log, for GPUs whose NVML event registration failed.

The NVIDIA driver logs every XID as ``NVRM: Xid (PCI:0000:3b:00): 79, pid=..., ...``.
The log (``/dev/kmsg`` by default; any file or FIFO in tests) is opened non-blocking and
drained on each poll, so a poll never waits. /dev/kmsg replays the ring buffer since boot,
so XIDs logged before an agent restart are counted again: they still describe this boot.
"""

from __future__ import annotations

import errno
import logging
import os
import re

log = logging.getLogger(__name__)

XID_LINE = re.compile(
    r"NVRM: Xid \(PCI:(?P<pci>[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2})(?:\.[0-7])?\)"
    r": (?P<code>\d+)\b"
)
READ_SIZE = 8192
# Bounds one poll (kmsg returns one record per read); the rest waits for the next poll.
MAX_READS = 4096
MAX_PARTIAL = 64 * 1024


def pci_key(bus_id: str) -> str:
    """``00000000:3B:00.0`` or ``0000:3b:00`` -> ``0000:3b:00`` (domain:bus:device)."""
    parts = bus_id.split(".")[0].split(":")
    if len(parts) != 3:
        return bus_id.lower()
    domain, bus, device = parts
    return f"{int(domain, 16):04x}:{int(bus, 16):02x}:{int(device, 16):02x}"


def parse_xid_line(line: str) -> tuple[str, int] | None:
    """(PCI key, XID code) of a driver XID line, or None for any other line."""
    match = XID_LINE.search(line)
    if match is None:
        return None
    return pci_key(match["pci"]), int(match["code"])


class KmsgXids:
    """Non-blocking reader of XID lines from a kernel log path."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._partial = b""
        self._fd: int | None = None
        try:
            self._fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError as exc:
            log.warning(
                "cannot read the kernel log; XIDs of GPUs without NVML events go unseen",
                extra={"path": path, "reason": exc.strerror},
            )

    def poll(self) -> list[tuple[str, int]]:
        """Every XID line written since the last poll, as (PCI key, code)."""
        if self._fd is None:
            return []
        chunks: list[bytes] = []
        for _ in range(MAX_READS):
            try:
                chunk = os.read(self._fd, READ_SIZE)
            except BlockingIOError:
                break
            except OSError as exc:
                # EPIPE: kmsg overwrote records we had not read yet; go on with the rest.
                if exc.errno == errno.EPIPE:
                    continue
                log.warning("kernel log read failed", extra={"reason": exc.strerror})
                break
            if not chunk:
                break
            chunks.append(chunk)
        data = self._partial + b"".join(chunks)
        lines = data.split(b"\n")
        self._partial = lines.pop()[-MAX_PARTIAL:]
        found = []
        for line in lines:
            parsed = parse_xid_line(line.decode("utf-8", "replace"))
            if parsed is not None:
                found.append(parsed)
        return found

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
