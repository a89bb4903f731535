"""Start-up benchmark: how long the operator's tools take to answer, process start to exit.

Starts a nats-server, an aggregator and three agents (8 fake GPUs each, default
intervals) here, then runs each command ``--runs`` times as its own process, beside
``python -c pass`` in the same run (what the interpreter alone costs on this machine
now), and prints the median wall time, the spread (min to max) and the median CPU of
each, against the targets (docs/performance.md). With ``--before DIR`` (a checkout of
the code before a change: ``git archive main | tar -x -C DIR``) each command also runs
from there, run for run in turn with this tree's, so a busy machine weighs on both
alike. Not a pytest test::

    python tests/bench/bench_startup.py [--runs 20] [--before DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # for tests.support

from actors.fleet.storage.records import read_record
from actors.fleet.storage.registry import NotFound
from actors.fleet.storage.streams import provision
from actors.node.agent import NodeAgent
from actors.node.config import HTTP_PORT_FILE, AgentConfig
from actors.runtime.bus import NatsBus
from actors.runtime.embedded import NatsServer
from schemas.subjects import Subjects
from tests.support.fleet import TEST_LIMITS, approved_agent, start_aggregator

BIN = Path(sys.executable).parent
NODES = 3


@dataclass(frozen=True)
class Case:
    """One command line timed, the most its median may take (None: a reference), and
    what its output must say (so a fast failure is not taken for a fast answer)."""

    label: str
    argv: list[str]
    target: float | None
    expect: Callable[[subprocess.CompletedProcess[str]], bool]


@dataclass
class Figures:
    walls: list[float]
    cpus: list[float]

    def line(self, case: Case) -> str:
        median = statistics.median(self.walls)
        verdict = "" if case.target is None else "PASS" if median <= case.target else "FAIL"
        target = "reference" if case.target is None else f"target <= {case.target:g} s"
        return (
            f"{case.label:<44} median {median:6.3f} s  spread {min(self.walls):.3f}-"
            f"{max(self.walls):.3f} s  CPU {statistics.median(self.cpus):.3f} s  "
            f"({target}) {verdict}"
        )


def run_once(
    argv: list[str], env: dict[str, str] | None = None
) -> tuple[float, float, subprocess.CompletedProcess[str]]:
    """Wall and CPU seconds (user + system of the child) of one run, and its result."""
    before = os.times()
    started = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False, env=env)
    wall = time.perf_counter() - started
    after = os.times()
    cpu = (after.children_user - before.children_user) + (
        after.children_system - before.children_system
    )
    return wall, cpu, done


def measure(case: Case, runs: int, envs: list[dict[str, str] | None]) -> list[Figures]:
    """``runs`` runs of ``case`` in each environment (this tree's: None), in turn."""
    found = [Figures([], []) for _ in envs]
    for _ in range(runs):
        for figures, env in zip(found, envs, strict=True):
            wall, cpu, done = run_once(case.argv, env)
            if not case.expect(done):
                raise SystemExit(
                    f"{case.label}: unexpected answer (exit {done.returncode}): "
                    f"{(done.stdout + done.stderr).strip()[:300]}"
                )
            figures.walls.append(wall)
            figures.cpus.append(cpu)
    return found


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


def cases(url: str, prefix: str, status_url: str, http_port: int) -> list[Case]:
    fleetctl, node_agent = str(BIN / "fleetctl"), str(BIN / "node-agent")
    server = ["--server", url, "--prefix", prefix]
    refused = f"127.0.0.1:{closed_port()}"
    return [
        Case("python -c pass", [sys.executable, "-c", "pass"], None, lambda d: d.returncode == 0),
        Case("fleetctl --version", [fleetctl, "--version"], 0.25, lambda d: d.returncode == 0),
        Case("node-agent --version", [node_agent, "--version"], 0.25, lambda d: d.returncode == 0),
        Case(
            "node-agent status --url ...",
            [node_agent, "status", "--url", status_url],
            0.25,
            lambda d: d.returncode == 0 and "health" in d.stdout,
        ),
        Case(
            f"fleetctl nodes ({NODES}-node fleet)",
            [fleetctl, "nodes", *server],
            0.5,
            lambda d: d.returncode == 0 and f"{NODES} nodes" in d.stdout,
        ),
        Case(
            "fleetctl nodes, refused port",
            [fleetctl, "nodes", "--server", f"nats://{refused}"],
            1.0,
            lambda d: d.returncode == 1 and refused in d.stderr,
        ),
        Case(
            "fleetctl nodes, an HTTP port",
            [fleetctl, "nodes", "--server", f"nats://127.0.0.1:{http_port}"],
            1.0,
            lambda d: d.returncode == 1 and "HTTP" in d.stderr,
        ),
    ]


async def all_active(bus: NatsBus, subjects: Subjects, nodes: list[str]) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            records = [await read_record(bus, subjects, node) for node in nodes]
        except NotFound:
            records = []
        if records and all(record.state == "active" for record in records):
            return
        await asyncio.sleep(0.2)
    raise SystemExit(f"the {NODES} nodes were not active within 60 s")


async def bench(runs: int, work: Path, before: Path | None) -> bool:
    server = NatsServer(work / "nats")
    server.start()
    subjects = Subjects("bench")
    try:
        async with AsyncExitStack() as stack:
            bus = await NatsBus.connect(server.url, "bench")
            stack.push_async_callback(bus.close)
            await provision(bus.js, subjects, limits=TEST_LIMITS)
            stack.push_async_callback((await start_aggregator(bus, subjects.prefix)).stop)
            nodes = [f"bench-{n}" for n in range(1, NODES + 1)]
            for node in nodes:
                config = AgentConfig(
                    server=server.url,
                    prefix=subjects.prefix,
                    node_id=node,
                    cluster="bench",
                    state_dir=str(work / node),
                    fake_gpus=8,
                    http_port=0,
                    gateway_port=0,
                    version_programs=[],
                    scheduler="none",
                )
                agent: NodeAgent = await approved_agent(bus, config)
                stack.push_async_callback(agent.stop)
            await all_active(bus, subjects, nodes)
            port = int((work / nodes[0] / HTTP_PORT_FILE).read_text())
            status_url = f"http://127.0.0.1:{port}"
            print(
                f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.node()}, "
                f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}; "
                f"{runs} runs of each, one after another"
            )
            envs: list[dict[str, str] | None] = [None]
            if before is not None:
                envs.append({**os.environ, "PYTHONPATH": str(before)})
            passed = True
            for case in cases(server.url, subjects.prefix, status_url, port):
                figures, *earlier = await asyncio.to_thread(measure, case, runs, envs)
                print(figures.line(case))
                for old in earlier:
                    print(f"  before: {old.line(case)}")
                if case.target is not None:
                    passed &= statistics.median(figures.walls) <= case.target
            return passed
    finally:
        server.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--runs", type=int, default=20, help="runs of each command (20)")
    parser.add_argument(
        "--before",
        type=Path,
        help="a checkout of the code before a change: each command also runs from it "
        "(PYTHONPATH), in turn with this tree's",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as work:
        before = args.before.resolve() if args.before else None
        return 0 if asyncio.run(bench(args.runs, Path(work), before)) else 1


if __name__ == "__main__":
    sys.exit(main())
