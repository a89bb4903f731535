"""Issue 48's listings at fleet size (a script, not a test): what ``fleetctl nodes``
costs with the state index beside the records.

A fresh embedded nats-server, one ``fleetctl aggregator`` (its state index on, as
shipped) and ``fleetctl simulate --nodes N --kill K`` (8 fake GPUs a node, one beat per
``--interval``; K nodes stop half way through ``--duration``: K stale nodes) as their own
processes. Once every node has a record and the index counts K stale nodes, each of these
``--runs`` times, in this process (wall time and payload bytes read) and as an operator
runs it (``fleetctl``, wall time and peak RSS):

- the summary by cluster and state (``fleetctl nodes``): the index alone;
- ``fleetctl nodes --state stale --all`` (K matches, as rows): the index, then those K
  records, live;
- the full live listing (``live.read_fleet``; ``fleetctl nodes -o json --all``);

then the dashboard's first page in headless Chromium, ``--loads`` times, from navigation
to the table's rows on screen (median and spread; ``bench_dashboard.py``'s measure, on a
fleet that is beating).

Run: ``python tests/bench/bench_listings.py --nodes 100000`` (about 15 minutes on 2
shared cores). With ``--fill`` no simulator runs: the nodes' keys and records are put
straight into the bus before the aggregator starts, then each node's next heartbeat
(``--kill`` of them unhealthy; :mod:`tests.bench.fleet_fill`), so 100,000 nodes are
reached in minutes; the state listing is then ``--state unhealthy``. Every record then
holds its node's latest heartbeat, so a live read verifies and decodes none; with
``--behind`` every node beats once more and its aggregator is killed once they are
judged, leaving every record a beat behind, as a fleet's records are between
checkpoints: the live read then verifies and decodes every node's heartbeat (the
dashboard, which needs an aggregator, is not measured).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import IO

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from actors.cli.fleetctl import indexed
from actors.fleet.live import reader as live
from actors.runtime.bus import NatsBus
from schemas.subjects import Subjects
from tests.bench.bench_aggregator import Aggregator, Bench, Cluster, servers
from tests.bench.bench_dashboard import first_pages
from tests.bench.bench_live_views import PREFIX, records_count
from tests.bench.fleet_fill import counted, filled_fleet, left_behind


def options() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=int, default=100_000)
    parser.add_argument("--interval", type=float, default=60.0, help="seconds between beats")
    parser.add_argument("--kill", type=int, default=300, help="nodes that stop half way")
    parser.add_argument("--duration", type=float, default=900.0, help="simulate's duration")
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--loads", type=int, default=5, help="dashboard first-page loads")
    parser.add_argument("--processes", type=int, default=2, help="fleetctl simulate --processes")
    parser.add_argument("--partitions", type=int, default=0, help="(as bench_aggregator)")
    parser.add_argument(
        "--fill",
        action="store_true",
        help="put the nodes straight into the bus (--kill of them unhealthy), no simulator",
    )
    parser.add_argument(
        "--behind",
        action="store_true",
        help="with --fill: every record a beat behind its node's latest heartbeat, as "
        "between checkpoints (each node's next beat judged, its aggregator killed; "
        "the dashboard is then not measured)",
    )
    return parser


async def measured(url: str, read: Callable[[NatsBus], Awaitable[str]]) -> tuple[float, int, str]:
    """(wall s, payload bytes read, what was read) of one read in this process."""
    bus = await NatsBus.connect(url, "bench-reader")
    try:
        in_bytes = bus.nc.stats["in_bytes"]
        started = time.monotonic()
        what = await read(bus)
        return time.monotonic() - started, bus.nc.stats["in_bytes"] - in_bytes, what
    finally:
        await bus.close()


async def summary(bus: NatsBus) -> str:
    found = await indexed.from_index(bus, Subjects(PREFIX), None, set())
    assert found is not None and found.records is None, "the index did not answer"
    return found.summary.splitlines()[-2]


async def everything(bus: NatsBus) -> str:
    found = await live.read_fleet(bus, Subjects(PREFIX))
    return f"{len(found)} records, {sum(1 for record in found if record.live)} live"


async def newer_than_records(url: str) -> str:
    """How many nodes a full live read shows a heartbeat newer than their record's (each
    one verified and decoded by the read): read apart from the timed ones."""
    bus = await NatsBus.connect(url, "bench")
    try:
        stored = await live.stored_records(bus, Subjects(PREFIX))
        before = {record.node_id: record.last_seq for record in stored}
        del stored
        found = await live.read_fleet(bus, Subjects(PREFIX))
        newer = sum(1 for record in found if record.last_seq > before.get(record.node_id, 0))
        return f"{newer} of them newer than their record"
    finally:
        await bus.close()


def wait_records(
    bench: Bench,
    cluster: Cluster,
    nodes: int,
    timeout: float,
    sim: subprocess.Popen[bytes],
    errors: IO[bytes],
) -> float:
    """Seconds until every node has a record; what simulate said if it ended before."""
    started = time.monotonic()
    while asyncio.run(records_count(cluster.url)) < nodes:
        if sim.poll() is not None:
            errors.seek(0)
            said = errors.read().decode(errors="replace")[-2000:]
            raise RuntimeError(f"fleetctl simulate ended ({sim.returncode}): {said}")
        if time.monotonic() - started > timeout:
            raise RuntimeError(f"not every node has a record within {timeout:g}s")
        time.sleep(1.0)
    return time.monotonic() - started


def fleetctl(cluster: Cluster, *args: str) -> tuple[float, float, int]:
    """(wall s, peak RSS MiB, exit status) of one fleetctl command, its output dropped."""
    started = time.monotonic()
    command = [sys.executable, "-m", "actors.cli.fleetctl", *args, "--server", cluster.url]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    return time.monotonic() - started, usage.ru_maxrss / 1024, process.returncode


def spread(values: list[float]) -> str:
    listed = ", ".join(f"{value:.2f}" for value in values)
    return f"{statistics.median(values):.2f} s median ({listed})"


def run(bench: Bench, cluster: Cluster) -> None:
    args = bench.args
    aggregator = cluster.start_aggregator()
    rate = args.nodes / args.interval
    extra = ("--gpus", str(args.gpus), "--wait", "0.01", "--kill", str(args.kill))
    command = cluster.simulate_command(args.nodes, rate, args.duration, *extra)
    errors = tempfile.TemporaryFile()
    sim = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=errors)
    try:
        took = wait_records(bench, cluster, args.nodes, args.interval * 4 + 600, sim, errors)
        bench.say(
            f"{args.nodes} nodes of {args.gpus} GPUs at {rate:.0f}/s: records in {took:.0f} s"
        )
        deadline = time.monotonic() + args.duration
        while asyncio.run(counted(cluster.url, "stale")) < args.kill:
            if time.monotonic() > deadline:
                raise RuntimeError("the index never counted the stopped nodes stale")
            time.sleep(2.0)
        bench.say(f"index counts {args.kill} stale nodes")
        measure(bench, cluster, aggregator, "stale")
    finally:
        sim.terminate()
        try:
            sim.wait(20)
        except subprocess.TimeoutExpired:
            sim.kill()
            sim.wait()


def run_filled(bench: Bench, cluster: Cluster) -> None:
    """``--fill``: keys and records first, the aggregator, then every node's next beat."""
    args = bench.args
    aggregator = filled_fleet(bench, cluster, args.nodes, args.gpus, args.kill)
    if args.behind:
        left_behind(bench, cluster, aggregator, args.nodes, args.gpus, args.kill)
    measure(bench, cluster, None if args.behind else aggregator, "unhealthy")


