"""Footprint benchmark: RSS and CPU of one node agent with every actor on.

A node agent shares its machine with GPU jobs, so it must stay small: target RSS <= 60 MB
and <= 0.3 CPU-seconds per minute. This starts a nats-server and an aggregator here, one
``node-agent start --fake-gpus 8`` as a child process with default intervals, lets it warm
up, then measures the child with psutil. Not a pytest test (timing targets are checked by
benchmarks that print figures)::

    python tests/bench/bench_footprint.py [--seconds 60]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # for tests.support

from actors.fleet.storage.records import read_record
from actors.fleet.storage.registry import NotFound, approve
from actors.runtime.bus import NatsBus
from actors.runtime.embedded import NatsServer
from actors.runtime.supervisor import Supervisor
from schemas import signing
from schemas.subjects import Subjects
from tests.support.fleet import new_aggregator

RSS_TARGET_MB = 60.0
CPU_TARGET_S_PER_MIN = 0.3
WARM_UP_S = 10.0
NODE = "bench"


async def last_seq(bus: NatsBus, subjects: Subjects) -> int:
    try:
        return (await read_record(bus, subjects, NODE)).last_seq
    except NotFound:
        return 0


async def bench(seconds: float, work: Path) -> bool:
    server = NatsServer(work / "nats")
    server.start()
    bus = await NatsBus.connect(server.url, "bench")
    subjects = Subjects()
    aggregator = Supervisor([new_aggregator(bus, subjects.prefix)])
    aggregator.start()
    child: asyncio.subprocess.Process | None = None
    try:
        if not await aggregator.wait_ready(15):
            raise SystemExit("aggregator did not start")
        key_file = work / "node.nk"
        key = signing.load_or_create_key_file(key_file)
        await approve(bus, subjects, NODE, key.public_key, by="bench")
        agent = Path(sys.executable).parent / "node-agent"
        command = [
            str(agent), "start", "--server", server.url, "--node-id", NODE, "--cluster", "bench",
            "--state-dir", str(work / "state"), "--key-file", str(key_file),
            "--fake-gpus", "8", "--http-port", "0",
        ]  # fmt: skip
        with (work / "agent.log").open("wb") as log_file:
            child = await asyncio.create_subprocess_exec(
                *command, stdout=log_file, stderr=asyncio.subprocess.STDOUT
            )
        process = psutil.Process(child.pid)
        await asyncio.sleep(WARM_UP_S)  # imports and first samples are start-up, not steady state
        if child.returncode is not None:
            raise SystemExit(f"agent exited early; see {work / 'agent.log'}")
        seq_start = await last_seq(bus, subjects)
        cpu_start = sum(process.cpu_times()[:2])
        started = time.monotonic()
        peak_rss = 0
        while time.monotonic() - started < seconds:
            await asyncio.sleep(1.0)
            peak_rss = max(peak_rss, process.memory_info().rss)
        elapsed = time.monotonic() - started
        cpu = sum(process.cpu_times()[:2]) - cpu_start
        rss_mb = process.memory_info().rss / 2**20
        seq_end = await last_seq(bus, subjects)
    finally:
        if child is not None:
            if child.returncode is None:
                child.terminate()
            try:
                await asyncio.wait_for(child.wait(), 15)
            except TimeoutError:
                child.kill()
                await child.wait()
        await aggregator.stop()
        await bus.close()
        server.stop()

    troubles = [
        line
        for line in (work / "agent.log").read_text().splitlines()
        if '"level": "error"' in line or '"level": "warning"' in line
    ]
    cpu_per_min = cpu / elapsed * 60
    rss_ok = rss_mb <= RSS_TARGET_MB
    cpu_ok = cpu_per_min <= CPU_TARGET_S_PER_MIN
    print(
        f"measured {elapsed:.0f}s after {WARM_UP_S:.0f}s warm-up; "
        f"heartbeats {seq_start}->{seq_end}; agent log warnings/errors: {len(troubles)}"
    )
    for line in troubles[:5]:
        print(f"  {line}")
    print(
        f"RSS {rss_mb:.1f} MB (peak {peak_rss / 2**20:.1f} MB, target <= {RSS_TARGET_MB:g}): "
        f"{'PASS' if rss_ok else 'FAIL'}"
    )
    print(
        f"CPU {cpu_per_min:.3f} s/min (target <= {CPU_TARGET_S_PER_MIN:g}): "
        f"{'PASS' if cpu_ok else 'FAIL'}"
    )
    return rss_ok and cpu_ok and seq_end > seq_start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--seconds", type=float, default=60.0, help="measurement time (>= 60)")
    args = parser.parse_args()
    # The benchmark's own client says "disconnected" as the server stops; not a finding.
    logging.basicConfig(level=logging.ERROR)
    with tempfile.TemporaryDirectory(prefix="bench-footprint-") as work:
        return 0 if asyncio.run(bench(args.seconds, Path(work))) else 1


if __name__ == "__main__":
    sys.exit(main())
