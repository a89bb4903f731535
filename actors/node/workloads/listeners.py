"""Where a workload listens: the TCP sockets its process group holds in LISTEN state,
read from ``/proc``, and those not on loopback.

``/proc/<pid>/net/tcp`` and ``tcp6`` list every socket of the process's network
namespace, not only its own; a socket is the workload's when its inode is one of the
``socket:[inode]`` links among the fds of a process of the workload's group. Addresses
there are hex, each 32-bit word in the host's byte order (little-endian on the machines
we run on), the port big-endian.
"""

from __future__ import annotations

import ipaddress
import os
import re
import sys
from pathlib import Path

from actors.node.workloads import processes

LISTEN = "0A"
"""The ``st`` column of a listening socket (TCP_LISTEN)."""
SOCKET_LINK = re.compile(r"^socket:\[(\d+)\]$")
PROC = Path("/proc")


def _inodes(pids: list[int]) -> set[int]:
    """Socket inodes the processes ``pids`` hold (a process that is gone, or not ours to
    read, adds none)."""
    found = set()
    for pid in pids:
        try:
            fds = os.listdir(PROC / str(pid) / "fd")
        except OSError:
            continue
        for fd in fds:
            try:
                match = SOCKET_LINK.match(os.readlink(PROC / str(pid) / "fd" / fd))
            except OSError:
                continue
            if match:
                found.add(int(match.group(1)))
    return found


def _address(hex_address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    raw = bytes.fromhex(hex_address)
    words = [raw[i : i + 4] for i in range(0, len(raw), 4)]
    if sys.byteorder == "little":
        words = [word[::-1] for word in words]
    return ipaddress.ip_address(b"".join(words))


def _table(path: Path) -> list[tuple[str, int, int]]:
    """(address, port, inode) of each listening socket in one /proc net table."""
    try:
        lines = path.read_text().splitlines()[1:]
    except OSError:
        return []
    found = []
    for line in lines:
        fields = line.split()
        if len(fields) < 10 or fields[3] != LISTEN:
            continue
        address, _, port = fields[1].partition(":")
        found.append((str(_address(address)), int(port, 16), int(fields[9])))
    return found


def listening(pgid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket the process group ``pgid`` listens on."""
    pids = processes.group_pids(pgid)
    inodes = _inodes(pids)
    found: set[tuple[str, int]] = set()
    for pid in pids:
        for table in ("tcp", "tcp6"):
            for address, port, inode in _table(PROC / str(pid) / "net" / table):
                if inode in inodes:
                    found.add((address, port))
    return sorted(found)


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def strays(pgid: int) -> list[str]:
    """``address:port`` of each socket of the group listening beyond loopback (the node
    binds every workload to 127.0.0.1; anything else reaches outside the host)."""
    return [
        f"[{address}]:{port}" if ":" in address else f"{address}:{port}"
        for address, port in listening(pgid)
        if not is_loopback(address)
    ]
