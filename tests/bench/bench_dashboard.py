"""The dashboard at fleet size: a script, not a test.

1. The charts' memory: ``--nodes`` nodes' histories filled (every point of the hour),
   measured with tracemalloc in this process: bytes per node, all included.
2. The first page in headless Chromium: an embedded nats-server, one ``fleetctl
   aggregator`` process and ``fleetctl simulate --nodes N``; then ``--loads`` times, from
   navigation to the table's rows on screen, and the aggregator's RSS before and after.

Run: ``python tests/bench/bench_dashboard.py --nodes 100000`` (Chromium: Debian's
``chromium`` and the ``playwright`` package).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from actors.fleet.views.dashboard.history import History
from tests.bench.bench_metrics import simulated_fleet
from tests.support.fleet import heartbeat


def history_bytes(nodes: int, points: int) -> float:
    """Bytes per node of a full hour of history, measured."""
    beat = heartbeat("n0")
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    history = History(points)
    names = [f"node-{i}" for i in range(nodes)]
    for _ in range(points):
        slot = history.begin(time.time())
        for name in names:
            history.put(slot, name, beat)
    used = tracemalloc.get_traced_memory()[0] - before - sum(map(sys.getsizeof, names))
    tracemalloc.stop()
    return used / nodes


async def first_pages(url: str, loads: int) -> list[float]:
    from playwright.async_api import async_playwright

    chromium = shutil.which("chromium")
    if chromium is None:
        raise SystemExit("error: chromium is not installed (Debian package chromium)")
    times = []
    async with async_playwright() as driver:
        browser = await driver.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        for _ in range(loads):
            page = await browser.new_page()
            start = time.perf_counter()
            await page.goto(url)
            await page.wait_for_selector("#rows tr[data-node]")
            times.append(time.perf_counter() - start)
            await page.close()
        await browser.close()
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=10_000)
    parser.add_argument("--rate", type=float, default=3000.0)
    parser.add_argument("--loads", type=int, default=5)
    parser.add_argument("--points", type=int, default=60)
    args = parser.parse_args()
    if args.nodes < 1 or args.loads < 1 or args.rate <= 0 or args.points < 2:
        parser.error("--nodes, --loads and --rate must be positive, --points at least 2")
    per_node = history_bytes(args.nodes, args.points)
    sys.stdout.write(
        f"history: {per_node:.0f} bytes a node for {args.points} points "
        f"({per_node * args.nodes / 2**20:.1f} MiB for {args.nodes} nodes)\n"
    )
    with simulated_fleet(args.nodes, args.rate) as (port, aggregator):
        rss = psutil.Process(aggregator.pid).memory_info().rss / 2**20
        times = asyncio.run(first_pages(f"http://127.0.0.1:{port}/", args.loads))
        after = psutil.Process(aggregator.pid).memory_info().rss / 2**20
        sys.stdout.write(
            f"first page with {args.nodes} nodes: median {statistics.median(times):.2f}s, "
            f"min {min(times):.2f}s, max {max(times):.2f}s ({args.loads} loads)\n"
            f"aggregator RSS: {rss:.0f} MiB before the pages, {after:.0f} MiB after\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
