"""Issue 33's benchmark: what the live views cost at fleet size (a script, not a test).

For each of ``--nodes`` (10,000 and 100,000): a fresh embedded nats-server, one
``fleetctl aggregator`` and ``fleetctl simulate`` (8 fake GPUs a node, one beat per
``--interval`` each) as their own processes, as ``bench_aggregator.py`` runs them. Once
every node has a record:

- the listing, in this process: ``registry.read_records`` alone (what every view read
  before issue 33) and ``live.read_fleet`` (records + each node's latest accepted
  heartbeat from FLEET_HB): wall time, payload bytes read, nats-server CPU over the read
  (the load's share included: its rate alone, 2 s before, is printed), and how many
  nodes were read live;
- ``fleetctl nodes -o json --all`` and ``fleetctl describe <node>`` as an operator runs
  them (wall time, output size);
- the aggregator's CPU per accepted heartbeat over ``--window`` seconds without a view,
  then over ``--window`` seconds with ``fleetctl nodes --watch`` (2 s) beside the load, and
  their ratio (same run, same machine). The view lists ``--watch-limit`` nodes as rows
  (0: every node, ``--all -o json``).

Run: ``python tests/bench/bench_live_views.py`` (about 15 minutes on 2 shared cores), or
e.g. ``--nodes 10000 --window 20``.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from actors.fleet import live, registry
from actors.runtime.bus import NatsBus
from schemas.subjects import BUCKET_NODES, Subjects
from tests.bench.bench_aggregator import ACCEPTED, Bench, Cluster, servers

PREFIX = "fleet"


def options() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", default="10000,100000", help="fleet sizes, in turn")
    parser.add_argument(
        "--interval",
        default="30,60",
        help="seconds between two beats of a node, per fleet size (default 30,60)",
    )
    parser.add_argument("--window", type=float, default=30.0, help="seconds per CPU window")
    parser.add_argument(
        "--watch-limit",
        default="0,1000",
        help="rows the --watch view lists, per fleet size (0: every node; default 0,1000)",
    )
    parser.add_argument("--processes", type=int, default=2, help="fleetctl simulate --processes")
    parser.add_argument("--partitions", type=int, default=0, help="(as bench_aggregator)")
    return parser


def server_cpu(cluster: Cluster) -> float:
    assert cluster.server.process is not None
    times = psutil.Process(cluster.server.process.pid).cpu_times()
    return float(times.user + times.system)


async def records_count(url: str) -> int:
    bus = await NatsBus.connect(url, "bench")
    try:
        stream = f"KV_{Subjects(PREFIX).bucket_name(BUCKET_NODES)}"
        info = await bus.js.stream_info(stream)
        return int(info.state.messages)
    finally:
        await bus.close()


def wait_records(bench: Bench, cluster: Cluster, nodes: int, timeout: float) -> float:
    started = time.monotonic()
    while asyncio.run(records_count(cluster.url)) < nodes:
        if time.monotonic() - started > timeout:
            raise RuntimeError(f"not every node has a record within {timeout:g}s")
        time.sleep(1.0)
    return time.monotonic() - started


async def read(cluster: Cluster, how: str) -> tuple[float, int, float, int, str]:
    """(wall s, payload bytes read, server CPU s over the read, records, how many were
    read live and why the others were not); the server's CPU rate under the load alone
    (2 s before the read) is printed beside."""
    bus = await NatsBus.connect(cluster.url, "bench-reader")
    try:
        before = server_cpu(cluster)
        await asyncio.sleep(2.0)
        print(f"  server CPU under the load alone: {(server_cpu(cluster) - before) / 2:.2f} s/s")
        in_bytes = bus.nc.stats["in_bytes"]
        cpu = server_cpu(cluster)
        started = time.monotonic()
        subjects = Subjects(PREFIX)
        if how == "records":
            count = len(await registry.read_records(bus, subjects))
            shown = ""
        else:
            found = await live.read_fleet(bus, subjects)
            count = len(found)
            notes = Counter(record.live_note for record in found if not record.live)
            shown = f"{len(found) - sum(notes.values())} live" + "".join(
                f"; {count} {note}" for note, count in notes.most_common(3)
            )
        wall = time.monotonic() - started
        used = server_cpu(cluster) - cpu
        return wall, bus.nc.stats["in_bytes"] - in_bytes, used, count, shown
    finally:
        await bus.close()


def fleetctl(cluster: Cluster, *args: str) -> tuple[float, int, int]:
    """(wall s, bytes printed, exit status) of one fleetctl command."""
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "actors.cli.fleetctl", *args, "--server", cluster.url],
        capture_output=True,
        timeout=600,
    )
    return time.monotonic() - started, len(done.stdout), done.returncode


def cpu_window(cluster: Cluster, seconds: float) -> tuple[float, float]:
    """(aggregator CPU s, heartbeats accepted) over ``seconds``."""
    (aggregator,) = cluster.aggregators
    cpu, accepted = aggregator.cpu(), aggregator.metric(ACCEPTED) or 0.0
    time.sleep(seconds)
    return aggregator.cpu() - cpu, (aggregator.metric(ACCEPTED) or 0.0) - accepted


def run(bench: Bench, nodes: int, interval: float, watch_limit: int) -> None:
    window = bench.args.window
    with servers(bench) as cluster:
        cluster.start_aggregator()
        rate = nodes / interval
        command = cluster.simulate_command(nodes, rate, 3600, "--gpus", "8", "--wait", "0.01")
        sim = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            took = wait_records(bench, cluster, nodes, interval * 4 + 600)
            bench.say(
                f"{nodes} nodes at {rate:.0f}/s ({interval:g} s interval): "
                f"every record in {took:.0f} s"
            )
            time.sleep(interval / 2)  # every node beaten again since its record was written
            for how in ("records", "live"):
                wall, got, used, count, shown = asyncio.run(read(cluster, how))
                what = "read_records (before)" if how == "records" else "live.read_fleet"
                bench.row(
                    f"{nodes}: {what}",
                    "",
                    f"{wall:.2f} s, {got / 2**20:.0f} MiB read, "
                    f"server CPU {used:.2f} s over the read, "
                    f"{count} records" + (f", {shown}" if shown else ""),
                )
            wall, size, code = fleetctl(cluster, "nodes", "-o", "json", "--all")
            bench.row(
                f"{nodes}: fleetctl nodes -o json --all",
                "",
                f"{wall:.2f} s, {size / 2**20:.0f} MiB out, exit {code}",
            )
            wall, size, code = fleetctl(cluster, "describe", "sim-00001")
            bench.row(f"{nodes}: fleetctl describe sim-00001", "", f"{wall:.2f} s, exit {code}")

            quiet_cpu, quiet_accepted = cpu_window(cluster, window)
            rows = (
                ["--all", "-o", "json"]
                if watch_limit == 0
                else ["--limit", str(watch_limit), "-o", "wide"]
            )
            view = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "actors.cli.fleetctl",
                    "nodes",
                    "--watch",
                    *rows,
                    "--server",
                    cluster.url,
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            try:
                time.sleep(3.0)  # the view's first read under way
                view_cpu, view_accepted = cpu_window(cluster, window)
                viewer = psutil.Process(view.pid).cpu_times()
            finally:
                view.kill()  # it may be in the middle of a read
                view.wait(10)
            quiet = 1e6 * quiet_cpu / quiet_accepted if quiet_accepted else float("nan")
            viewed = 1e6 * view_cpu / view_accepted if view_accepted else float("nan")
            bench.row(
                f"{nodes}: aggregator CPU per accepted heartbeat",
                "no worse with a view",
                f"{quiet:.1f} us without a view ({quiet_accepted:.0f} accepted in {window:g} s), "
                f"{viewed:.1f} us with `nodes --watch {' '.join(rows)}` ({view_accepted:.0f}); "
                f"ratio {viewed / quiet:.3f}; "
                f"the view used {viewer.user + viewer.system:.1f} CPU s",
            )
        finally:
            sim.terminate()
            try:
                sim.wait(20)
            except subprocess.TimeoutExpired:
                sim.kill()
                sim.wait()


def main() -> int:
    args = options().parse_args()
    bench = Bench(args)
    sizes = [int(n) for n in args.nodes.split(",")]
    intervals = [float(s) for s in args.interval.split(",")]
    limits = [int(n) for n in args.watch_limit.split(",")]
    for index, nodes in enumerate(sizes):
        run(
            bench,
            nodes,
            intervals[min(index, len(intervals) - 1)],
            limits[min(index, len(limits) - 1)],
        )
    bench.say("\n| figure | target | measured |\n|---|---|---|")
    for row in bench.rows:
        bench.say(row.line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
