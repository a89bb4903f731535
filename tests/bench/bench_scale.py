"""Issue 48's item 6, a node's cost independent of fleet size (a script, not a test):
the aggregator's CPU per heartbeat at 10,000 nodes and at 100,000, at the same interval.

For each size of ``--sizes``, on a fresh embedded nats-server: the nodes' keys and active
records put straight into the bus (:mod:`tests.bench.fleet_fill`: no registration, no
first contact to pay for), one ``fleetctl aggregator`` as shipped started on them (HTTP
port on, every default actor). Once it holds every lease, the server holds every node's
command consumer (made by the aggregator, as for nodes admitted) and the dashboard took
its first sample of the loaded nodes, ``--idle`` seconds of its CPU with nothing coming
give the floor of its timers. Then every node beats every ``--interval`` seconds (signed
with the fill's key, ``--gpus`` fake GPUs, evenly spread: nodes / interval a second)
from a thread of this process. After two intervals (each node's first beat of a loaded
record, then a steady one) the aggregator's CPU and accepted heartbeats over
``--window`` seconds give its CPU per heartbeat, printed as measured and less the idle
floor over the same seconds, with the heartbeats left unjudged at the window's end (a
run that fell behind says so) and the aggregator's RSS.

The same interval means the same checkpoint writes per heartbeat at every size (one a
node every ``checkpoint_interval``) and the same dashboard points per heartbeat; what the
sizes differ in is the rate, and the size of every table a heartbeat looks into. A size
may name its own interval (``10000@6``: 10,000 nodes beating every 6 s, the rate of
100,000 at 60 s), to compare sizes at one rate instead. The last size is compared with
each before it (target: at most 10 % more CPU per heartbeat).

Run: ``python tests/bench/bench_scale.py`` (about 90 minutes on 2 cores, most of it
nats-server making 100,000 command consumers), or e.g.
``--sizes 2000,20000 --interval 20 --window 40`` for a quick look.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from actors.cli.simulate.publisher import node_id
from actors.runtime.bus import NatsBus
from schemas.subjects import Subjects
from tests.bench.bench_aggregator import (
    ACCEPTED,
    Aggregator,
    Bench,
    command_consumers_made,
    servers,
    terminated,
)
from tests.bench.fleet_fill import (
    BATCH,
    PREFIX,
    beat_body,
    beat_template,
    loaded_aggregator,
    signed_headers,
    unjudged,
)

SETTLE = 70.0
"""Seconds after the lease before the idle floor is measured: past the dashboard's first
sample (every 60 s), whose first point of each loaded node decodes its heartbeat once."""
CONSUMERS_WAIT = 7200.0
"""Seconds the aggregator may take to make every node's command consumer. At 100,000
nodes nats-server takes over an hour of a core: FLEET_CMD is a work-queue stream, whose
every new consumer the server checks against each one there (on 2026-11-30: about 75 a
second at first, 11 past 95,000; 95,040 made in the hour this wait was then)."""
CHUNK = 64
"""Heartbeats published between two looks at the schedule."""
TARGET = 0.10
"""Issue 48: CPU per heartbeat at the largest size within 10 % of the smallest's."""


def options() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sizes",
        default="10000@6,10000,100000",
        help="fleet sizes, in order, each NODES or NODES@INTERVAL (default 10000@6,10000,100000)",
    )
    parser.add_argument("--interval", type=float, default=60.0, help="seconds between beats")
    parser.add_argument("--gpus", type=int, default=8, help="fake GPUs a node (8)")
    parser.add_argument("--idle", type=float, default=30.0, help="seconds of the idle floor")
    parser.add_argument("--window", type=float, default=120.0, help="seconds measured")
    parser.add_argument("--partitions", type=int, default=0, help="(as bench_aggregator)")
    return parser


class Beats(threading.Thread):
    """Each of ``nodes`` nodes' heartbeat every ``interval`` seconds, evenly spread, seq
    2, 3, ... (the fill's records hold seq 1), until :attr:`stop` is set."""

    def __init__(self, url: str, nodes: int, gpus: int, interval: float) -> None:
        super().__init__(daemon=True)
        self.url, self.nodes, self.gpus, self.interval = url, nodes, gpus, interval
        self.stop = threading.Event()
        self.published = 0
        self.behind = 0.0
        """The most seconds the publishing fell behind its schedule."""
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            asyncio.run(self._beat())
        except BaseException as exc:  # reported by the bench, not lost with the thread
            self.error = exc

    async def _beat(self) -> None:
        subjects = Subjects(PREFIX)
        template = beat_template(self.gpus, unhealthy=False, interval=self.interval)
        rate = self.nodes / self.interval
        bus = await NatsBus.connect(self.url, "bench-beats")
        started, seq = time.monotonic(), 2
        try:
            while not self.stop.is_set():
                for index in range(self.nodes):
                    if self.published % CHUNK == 0:
                        ahead = started + self.published / rate - time.monotonic()
                        self.behind = max(self.behind, -ahead)
                        if ahead > 0:
                            await asyncio.sleep(ahead)
                        if self.stop.is_set():
                            break
                    body = beat_body(template, index, seq, time.time())
                    subject = subjects.heartbeat("sim", node_id(index))
                    await bus.js.publish_async(subject, body, headers=signed_headers(body))
                    self.published += 1
                    if self.published % BATCH == 0:
                        await bus.js.publish_async_completed()
                seq += 1
            await bus.js.publish_async_completed()
        finally:
            await bus.close()


