"""The aggregator's ``/metrics`` at fleet size: a script, not a test.

Starts an embedded nats-server, one ``fleetctl aggregator`` process and ``fleetctl
simulate --nodes N`` (one fake GPU a node; every node beats at least once), then
scrapes ``/metrics`` ``--scrapes`` times and prints the exposition's size, its series
(the per-node ones apart) and each scrape's wall time, with their median and spread,
beside the aggregator's RSS. Run: ``python tests/bench/bench_metrics.py --nodes 100000``.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from actors.runtime.embedded import NatsServer
from tests.support.ports import free_port

BUDGETS = (
    *("--heartbeats-max-bytes", str(1024 * 2**20)),
    *("--records-max-bytes", str(1024 * 2**20)),
    *("--trust-max-bytes", str(256 * 2**20)),
)
"""Stream budgets for 100,000 nodes of one fake GPU (as tests/bench/bench_aggregator.py)."""


def scrape(port: int) -> tuple[bytes, float]:
    start = time.perf_counter()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as page:
        body: bytes = page.read()
    return body, time.perf_counter() - start


def wait_owning(port: int, timeout: float = 120.0) -> None:
    """Until the aggregator answers and holds a partition (its streams exist then)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            body, _ = scrape(port)
        except OSError:
            body = b""
        if b"fleet_aggregator_owner{" in body:
            return
        time.sleep(0.5)
    raise SystemExit(f"error: the aggregator on :{port} holds no partition after {timeout:g}s")


@contextlib.contextmanager
def simulated_fleet(nodes: int, rate: float) -> Iterator[tuple[int, subprocess.Popen[bytes]]]:
    """An embedded nats-server, one ``fleetctl aggregator`` process holding every
    partition, and ``fleetctl simulate`` run to its end (one fake GPU a node, each node
    beating at least once): the aggregator's HTTP port and its process. SystemExit with
    one line if simulate fails."""
    with tempfile.TemporaryDirectory() as store:
        server = NatsServer(Path(store) / "nats")
        server.start()
        port = free_port()
        aggregator = subprocess.Popen(
            [
                *(sys.executable, "-m", "actors.cli.fleetctl", "aggregator"),
                *("--server", server.url, "--http-port", str(port), "--log-level", "error"),
                *BUDGETS,
            ],
            stdout=subprocess.DEVNULL,
        )
        try:
            wait_owning(port)
            duration = max(30.0, 1.5 * nodes / rate)
            sys.stdout.write(f"simulating {nodes} nodes for {duration:.0f}s ...\n")
            simulated = subprocess.run(
                [
                    *(sys.executable, "-m", "actors.cli.fleetctl", "simulate"),
                    *("--server", server.url, "--nodes", str(nodes)),
                    *("--rate", f"{rate:g}", "--duration", f"{duration:g}"),
                    *("--gpus", "1", "--processes", "2"),
                ],
                capture_output=True,
                text=True,
                timeout=duration + 900,
            )
            # Exit 1 with nothing on stderr: not every record current within simulate's own
            # wait, which the callers wait out.
            if simulated.returncode != 0 and simulated.stderr.strip():
                raise SystemExit(f"error: fleetctl simulate failed: {simulated.stderr.strip()}")
            sys.stdout.write(simulated.stdout)
            yield port, aggregator
        finally:
            aggregator.terminate()
            aggregator.wait(30)
            server.stop()


def held(body: bytes) -> int:
    return sum(1 for line in body.splitlines() if line.startswith(b"fleet_node_state{"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=10_000)
    parser.add_argument("--rate", type=float, default=3000.0, help="heartbeats/s in all")
    parser.add_argument("--scrapes", type=int, default=5)
    args = parser.parse_args()
    if args.nodes < 1 or args.scrapes < 1 or args.rate <= 0:
        parser.error("--nodes, --scrapes and --rate must be positive")
    with simulated_fleet(args.nodes, args.rate) as (port, aggregator):
        deadline = time.monotonic() + 300
        body, _ = scrape(port)
        while held(body) < args.nodes and time.monotonic() < deadline:
            time.sleep(2)
            body, _ = scrape(port)
        times = []
        for _ in range(args.scrapes):
            body, seconds = scrape(port)
            times.append(seconds)
        nodes = held(body)
        series = sum(1 for line in body.splitlines() if line and not line.startswith(b"#"))
        per_node = sum(1 for line in body.splitlines() if line.startswith(b"fleet_node_"))
        rss = psutil.Process(aggregator.pid).memory_info().rss / 2**20
        sys.stdout.write(
            f"nodes held: {nodes} of {args.nodes}\n"
            f"exposition: {len(body) / 2**20:.1f} MiB, {series} samples "
            f"({per_node} per-node, {len(body) / max(nodes, 1):.0f} bytes a node)\n"
            f"scrape wall time: median {statistics.median(times):.2f}s, "
            f"min {min(times):.2f}s, max {max(times):.2f}s ({args.scrapes} scrapes)\n"
            f"aggregator RSS: {rss:.0f} MiB\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
