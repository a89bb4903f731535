"""The harness's network: one namespace per process, all on one bridge, and links cut and
healed with nft.

A namespace ``flt-hub`` holds the bridge and the harness itself (the operator, the wiretap
and the checker's readers, never cut off); each member (a server, an aggregator, an agent)
has a namespace ``flt-<name>`` with one veth to the bridge and an address on
:data:`SUBNET`. Nothing routes out of these namespaces: no traffic leaves what the harness
made. A cut is an nft table ``flt`` in the member's namespace dropping (not refusing)
every packet to and from the named peers, as a broken link does: connections hang, and
only timeouts tell. Everything is removed by :meth:`Network.destroy`; :func:`clean_leftovers`
removes what a crashed run left (namespaces ``flt-*``, their processes, tmpfs mounts).
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

PREFIX = "flt-"
HUB = "flt-hub"
BRIDGE = "br0"
SUBNET = "10.42.42"
HUB_ADDRESS = f"{SUBNET}.1"
RUN_MARK = "flt-run-"
"""Every run directory's name starts with this, so leftovers can be found."""
CLONE_NEWNET = 0x40000000


def sh(*argv: str, stdin: str | None = None, check: bool = True) -> str:
    """Run one command (``ip``, ``nft``), its output; a failure names the command."""
    done = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip() or done.returncode}")
    return done.stdout


@dataclass(frozen=True)
class Member:
    name: str
    address: str

    @property
    def netns(self) -> str:
        return f"{PREFIX}{self.name}"


def namespaces() -> list[str]:
    return [line.split()[0] for line in sh("ip", "netns", "list").splitlines() if line.strip()]


LOCK = Path("/run/lock" if Path("/run/lock").is_dir() else "/tmp") / "nats-node-agent-faults.lock"
"""The machine's fault-run lock: a run's clean-up (:func:`clean_leftovers`) would kill
another live run's namespaces and processes. At a fixed place, not under ``TMPDIR``: the
namespaces are the machine's, whatever temporary directory each run was given."""


def only_run(lock: Path = LOCK) -> TextIO | None:
    """Hold ``lock`` (:data:`LOCK` for a run) until the process ends (the file open); None
    while another run holds it."""
    handle = lock.open("w")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        return None
    return handle


def clean_leftovers() -> list[str]:
    """Remove what a crashed run left: the processes in ``flt-*`` namespaces (by their pid,
    as ``ip netns pids`` lists them), the namespaces, and tmpfs mounts of run directories.
    Returns what was removed, for the log."""
    removed: list[str] = []
    for name in namespaces():
        if not name.startswith(PREFIX):
            continue
        for pid in sh("ip", "netns", "pids", name, check=False).split():
            try:
                os.kill(int(pid), signal.SIGKILL)
                removed.append(f"pid {pid}")
            except ProcessLookupError:
                pass
        sh("ip", "netns", "del", name, check=False)
        removed.append(f"netns {name}")
    for line in Path("/proc/mounts").read_text().splitlines():
        mountpoint = line.split()[1]
        if RUN_MARK in mountpoint:
            sh("umount", "-l", mountpoint, check=False)
            removed.append(f"mount {mountpoint}")
    return removed


class Network:
    """The hub and a namespace per member; :meth:`cut` and :meth:`heal` change links."""

    def __init__(self, names: list[str]) -> None:
        self.members = {
            name: Member(name, f"{SUBNET}.{10 + index}") for index, name in enumerate(names, 1)
        }
        self.cuts: dict[str, list[str]] = {}

    def address(self, name: str) -> str:
        return self.members[name].address

    def create(self) -> None:
        sh("ip", "netns", "add", HUB)
        sh("ip", "-n", HUB, "link", "set", "lo", "up")
        sh("ip", "-n", HUB, "link", "add", BRIDGE, "type", "bridge")
        sh("ip", "-n", HUB, "addr", "add", f"{HUB_ADDRESS}/24", "dev", BRIDGE)
        sh("ip", "-n", HUB, "link", "set", BRIDGE, "up")
        for member in self.members.values():
            ns, port = member.netns, f"v-{member.name}"
            sh("ip", "netns", "add", ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            sh("ip", "-n", HUB, "link", "add", port, "type", "veth", "peer", "eth0", "netns", ns)
            sh("ip", "-n", HUB, "link", "set", port, "master", BRIDGE)
            sh("ip", "-n", HUB, "link", "set", port, "up")
            sh("ip", "-n", ns, "addr", "add", f"{member.address}/24", "dev", "eth0")
            sh("ip", "-n", ns, "link", "set", "eth0", "up")

    def destroy(self) -> None:
        for member in self.members.values():
            sh("ip", "netns", "del", member.netns, check=False)
        sh("ip", "netns", "del", HUB, check=False)

    @staticmethod
    def enter_hub() -> None:
        """Move this process into the hub namespace. Only the calling thread moves, so call
        it before any thread starts: every thread started later is born there."""
        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(f"/var/run/netns/{HUB}", os.O_RDONLY)
        try:
            if libc.setns(fd, CLONE_NEWNET) != 0:
                errno = ctypes.get_errno()
                raise OSError(errno, f"setns {HUB}: {os.strerror(errno)}")
        finally:
            os.close(fd)

    def cut(self, name: str, peers: list[str]) -> None:
        """Drop every packet between ``name`` and ``peers`` (both ways), until :meth:`heal`."""
        addresses = ", ".join(self.address(peer) for peer in peers)
        drop = "type filter hook {} priority 0; ip {} {{ " + addresses + " }} drop;"
        rules = (
            "table inet flt {\n"
            f"  chain input {{ {drop.format('input', 'saddr')} }}\n"
            f"  chain output {{ {drop.format('output', 'daddr')} }}\n"
            "}\n"
        )
        sh("ip", "netns", "exec", self.members[name].netns, "nft", "-f", "-", stdin=rules)
        self.cuts[name] = peers

    def heal(self, name: str) -> None:
        if self.cuts.pop(name, None) is not None:
            sh(
                "ip",
                "netns",
                "exec",
                self.members[name].netns,
                "nft",
                "delete",
                "table",
                "inet",
                "flt",
            )

    def heal_all(self) -> None:
        for name in list(self.cuts):
            self.heal(name)