def measure(bench: Bench, cluster: Cluster, aggregator: Aggregator | None, state: str) -> None:
    """Each listing ``--runs`` times (in this process and as fleetctl), then the
    dashboard's first page ``--loads`` times (not without an ``aggregator``)."""
    args = bench.args

    async def in_state(bus: NatsBus) -> str:
        found = await indexed.from_index(bus, Subjects(PREFIX), None, {state}, rows=True)
        assert found is not None and found.records is not None, "the index did not answer"
        live_ = sum(1 for record in found.records if record.live)
        return f"{len(found.records)} {state} nodes listed, {live_} of them live"

    listing = f"--state {state} ({args.kill})"
    reads = {"summary": summary, listing: in_state, "full": everything}
    commands = {
        "summary": ["nodes"],
        listing: ["nodes", "--state", state, "--all"],
        "full": ["nodes", "-o", "json", "--all"],
    }
    for name, read in reads.items():
        walls, sizes, cli, rss = [], [], [], []
        what = ""
        for _ in range(args.runs):
            wall, size, what = asyncio.run(measured(cluster.url, read))
            walls.append(wall)
            sizes.append(size)
            cli_wall, cli_rss, code = fleetctl(cluster, *commands[name])
            cli.append(cli_wall if code == 0 else float("nan"))
            rss.append(cli_rss)
        bench.row(
            f"{args.nodes}: {name}{', records a beat behind' if args.behind else ''}",
            "",
            f"read {spread(walls)}, {statistics.median(sizes) / 2**20:.1f} MiB; "
            f"fleetctl {' '.join(commands[name])} {spread(cli)}, peak RSS "
            f"{max(rss):.0f} MiB; {what}",
        )
    bench.say(f"  the full read: {asyncio.run(newer_than_records(cluster.url))}")
    if aggregator is None:
        bench.say("  the dashboard's first page: not measured (no aggregator serves it)")
        return
    url = f"http://127.0.0.1:{aggregator.port}/"
    times = asyncio.run(first_pages(url, args.loads))
    bench.row(
        f"{args.nodes}: dashboard first page",
        "1 s median",
        f"{spread(times)}; aggregator RSS {aggregator.rss_mb():.0f} MiB",
    )


def main() -> int:
    bench = Bench(options().parse_args())
    with servers(bench) as cluster:
        (run_filled if bench.args.fill else run)(bench, cluster)
    load = ", ".join(f"{value:.1f}" for value in os.getloadavg())
    bench.say(f"machine: {os.cpu_count()} CPUs, load average {load} (1, 5, 15 min)")
    bench.say("")
    bench.table("figure")
    return 0


if __name__ == "__main__":
    sys.exit(main())