def cpu_and_accepted(aggregator: Aggregator) -> tuple[float, float]:
    return aggregator.cpu(), aggregator.metric(ACCEPTED) or 0.0


def one_size(bench: Bench, nodes: int, interval: float) -> float | None:
    """The aggregator's CPU per heartbeat less its idle floor at ``nodes`` nodes beating
    every ``interval`` seconds (None when not measured), each figure printed."""
    args = bench.args
    with servers(bench) as cluster:
        aggregator = loaded_aggregator(bench, cluster, nodes, args.gpus)
        leased = time.monotonic()
        deadline = leased + CONSUMERS_WAIT
        made = asyncio.run(
            command_consumers_made(cluster.url, nodes, lambda: time.monotonic() > deadline)
        )
        if not made:
            raise RuntimeError(f"{nodes} command consumers not made in {CONSUMERS_WAIT:g} s")
        bench.say(
            f"  {nodes:,}: every command consumer {time.monotonic() - leased:.0f} s after "
            f"the leases; RSS {aggregator.rss_mb():.0f} MB"
        )
        time.sleep(max(0.0, leased + SETTLE - time.monotonic()))
        before = aggregator.cpu()
        idle: float = args.idle
        time.sleep(idle)
        floor = (aggregator.cpu() - before) / idle
        beats = Beats(cluster.url, nodes, args.gpus, interval)
        beats.start()
        try:
            time.sleep(2 * interval)
            cpu, accepted = cpu_and_accepted(aggregator)
            started = time.monotonic()
            time.sleep(args.window)
            cpu_after, accepted_after = cpu_and_accepted(aggregator)
            window = time.monotonic() - started
            left = asyncio.run(unjudged(cluster.url))
        finally:
            beats.stop.set()
            beats.join()
        if beats.error is not None:
            raise RuntimeError(f"publishing failed: {beats.error!r}")
        counted = accepted_after - accepted
        if not counted:
            bench.say(f"  {nodes:,}: no heartbeat accepted in the window")
            return None
        spent = cpu_after - cpu
        per = 1e6 * spent / counted
        beyond = 1e6 * (spent - floor * window) / counted
        bench.say(
            f"  {nodes:,} nodes, a beat each {interval:g} s ({nodes / interval:,.0f}/s): "
            f"{per:.1f} µs CPU per accepted heartbeat, {beyond:.1f} µs beyond the idle "
            f"floor ({100 * floor:.2f} % of a core); {counted:,.0f} accepted in "
            f"{window:.0f} s ({counted / window:,.0f}/s), {left:,} unjudged at the end, "
            f"publishing at most {beats.behind:.1f} s behind; RSS {aggregator.rss_mb():.0f} MB"
        )
        return beyond


def size(text: str, interval: float) -> tuple[int, float]:
    """``NODES`` or ``NODES@INTERVAL`` as (nodes, interval)."""
    nodes, _, own = text.partition("@")
    return int(nodes), float(own) if own else interval


def main() -> int:
    args = options().parse_args()
    bench = Bench(args)
    signal.signal(signal.SIGTERM, terminated)  # so the servers started are stopped
    sizes = [size(text, args.interval) for text in args.sizes.split(",")]
    bench.say(
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; sizes {args.sizes}, a beat "
        f"each {args.interval:g} s unless said, {args.gpus} GPUs a node, {args.window:g} s "
        "measured"
    )
    try:
        figures = [(n, every, one_size(bench, n, every)) for n, every in sizes]
    except KeyboardInterrupt:  # each size's servers are stopped by now
        bench.say("interrupted")
        return 130
    nodes, interval, largest = figures[-1]
    for other, other_interval, figure in figures[:-1]:
        if figure is None or largest is None:
            bench.row(f"CPU per heartbeat, {nodes:,} against {other:,}", "—", "not measured")
            continue
        change = largest / figure - 1
        bench.row(
            f"aggregator CPU per heartbeat beyond its idle floor, {nodes:,} nodes beating "
            f"each {interval:g} s against {other:,} each {other_interval:g} s",
            f"at most {TARGET:.0%} more",
            f"{largest:.1f} µs against {figure:.1f} µs: {change:+.1%}",
            change <= TARGET,
        )
    bench.table()
    return 0


if __name__ == "__main__":
    sys.exit(main())
