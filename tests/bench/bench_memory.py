"""Where an aggregator's bytes per node go: a script, not a test.

Two ``fleetctl aggregator`` processes as shipped (HTTP port on, every default actor, the
dashboard sampling its history every 3 s so that every node has its ring) run under
``tracemalloc``, one over an empty fleet and one over ``--nodes`` (20,000) records of
1-GPU nodes put straight into ``fleet_nodes`` (``bench_aggregator.fill_records``, no
heartbeats). Once each holds its lease and has settled, it dumps a snapshot; the
difference, line by line of the code that allocated, divided by the nodes, is what a node
costs, printed by line and summed by module (``bench_aggregator.py --memory`` gives the
RSS at 100,000 nodes).

Run: ``python tests/bench/bench_memory.py [--nodes 20000] [--top 25]``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import signal
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from actors.runtime.embedded import NatsServer
from tests.bench import bench_aggregator as agg
from tests.support.ports import free_port

TRACED = """
import runpy, signal, sys, tracemalloc
tracemalloc.start({depth})
signal.signal(signal.SIGUSR1, lambda *_: tracemalloc.take_snapshot().dump({out!r}))
sys.argv = ["fleetctl", *{argv!r}]
runpy.run_module("actors.cli.fleetctl", run_name="__main__")
"""
"""The aggregator under tracemalloc: SIGUSR1 dumps a snapshot to ``out``."""

NO_OFFLINE = {"FLEET_AGGREGATOR_OFFLINE_AFTER": "86400"}
"""The records' last heartbeat is from the fill: a slow traced load would otherwise turn
them offline (writes and alerts, not the memory at rest)."""

ROOT = str(Path(__file__).resolve().parents[2])


def options() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=int, default=20_000, help="records (default 20,000)")
    parser.add_argument("--top", type=int, default=25, help="lines printed (default 25)")
    parser.add_argument("--settle", type=float, default=15.0, help="seconds after the lease")
    return parser


def snapshot(url: str, out: Path, settle: float) -> tracemalloc.Snapshot:
    port = free_port()
    argv = [
        "aggregator",
        "--server",
        url,
        "--http-port",
        str(port),
        "--log-level",
        "error",
        *agg.BUDGETS,
    ]
    process = subprocess.Popen(
        [sys.executable, "-c", TRACED.format(depth=1, out=str(out), argv=argv)],
        stdout=subprocess.DEVNULL,
        env={**os.environ, **agg.SAMPLE_EVERY_3_S, **NO_OFFLINE},
    )
    try:
        owner = agg.Aggregator.__new__(agg.Aggregator)
        owner.port, owner.process = port, process
        agg.Aggregator.wait_answering(owner, 600)
        if not owning(owner, 900):
            raise SystemExit("the traced aggregator took no lease")
        time.sleep(settle)  # a script: the dashboard's first samples and the feed settle
        process.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + 300
        while not out.exists() or out.stat().st_size == 0:
            if time.monotonic() > deadline:
                raise SystemExit("no snapshot")
            time.sleep(0.5)
        time.sleep(2)  # the dump finishes writing
        return tracemalloc.Snapshot.load(str(out))
    finally:
        process.terminate()
        process.wait(30)


def owning(aggregator: agg.Aggregator, timeout: float) -> bool:
    """Whether it holds a lease within ``timeout``: asked every 10 s, as each /metrics
    decodes every record (slow under tracemalloc; asked twice a second, it starves the
    load it waits for)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (agg.Aggregator.metric(aggregator, "fleet_aggregator_owner", 120) or 0) >= 1:
            return True
        time.sleep(10)
    return False


def where(frame: tracemalloc.Frame) -> str:
    name = frame.filename
    return name[len(ROOT) + 1 :] if name.startswith(ROOT) else name.rsplit("/", 1)[-1]


def main() -> int:
    args = options().parse_args()
    with tempfile.TemporaryDirectory() as work:
        server = NatsServer(Path(work) / "nats")
        server.start()
        try:
            empty = snapshot(server.url, Path(work) / "empty.snap", args.settle)
            asyncio.run(agg.fill_records(server.url, args.nodes))
            full = snapshot(server.url, Path(work) / "full.snap", args.settle)
        finally:
            server.stop()
    stats = full.compare_to(empty, "lineno")
    total = sum(stat.size_diff for stat in stats)
    print(f"{args.nodes:,} nodes: {total / args.nodes:,.0f} bytes a node traced")
    by_module: collections.Counter[str] = collections.Counter()
    for stat in stats:
        by_module[where(stat.traceback[0])] += stat.size_diff
    print("\nbytes a node by module")
    for module, size in by_module.most_common(args.top):
        print(f"  {size / args.nodes:8,.0f}  {module}")
    print("\nbytes a node by line")
    for stat in sorted(stats, key=lambda s: -s.size_diff)[: args.top]:
        frame = stat.traceback[0]
        print(
            f"  {stat.size_diff / args.nodes:8,.0f}  {stat.count_diff / args.nodes:6.2f} blocks"
            f"  {where(frame)}:{frame.lineno}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
