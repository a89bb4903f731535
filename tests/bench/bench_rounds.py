"""Issue 48's fleet-wide jobs at fleet size with nothing changing: a script, not a test.

One embedded nats-server; ``--nodes`` (100,000) records of 1-GPU nodes put straight into
``fleet_nodes`` (no heartbeats); one ``fleetctl aggregator`` as shipped with every actor
that reads the whole fleet each round turned on: the HTTP API and dashboard (its hour of
history sampled every ``dashboard_history_interval``, 60 s), the remediation policy (a
dry run, every 15 s), an Alertmanager forwarder (a local sink: conditions checked every
round, resent every minute) and the command-consumer check (every ``sweep_interval``).
Once the records are loaded (and, with ``--admitted``, every command consumer exists), the
aggregator's CPU over ``--window`` seconds is the fleet-wide jobs' cost while nothing
changes: printed as a share of one core (target: under 1 %),
with the records it wrote meanwhile (none is the idle the figure claims). With py-spy
installed (``pip install py-spy``), the window is sampled too and the CPU split by job.

The records are ``pending`` by default: every job walks them as it walks admitted ones,
but no command consumer is made for them. With ``--admitted`` they are active, and the
aggregator first creates 100,000 consumers: on this 2-core machine under other work about
six a second (the server's), far too long for a run.

Each aggregator is measured once it holds its lease and has used under a fifth of a core
over 10 s (records loaded, first rounds done). ``--trees old,.`` runs the code of another
checkout first, then this one, on the same records: a before and after in one run.

Run: ``python tests/bench/bench_rounds.py`` (about 4 minutes at 100,000 nodes), or e.g.
``--nodes 10000 --window 30``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import http.server
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from actors.runtime.bus import NatsBus
from schemas import signing
from schemas.subjects import STREAM_COMMANDS, Subjects
from tests.bench import bench_aggregator as agg

JOBS = {
    "command consumers": ("command_queues.py",),
    "dashboard history": ("dashboard/actor.py:_sample", "dashboard/history.py"),
    "alertmanager": ("alertmanager.py",),
    "remediation policy": ("remediation/",),
    "reconciler": ("placement/",),
    "sweeps": ("aggregator/sweeps.py",),
    "checkpoints": ("aggregator/writes.py",),
    "metrics": ("prometheus", "views/api.py"),
    "live feed": ("live/feed.py",),
}
"""Each job by a part of a frame's file (and function) in a py-spy stack: the first job a
stack names from its outermost frame in takes the sample."""


IDLE = "EpollSelector.select"
"""The event loop waiting: py-spy samples it as running (a system call), it is not CPU."""


def options() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=int, default=100_000, help="records (default 100,000)")
    parser.add_argument("--window", type=float, default=120.0, help="seconds measured")
    parser.add_argument(
        "--settle",
        type=float,
        default=70.0,
        help="seconds after the consumers exist, unmeasured (default 70: past the "
        "dashboard's next sample, whose first point of each node loaded after its first "
        "decodes the node's heartbeat, a one-time cost)",
    )
    parser.add_argument(
        "--trees",
        default=".",
        help="source trees to run the aggregator from, one after the other on the same "
        "records (e.g. a checkout of the code before a change, then .)",
    )
    parser.add_argument(
        "--admitted", action="store_true", help="active records (a command consumer each)"
    )
    parser.add_argument(
        "--stale-after",
        type=float,
        default=3600.0,
        help="the stale_after the records' heartbeats claim, and the aggregator's "
        "max_stale_after (default 3600 s: the full sweep marks a node without a TTL marker "
        "stale after twice that plus full_sweep_interval, so no record changes in a run; "
        "with less, e.g. 90, the records turn stale during the run, the window is not idle)",
    )
    parser.add_argument(
        "--no-spy", action="store_true", help="do not sample with py-spy even if installed"
    )
    parser.add_argument(
        "--spy-out", default="", help="a folder to keep py-spy's raw samples in (spy-N.txt)"
    )
    return parser


class Sink(http.server.BaseHTTPRequestHandler):
    """An Alertmanager that takes every post and counts the posts and their alerts by
    kind."""

    posts = 0
    kinds: collections.Counter[str] = collections.Counter()

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("content-length", 0)))
        Sink.posts += 1
        for alert in json.loads(body or b"[]"):
            Sink.kinds[alert.get("labels", {}).get("kind", "?")] += 1
        self.send_response(200)
        self.end_headers()

    def log_message(self, *_: object) -> None:
        return


async def consumers(url: str) -> int:
    bus = await NatsBus.connect(url, "bench-rounds")
    try:
        info = await bus.js.stream_info(Subjects("fleet").stream_name(STREAM_COMMANDS))
        return int(info.state.consumer_count)
    finally:
        await bus.close()


def wait_consumers(url: str, nodes: int, timeout: float) -> float | None:
    """Seconds until FLEET_CMD has a consumer per node (the aggregator creates them)."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if asyncio.run(consumers(url)) >= nodes:
            return time.monotonic() - started
        time.sleep(2)
    return None


