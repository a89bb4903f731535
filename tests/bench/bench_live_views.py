"""Issue 33's benchmark: what the live views cost at fleet size (a script, not a test).

For each of ``--nodes`` (10,000 and 100,000): a fresh embedded nats-server, one
``fleetctl aggregator`` and ``fleetctl simulate`` (8 fake GPUs a node, one beat per
``--interval`` each) as their own processes, as ``bench_aggregator.py`` runs them. Once
every node has a record:

- the listing, in this process: ``records.read_records`` alone (what every view read
  before issue 33) and ``live.read_fleet`` (records + each node's latest accepted
  heartbeat from FLEET_HB): wall time, payload bytes read, nats-server CPU over the read
  (the load's share included: its rate alone, 2 s before, is printed), and how many
  nodes were read live;
- agreement: right after the live listing, each node's latest heartbeat in FLEET_HB
  (what the simulated node last sent: its own ``node-agent status``) is read raw, and
  every node's listed SEQ compared with it: how many are within one heartbeat;
- ``fleetctl nodes -o json --all`` and ``fleetctl describe <node>`` as an operator runs
  them (wall time, output size);
- the aggregator's CPU per accepted heartbeat over ``--window`` seconds without a view,
  then over ``--window`` seconds with ``fleetctl nodes --watch`` (2 s) beside the load,
  then with a process that only burns as much of a core as the view used (the control:
  on shared cores any process beside the aggregator moves its CPU per heartbeat),
  ``--rounds`` times in turn, and the ratios to the window without (same run, same
  machine: median and range), with the rate it accepted in each window (a ratio means
  something only while it keeps up with the rate published). The view lists
  ``--watch-limit`` nodes as rows (0: every node, ``--all -o json``).

Run: ``python tests/bench/bench_live_views.py`` (about 15 minutes on 2 shared cores), or
e.g. ``--nodes 10000 --window 20``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import NamedTuple

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import msgspec

from actors.fleet.live import reader as live
from actors.fleet.storage import records
from actors.runtime import direct_get
from actors.runtime.bus import NatsBus
from schemas.subjects import BUCKET_NODES, STREAM_HEARTBEATS, Subjects
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
        "--rounds",
        type=int,
        default=3,
        help="CPU windows without, then with, a view, in turn (default 3: the spread shows)",
    )
    parser.add_argument(
        "--watch-limit",
        default="0,1000",
        help="rows the --watch view lists, per fleet size (0: every node; default 0,1000)",
    )
    parser.add_argument(
        "--gpus", default="8", help="fake GPUs a node, per fleet size (default 8: 5 KB a beat)"
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


class _Sent(msgspec.Struct):
    """What the agreement check reads of a heartbeat body."""

    node_id: str
    seq: int


async def latest_sent(bus: NatsBus) -> dict[str, int]:
    """Each node's latest heartbeat seq in FLEET_HB, read raw (no judgement): what the
    node itself last sent."""
    subjects = Subjects(PREFIX)
    stream = subjects.stream_name(STREAM_HEARTBEATS)
    info = await bus.js.stream_info(stream)
    latest: dict[str, int] = {}
    filter_ = f"{PREFIX}.hb.>"
    pages = direct_get.pages(bus, stream, filter_, 600.0, up_to=info.state.last_seq)
    async for page in pages:
        for message in page:
            if message.data:
                sent = msgspec.json.decode(message.data, type=_Sent)
                latest[sent.node_id] = max(latest.get(sent.node_id, 0), sent.seq)
    return latest


def agreement(found: list[live.LiveRecord], sent: dict[str, int]) -> str:
    """How many listed SEQs are within one heartbeat of the node's latest sent."""
    gaps = [(record.live, sent.get(record.node_id, 0) - record.last_seq) for record in found]
    within = [live_ for live_, gap in gaps if gap <= 1]
    marked = sum(1 for live_, _ in gaps if not live_)
    return (
        f"{len(within)} of {len(gaps)} within one heartbeat of the node's latest "
        f"(live {sum(within)} of {len(gaps) - marked}; marked {within.count(False)} of "
        f"{marked}); largest gap {max((gap for _, gap in gaps), default=0)} beats"
    )


async def read(cluster: Cluster, how: str) -> tuple[float, int, float, int, str]:
    """(wall s, payload bytes read, server CPU s over the read, records, how many were
    read live and why the others were not, and how the listed SEQs agree with what each
    node last sent); the server's CPU rate under the load alone (2 s before the read) is
    printed beside."""
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
            count = len(await records.read_records(bus, subjects))
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
        got = bus.nc.stats["in_bytes"] - in_bytes
        if how == "live":
            shown += "; " + agreement(found, await latest_sent(bus))
        return wall, got, used, count, shown
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


def accepted(cluster: Cluster) -> float:
    """The aggregator's heartbeats accepted so far (its /metrics, which a busy aggregator
    may take seconds to answer at 100,000 nodes)."""
    (aggregator,) = cluster.aggregators
    for _ in range(3):
        count = aggregator.metric(ACCEPTED, timeout=30.0)
        if count is not None:
            return count
    raise RuntimeError("the aggregator's /metrics did not answer")


