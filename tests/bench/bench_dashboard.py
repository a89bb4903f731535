"""The dashboard at fleet size: a script, not a test.

1. The charts' memory: ``--nodes`` nodes' histories filled (every point of the hour),
   measured with tracemalloc in this process: bytes per node, all included; and the
   fleet's history (per fleet: a day of points), whatever the fleet's size.
2. The first page in headless Chromium: an embedded nats-server, one ``fleetctl
   aggregator`` process and ``fleetctl simulate --nodes N``; then ``--loads`` times, from
   navigation to the table's rows on screen (median and spread printed), the GPU page
   ordered by temperature once, and the aggregator's RSS before and after. With
   ``--fill`` no simulator runs (it registers about 12,000 nodes in ten minutes here): the
   nodes' keys and records are put straight into the bus, an aggregator loads them, and
   each node's next heartbeat is published and judged (``--unhealthy`` of them unhealthy;
   :mod:`tests.bench.fleet_fill`) before the pages are loaded: how 100,000 nodes are
   reached on this machine.
3. ``--server-side``: instead of 2, the first page's server side in this process, at
   ``--nodes`` records held in memory (what an aggregator holding them reads; no
   simulated fleet, so it runs at 100,000 nodes on a busy machine): the first snapshot's
   build (the only one a page waits for), a page asked while the snapshot is older than
   its refresh (it is built again in the background), the background build, and the
   first page's parts (counts, conditions, the table's first 50 rows) ``--loads`` times.

Run: ``python tests/bench/bench_dashboard.py --nodes 100000 --fill`` (Chromium: Debian's
``chromium`` and the ``playwright`` package).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from actors.fleet.config import AggregatorConfig
from actors.fleet.views.dashboard import parts
from actors.fleet.views.dashboard.actor import DashboardActor
from actors.fleet.views.dashboard.fleet_history import FleetHistory, Kept, points_for, share_of
from actors.fleet.views.dashboard.held_nodes import HeldNodes
from actors.fleet.views.dashboard.history import History
from actors.fleet.views.dashboard.render import Query
from actors.runtime.bus import NatsBus
from actors.runtime.embedded import NatsServer
from schemas.messages import NodeRecord
from tests.bench.bench_aggregator import Bench, servers
from tests.bench.bench_metrics import simulated_fleet
from tests.bench.fleet_fill import filled_fleet
from tests.support.dashboard import CountedView, chromium_at, chromium_or_exit
from tests.support.fleet import heartbeat, new_aggregator, wait_for

if TYPE_CHECKING:
    pass


def history_bytes(nodes: int, points: int) -> float:
    """Bytes per node of a full hour of history, measured."""
    beat = heartbeat("n0")
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    history = History(points)
    names = [f"node-{i}" for i in range(nodes)]
    for _ in range(points):
        history.begin(time.time())
        for name in names:
            history.put(name, beat)
    used = tracemalloc.get_traced_memory()[0] - before - sum(map(sys.getsizeof, names))
    tracemalloc.stop()
    return used / nodes


def fleet_history_bytes(interval: float) -> float:
    """Bytes of the fleet's history, every point of its day filled, measured."""
    kept = Kept()
    kept.add(share_of(heartbeat("n0")))
    totals = kept.totals(1)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    history = FleetHistory(points_for(interval))
    for point in range(history.points):
        history.add(interval * point, {"active": 99_000, "stale": 1000}, totals)
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert history.latest("active") == 99_000
    return used


async def first_pages(url: str, loads: int) -> list[float]:
    """``loads`` times, seconds from navigation to the table's rows on screen."""
    async with chromium_at(chromium_or_exit()) as browser:
        times = []
        for _ in range(loads):
            page = await browser.new_page()
            start = time.perf_counter()
            await page.goto(url)
            await page.wait_for_selector("#rows tr[data-node]")
            times.append(time.perf_counter() - start)
            await page.close()
        return times


async def gpu_page(url: str) -> str:
    """Seconds to the GPU page ordered by temperature, or why it did not come."""
    from playwright.async_api import Error

    async with chromium_at(chromium_or_exit()) as browser:
        page = await browser.new_page()
        start = time.perf_counter()
        try:
            await page.goto(url + "ui/gpus?sort=temp", timeout=600_000)
            await page.wait_for_selector("#gpus tr[data-key]", timeout=600_000)
        except Error as exc:
            return f"failed after {time.perf_counter() - start:.2f}s: {exc.message.splitlines()[0]}"
        return f"{time.perf_counter() - start:.2f}s"