def spy(pid: int, seconds: float, out: Path) -> subprocess.Popen[bytes] | None:
    tool = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(tool).exists():
        return None
    return subprocess.Popen(
        [
            *(tool, "record", "--pid", str(pid), "--duration", str(int(seconds))),
            *("--rate", "200", "--format", "raw", "--nonblocking", "-o", str(out)),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


Counts = collections.Counter[str]


def by_job(raw: Path) -> tuple[Counts, Counts, Counts, int]:
    """Samples by job, by innermost frame and by the innermost of the project's frames
    (``actors/``) of the samples no job took, and all samples, from py-spy's raw output
    (``frame;frame;... count``, outermost first; idle threads are not sampled)."""
    jobs: Counts = collections.Counter()
    leaves: Counts = collections.Counter()
    others: Counts = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        count = int(count_text)
        frames = stack.split(";")
        if frames[-1].startswith(IDLE):
            continue
        total += count
        leaves[frames[-1]] += count
        job = next(
            (
                name
                for frame in frames
                for name, parts in JOBS.items()
                if any(part in frame.replace(" (", ":").replace("(", ":") for part in parts)
            ),
            "other",
        )
        jobs[job] += count
        if job == "other":
            ours = [frame for frame in frames if "actors/" in frame]
            others[ours[-1] if ours else frames[-1]] += count
    return jobs, leaves, others, total


def settled(aggregator: agg.Aggregator, below: float, timeout: float) -> float | None:
    """Seconds until the aggregator holds a lease, used under ``below`` of a core over
    10 s and wrote no record in them (its records loaded, its first rounds done, no
    transition under way), at most ``timeout``."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        cpu, written = aggregator.cpu(), aggregator.metric(WRITES, timeout=60)
        time.sleep(10)
        if (
            (aggregator.cpu() - cpu) / 10 < below
            and aggregator.metric(WRITES, timeout=60) == written
            and (aggregator.metric(OWNER, timeout=60) or 0) >= 1
        ):
            return time.monotonic() - started
    return None


OWNER = "fleet_aggregator_owner"
WRITES = "fleet_record_writes_total"
STATE = re.compile(r'^fleet_nodes\{state="(\w+)"\} ([\d.e+]+)$', re.M)


def states(aggregator: agg.Aggregator) -> str:
    """The held records by state, as the aggregator's ``fleet_nodes`` gauge tells them."""
    counts = STATE.findall(aggregator.metrics(60) or "")
    return ", ".join(f"{state} {float(n):,.0f}" for state, n in counts if float(n)) or "none"


def measure(bench: agg.Bench, args: argparse.Namespace, cluster: agg.Cluster, tree: str) -> None:
    """One aggregator from source tree ``tree`` (``.``: this one) on the filled server:
    settled, then its CPU over the window, split by job when py-spy is there."""
    env = {
        "FLEET_AGGREGATOR_POLICY_FILE": str(args.policy),
        "FLEET_AGGREGATOR_ALERTMANAGER_URLS": f"http://127.0.0.1:{args.sink}",
        # The records' last heartbeat is from the fill: at the default 300 s a slow load
        # turns them offline during the window, which is change, not the idle measured.
        "FLEET_AGGREGATOR_OFFLINE_AFTER": "86400",
        "FLEET_AGGREGATOR_MAX_STALE_AFTER": f"{args.stale_after:g}",
    }
    here = os.getcwd()
    os.chdir(tree)  # the aggregator's `python -m` imports the tree it starts in
    try:
        aggregator = cluster.start_aggregator(env=env)
    finally:
        os.chdir(here)
    took = settled(aggregator, 0.2, 1200)
    made = wait_consumers(cluster.url, args.nodes if args.admitted else 0, 600)
    bench.say(f"{tree}: settled {agg.fmt(took)} after start; consumers {agg.fmt(made)} later")
    time.sleep(args.settle)
    written = aggregator.metric(WRITES, timeout=60) or 0
    posts, kinds = Sink.posts, Sink.kinds.copy()
    bench.say(f"records by state at the window's start: {states(aggregator)}")
    raw = Path(args.spy_out or args.scratch) / f"spy-{len(bench.rows)}.txt"
    sampler = None if args.no_spy else spy(aggregator.process.pid, args.window, raw)
    cpu, wall = aggregator.cpu(), time.monotonic()
    time.sleep(args.window)
    cpu, wall = aggregator.cpu() - cpu, time.monotonic() - wall
    rss = aggregator.rss_mb()
    written = (aggregator.metric(WRITES, timeout=60) or 0) - written
    posts, kinds = Sink.posts - posts, Sink.kinds - kinds
    share = 100 * cpu / wall
    load = os.getloadavg()
    bench.say(f"records by state at the window's end: {states(aggregator)}")
    bench.say(f"alerts posted in the window by kind: {dict(kinds) or 'none'}")
    idle = not written and not posts
    bench.row(
        f"{tree}: aggregator CPU with {args.nodes:,} nodes and nothing changing (every "
        "fleet-wide job on)",
        "< 1 % of a core",
        f"{share:.2f} % ({cpu:.2f} CPU-s in {wall:.0f} s); {written:.0f} records "
        f"written, {posts} posts to Alertmanager meanwhile"
        f"{'' if idle else ' (NOT IDLE: a change, not the idle figure)'}; RSS {rss:.0f} MB; "
        f"load {load[0]:.1f}",
        idle and share < 1.0,
    )
    if sampler is not None:
        sampler.wait(args.window + 60)
        if raw.exists():
            jobs, leaves, others, total = by_job(raw)
            bench.say(f"py-spy: {total} samples at 200/s ({total / 200:.1f} s on CPU)")
            for job, count in jobs.most_common():
                bench.say(f"  {job:20} {count / 200 / wall * 100:6.2f} % of a core")
            bench.say("innermost frames:")
            for frame, count in leaves.most_common(12):
                bench.say(f"  {count / 200:7.2f} s  {frame}")
            bench.say("the other samples by their innermost frame of the project's code:")
            for frame, count in others.most_common(12):
                bench.say(f"  {count / 200:7.2f} s  {frame}")
    aggregator.stop()
    cluster.aggregators.remove(aggregator)


def main() -> int:
    signal.signal(signal.SIGTERM, agg.terminated)
    args = options().parse_args()
    bench = agg.Bench(agg.options().parse_args([]))
    load = os.getloadavg()
    bench.say(
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {psutil.cpu_count()} CPUs, "
        f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}; {args.nodes:,} records"
    )
    sink = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Sink)
    threading.Thread(target=sink.serve_forever, daemon=True).start()
    args.sink = sink.server_port
    try:
        with tempfile.TemporaryDirectory() as scratch, agg.servers(bench) as cluster:
            args.scratch = scratch
            key = Path(scratch) / "policy.key"
            signing.create_key_file(key)
            args.policy = Path(scratch) / "policy.toml"
            args.policy.write_text(f'key_file = "{key}"\ndry_run = true\n')
            provisioning = cluster.start_aggregator()  # the streams and buckets
            provisioning.wait_owner(60)
            provisioning.stop()
            cluster.aggregators.remove(provisioning)
            started = time.monotonic()
            state = "active" if args.admitted else "pending"
            asyncio.run(agg.fill_records(cluster.url, args.nodes, state, args.stale_after))
            bench.say(f"records written in {time.monotonic() - started:.0f} s")
            for tree in args.trees.split(","):
                measure(bench, args, cluster, tree)
    except KeyboardInterrupt:
        bench.say("interrupted")
    sink.shutdown()
    bench.say("")
    bench.table()
    return 0


if __name__ == "__main__":
    sys.exit(main())
