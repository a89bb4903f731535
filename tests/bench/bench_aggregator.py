"""Benchmark of one aggregator's heartbeat throughput (a script, not collected by pytest).

An embedded nats-server, ONE aggregator as its own process (``fleetctl aggregator``), and
``fleetctl simulate`` as a subprocess for N nodes at increasing total rates. For each rate
it prints the publish rate achieved, the aggregator's catch-up lag after the last publish,
and the aggregator's CPU % and RSS, plus the CPU of nats-server and of the simulator (on a
small machine they share the cores). The highest rate with a lag well under a second is
one aggregator's sustainable rate; at the default 10 s interval it serves 10 x that.

Run: ``python tests/bench/bench_aggregator.py [--nodes 2000] [--rates 200,500,1000]
[--duration 20]``.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from actors.runtime.bus import NatsBus
from actors.runtime.embedded import NatsServer
from schemas.subjects import BUCKET_TRUST, STREAM_HEARTBEATS, Subjects


async def wait_provisioned(url: str, timeout: float = 30.0) -> None:
    bus = await NatsBus.connect(url, "bench")
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                await bus.js.stream_info(Subjects("fleet").stream_name(STREAM_HEARTBEATS))
                await bus.kv(Subjects("fleet").bucket_name(BUCKET_TRUST))
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)
    finally:
        await bus.close()


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def step(
    url: str, nodes: int, rate: float, duration: float, processes: dict[str, psutil.Process]
) -> None:
    for process in processes.values():
        process.cpu_percent(None)  # start the interval
    before = children_cpu()
    start = time.monotonic()
    done = subprocess.run(
        [
            *(sys.executable, "-m", "actors.cli.fleetctl", "simulate", "--server", url),
            *("--nodes", str(nodes), "--rate", str(rate), "--duration", str(duration)),
        ],
        capture_output=True,
        text=True,
        timeout=duration + 180,
    )
    wall = time.monotonic() - start
    usage = {name: process.cpu_percent(None) for name, process in processes.items()}
    simulator = 100.0 * (children_cpu() - before) / wall
    rss = processes["aggregator"].memory_info().rss / 2**20
    out = done.stdout
    achieved = re.search(r": ([\d.]+)/s \(asked", out)
    lag = re.search(r"current ([\d.]+)s after", out)
    accepted = re.search(r"accepted: (\d+) record updates for (\d+)", out)
    print(
        f"rate {rate:6g}/s  achieved {achieved.group(1) if achieved else '?':>7}/s  "
        f"lag {lag.group(1) + ' s' if lag else 'NOT CAUGHT UP':>9}  "
        f"records {'/'.join(accepted.groups()) if accepted else '?'}  "
        f"aggregator CPU {usage['aggregator']:5.1f}% RSS {rss:5.1f} MB  "
        f"nats-server CPU {usage['nats-server']:5.1f}%  simulator CPU {simulator:5.1f}%  "
        f"(exit {done.returncode})",
        flush=True,
    )
    if done.returncode != 0 and not out:
        print(done.stderr.strip(), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nodes", type=int, default=2000)
    parser.add_argument("--rates", default="200,500,1000")
    parser.add_argument("--duration", type=float, default=20.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as store:
        server = NatsServer(Path(store) / "nats")
        server.start()
        aggregator = subprocess.Popen(
            [
                *(
                    sys.executable,
                    "-m",
                    "actors.cli.fleetctl",
                    "aggregator",
                    "--server",
                    server.url,
                ),
                *("--http-port", "-1", "--log-level", "error"),
            ],
            stdout=subprocess.DEVNULL,
        )
        try:
            asyncio.run(wait_provisioned(server.url))
            assert server.process is not None
            processes = {
                "aggregator": psutil.Process(aggregator.pid),
                "nats-server": psutil.Process(server.process.pid),
            }
            print(
                f"{args.nodes} nodes, {args.duration:g} s per rate, {psutil.cpu_count()} CPUs "
                "shared by nats-server, the aggregator and the simulator",
                flush=True,
            )
            for rate in (float(r) for r in args.rates.split(",")):
                step(server.url, args.nodes, rate, args.duration, processes)
        finally:
            aggregator.terminate()
            try:
                aggregator.wait(10)
            except subprocess.TimeoutExpired:
                aggregator.kill()
                aggregator.wait()
            server.stop()


if __name__ == "__main__":
    main()
