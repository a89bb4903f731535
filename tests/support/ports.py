"""Loopback ports for the servers a test must name a port for in advance (a cluster's
routes, Slurm's daemons, Prometheus): where a server can pick its own (nats-server's
``-1``, ``http_port=0``), tests let it.

A port from ``bind(0)`` is in the kernel's ephemeral range, the one every outgoing
connection takes its local port from: between releasing it and the server binding it,
another test process's client (the suite runs in parallel, other suites beside it) may
take it. So ports come from below that range, each test process (pytest-xdist worker)
from its own slice, starting at a random place in it, and are checked free by binding.
"""

from __future__ import annotations

import os
import random
import socket
from pathlib import Path

LOWEST = 20_000
"""Where the tests' ports start (well above the well-known and registered services
that a developer machine commonly runs)."""


def ephemeral_start() -> int:
    """The first port the kernel hands out for outgoing connections (Linux: 32768)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


def worker_slice() -> range:
    """This test process's own ports: its xdist worker's share of LOWEST up to the
    ephemeral range (all of it when not under xdist)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    size = (ephemeral_start() - LOWEST) // max(workers, 1)
    start = LOWEST + size * (worker % max(workers, 1))
    return range(start, start + size)


_given: set[int] = set()
"""Ports this process handed out: a test that asks for two before starting either
server gets two."""


def free_port() -> int:
    """A loopback port nothing listens on now and not handed out before, from this
    process's slice (module docstring); tried from a random place on, so two suites side
    by side rarely try the same one first."""
    ports = worker_slice()
    first = random.randrange(len(ports))
    for step in range(len(ports)):
        port = ports[(first + step) % len(ports)]
        if port in _given:
            continue
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        _given.add(port)
        return port
    raise RuntimeError(f"no free loopback port in {ports.start}-{ports.stop - 1}")