def cpu_window(cluster: Cluster, seconds: float) -> tuple[float, float, float]:
    """(aggregator CPU s, heartbeats accepted, seconds) over at least ``seconds``,
    between two reads of its counter."""
    (aggregator,) = cluster.aggregators
    first = accepted(cluster)
    cpu, started = aggregator.cpu(), time.monotonic()
    time.sleep(seconds)
    last = accepted(cluster)
    return aggregator.cpu() - cpu, last - first, time.monotonic() - started


class Window(NamedTuple):
    """The aggregator over one CPU window."""

    cpu: float
    accepted: float
    seconds: float

    @property
    def per_heartbeat(self) -> float:
        """CPU µs per accepted heartbeat (NaN when none was)."""
        return 1e6 * self.cpu / self.accepted if self.accepted else float("nan")

    @property
    def rate(self) -> float:
        return self.accepted / self.seconds


BURNER = """
import sys, time
duty = min(float(sys.argv[1]), 1.0)
while True:
    started = time.perf_counter()
    while time.perf_counter() - started < duty * 0.01:
        pass
    time.sleep((1.0 - duty) * 0.01)
"""
"""A process that burns ``duty`` of one core and touches nothing else: the control for
what a view costs the aggregator by sharing the cores alone."""


def beside(cluster: Cluster, command: list[str], window: float) -> tuple[Window, float]:
    """A CPU window with ``command`` running beside the load, and the share of a core
    the command itself used over the window."""
    side = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(3.0)  # a view's first read under way
        process = psutil.Process(side.pid)
        before = process.cpu_times()
        measured = Window(*cpu_window(cluster, window))
        after = process.cpu_times()
    finally:
        side.kill()  # a view may be in the middle of a read
        side.wait(10)
    used = after.user + after.system - before.user - before.system
    return measured, float(used) / measured.seconds


def run(bench: Bench, nodes: int, interval: float, watch_limit: int, gpus: int) -> None:
    window = bench.args.window
    with servers(bench) as cluster:
        cluster.start_aggregator()
        rate = nodes / interval
        command = cluster.simulate_command(nodes, rate, 3600, "--gpus", str(gpus), "--wait", "0.01")
        sim = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            took = wait_records(bench, cluster, nodes, interval * 4 + 600)
            bench.say(
                f"{nodes} nodes of {gpus} GPUs at {rate:.0f}/s ({interval:g} s interval): "
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

            rows = (
                ["--all", "-o", "json"]
                if watch_limit == 0
                else ["--limit", str(watch_limit), "-o", "wide"]
            )
            view = [sys.executable, "-m", "actors.cli.fleetctl", "nodes", "--watch", *rows]
            view += ["--server", cluster.url]
            quiets, views, burns = [], [], []
            for turn in range(1, bench.args.rounds + 1):
                quiet = Window(*cpu_window(cluster, window))
                viewed, share = beside(cluster, view, window)
                burned, burner = beside(
                    cluster, [sys.executable, "-c", BURNER, f"{share:.3f}"], window
                )
                quiets.append(quiet.per_heartbeat)
                views.append(viewed.per_heartbeat / quiet.per_heartbeat)
                burns.append(burned.per_heartbeat / quiet.per_heartbeat)
                bench.say(
                    f"  round {turn}: {quiet.per_heartbeat:.1f} us without a view "
                    f"({quiet.rate:.0f}/s accepted of {rate:.0f}/s); "
                    f"{viewed.per_heartbeat:.1f} us with the view ({viewed.rate:.0f}/s; "
                    f"it used {share:.2f} of a core); {burned.per_heartbeat:.1f} us with a "
                    f"burner of {burner:.2f} of a core instead ({burned.rate:.0f}/s); "
                    f"ratios {views[-1]:.3f} and {burns[-1]:.3f}"
                )
            bench.row(
                f"{nodes}: aggregator CPU per accepted heartbeat: with a view / without; "
                "with a burner of the view's CPU / without",
                "view no worse than the burner",
                f"{statistics.median(quiets):.0f} us without (median); view ratio median "
                f"{statistics.median(views):.3f} (range {min(views):.3f} to {max(views):.3f}); "
                f"burner ratio median {statistics.median(burns):.3f} (range "
                f"{min(burns):.3f} to {max(burns):.3f}); {len(views)} rounds of {window:g} s "
                f"each; view `nodes --watch {' '.join(rows)}`",
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
    gpus = [int(n) for n in args.gpus.split(",")]
    for index, nodes in enumerate(sizes):
        run(
            bench,
            nodes,
            intervals[min(index, len(intervals) - 1)],
            limits[min(index, len(limits) - 1)],
            gpus[min(index, len(gpus) - 1)],
        )
    bench.say("")
    bench.table("figure")
    return 0


if __name__ == "__main__":
    sys.exit(main())