async def server_side(nodes: int, loads: int) -> str:
    """The first page's server side at ``nodes`` records (see the module's docstring)."""
    beat = heartbeat("n0")
    records = {
        f"sim-{i:06d}": NodeRecord(
            node_id=f"sim-{i:06d}",
            cluster="sim",
            state="stale" if i % 300 == 0 else "active",
            last_seq=1,
            last_seen=1.0,
            health_status="healthy",
            health_score=100,
            heartbeat=beat,
        )
        for i in range(nodes)
    }
    with tempfile.TemporaryDirectory() as store:
        server = NatsServer(Path(store) / "nats")
        server.start()
        bus = await NatsBus.connect(server.url, "bench")
        try:
            held = HeldNodes(new_aggregator(bus, "bench").view)  # never started: holds none
            config = AggregatorConfig(prefix="bench", http_port=0)
            board = DashboardActor(config, bus, CountedView(records), held)
            start = time.perf_counter()
            first = board.fleet()
            cold = time.perf_counter() - start
            first.built -= first.refresh  # as if a refresh had passed
            start = time.perf_counter()
            board.fleet()
            asked = time.perf_counter() - start
            await wait_for(lambda: board.fleet() is not first, interval=0.01)
            rebuilt = time.perf_counter() - start
            times = []
            for _ in range(loads):
                start = time.perf_counter()
                await parts.overview_parts(board, Query())
                times.append(time.perf_counter() - start)
        finally:
            await bus.close()
            server.stop()
    return (
        f"first page's server side at {nodes} records: first snapshot {cold:.2f}s (a cold "
        f"start's first page waits for it); a page with a snapshot past its refresh "
        f"{asked * 1000:.1f} ms (built again in the background, {rebuilt:.2f}s); the "
        f"page's parts median {statistics.median(times) * 1000:.0f} ms, min "
        f"{min(times) * 1000:.0f}, max {max(times) * 1000:.0f} ({loads} pages)\n"
    )


def pages(args: argparse.Namespace, port: int, aggregator: int) -> None:
    """``--loads`` first pages and the GPU page of the aggregator at ``port`` (its pid
    ``aggregator``), with its RSS before and after; each figure printed as it comes."""
    url = f"http://127.0.0.1:{port}/"
    rss = psutil.Process(aggregator).memory_info().rss / 2**20
    times = asyncio.run(first_pages(url, args.loads))
    spread = ", ".join(f"{value:.2f}" for value in times)
    quartiles = statistics.quantiles(times, n=4) if len(times) > 1 else times * 3
    print(
        f"first page with {args.nodes} nodes: median {statistics.median(times):.2f}s, "
        f"min {min(times):.2f}s, max {max(times):.2f}s, quartiles {quartiles[0]:.2f}s "
        f"to {quartiles[2]:.2f}s ({args.loads} loads, in order: {spread}); "
        f"load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    gpus = asyncio.run(gpu_page(url))
    after = psutil.Process(aggregator).memory_info().rss / 2**20
    print(
        f"GPU page ordered by temperature: {gpus} (every node's heartbeat decoded)\n"
        f"aggregator RSS: {rss:.0f} MiB before the pages, {after:.0f} MiB after\n"
        f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=10_000)
    parser.add_argument("--rate", type=float, default=3000.0)
    parser.add_argument("--loads", type=int, default=5)
    parser.add_argument("--points", type=int, default=60)
    parser.add_argument("--server-side", action="store_true", help="see 3. above")
    parser.add_argument("--fill", action="store_true", help="see 2. above: no simulator")
    parser.add_argument(
        "--no-history", action="store_true", help="skip 1. (minutes at 100,000 nodes)"
    )
    parser.add_argument("--unhealthy", type=int, default=300, help="--fill: unhealthy nodes")
    parser.add_argument("--gpus", type=int, default=8, help="--fill: GPUs a node")
    parser.add_argument("--partitions", type=int, default=0, help="(as bench_aggregator)")
    args = parser.parse_args()
    if args.nodes < 1 or args.loads < 1 or args.rate <= 0 or args.points < 2:
        parser.error("--nodes, --loads and --rate must be positive, --points at least 2")
    if not args.no_history:
        per_node = history_bytes(args.nodes, args.points)
        sys.stdout.write(
            f"history: {per_node:.0f} bytes a node for {args.points} points "
            f"({per_node * args.nodes / 2**20:.1f} MiB for {args.nodes} nodes)\n"
            f"fleet history: {fleet_history_bytes(60.0) / 1024:.0f} KiB for a day at a point a "
            "minute, whatever the fleet's size\n"
        )
    if args.server_side:
        sys.stdout.write(asyncio.run(server_side(args.nodes, args.loads)))
        sys.stdout.write(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}\n")
        return 0
    if args.fill:
        bench = Bench(args)
        with servers(bench) as cluster:
            filled = filled_fleet(bench, cluster, args.nodes, args.gpus, args.unhealthy)
            pages(args, filled.port, filled.process.pid)
    else:
        with simulated_fleet(args.nodes, args.rate) as (port, aggregator):
            pages(args, port, aggregator.pid)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
