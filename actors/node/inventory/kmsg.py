"""XIDs from the kernel log, beside NVML's events (and the only source for GPUs whose NVML
event registration failed).

The NVIDIA driver logs every XID as ``NVRM: Xid (PCI:0000:3b:00): 79, pid=..., ...``.
The log (``/dev/kmsg`` by default; any file or FIFO in tests) is opened non-blocking and
drained on each poll, so a poll never waits. /dev/kmsg replays the ring buffer since boot
on every open; each record there carries a sequence number (``PRIO,SEQ,TIME,FLAGS;text``),
so the reader keeps a cursor file (the kernel's boot id and the last XID record's
sequence number) and after an agent restart skips the records it counted before. A new
boot (another boot id) starts from the beginning: those XIDs are new.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
from pathlib import Path

from actors.runtime.atomic_file import write_atomically

log = logging.getLogger(__name__)

XID_LINE = re.compile(
    r"NVRM: Xid \(PCI:(?P<pci>[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2})(?:\.[0-7])?\)"
    r": (?P<code>\d+)\b"
)
KMSG_SEQUENCE = re.compile(r"^\d+,(?P<seq>\d+),")
"""The sequence number at the head of a /dev/kmsg record."""
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
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


def boot_id(path: Path = BOOT_ID) -> str:
    """The kernel's boot id (new at every boot); "" when it cannot be read."""
    try:
        return path.read_text().strip()
    except OSError:
        return ""


class KmsgXids:
    """Non-blocking reader of XID lines from a kernel log path; with ``cursor_path``, XID
    records already counted in this boot (by an earlier agent) are skipped."""

    def __init__(self, path: str, cursor_path: Path | None = None, boot: str = "") -> None:
        self.path = path
        self.cursor_path = cursor_path
        self.boot = boot or boot_id()
        self.skip_through = self._read_cursor()
        """Records up to this sequence number were counted by an earlier agent: skipped."""
        self.counted_through = self.skip_through
        self._partial = b""
        self._fd: int | None = None
        try:
            self._fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError as exc:
            log.warning(
                "cannot read the kernel log; XIDs of GPUs without NVML events go unseen",
                extra={"path": path, "reason": exc.strerror},
            )

    def _read_cursor(self) -> int:
        if self.cursor_path is None or not self.boot:
            return -1
        try:
            cursor = json.loads(self.cursor_path.read_bytes())
            if cursor["boot_id"] == self.boot:
                return int(cursor["seq"])
        except FileNotFoundError:
            pass
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("kernel log cursor unreadable; starting over", extra={"reason": str(exc)})
        return -1

    def _save_cursor(self) -> None:
        if self.cursor_path is None or not self.boot:
            return
        data = json.dumps({"boot_id": self.boot, "seq": self.counted_through}).encode()
        try:
            write_atomically(self.cursor_path, data)
        except OSError as exc:
            log.warning("kernel log cursor not saved", extra={"reason": str(exc)})

    def poll(self) -> list[tuple[str, int]]:
        """Every XID line written since the last poll (and not counted before a restart),
        as (PCI key, code)."""
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
        counted = self.counted_through
        for line in lines:
            text = line.decode("utf-8", "replace")
            parsed = parse_xid_line(text)
            if parsed is None:
                continue
            sequence = KMSG_SEQUENCE.match(text)
            if sequence is not None:
                seq = int(sequence["seq"])
                if seq <= self.skip_through:
                    continue
                counted = max(counted, seq)
            found.append(parsed)
        if counted != self.counted_through:
            self.counted_through = counted
            self._save_cursor()
        return found

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
