"""Benchmark of placement (a script, not collected by pytest): the CPU time of choosing a
node for one replica (:func:`actors.fleet.placement.choose.choose`) and of one reconciler
decision that moves a replica off a stale node, over fleets of synthetic node records
(8 H100s each, one in three cordoned), as ``fleetctl deploy`` and the reconciler pay it.

Run: ``python tests/bench/bench_placement.py [--nodes 1000,10000,100000] [--trials 5]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from actors.fleet.placement.choose import Taken, choose
from actors.fleet.placement.reconcile import Timing, decide
from schemas.messages import NodeRecord
from schemas.placement import Replica
from tests.fleet.test_placement import gpu, node, workload


def fleet(size: int) -> dict[str, NodeRecord]:
    base = node("x", [gpu(index) for index in range(8)])
    return {
        f"n{i:06d}": msgspec.structs.replace(
            base, node_id=f"n{i:06d}", state="active" if i % 3 else "cordoned"
        )
        for i in range(size)
    }


def timed(run: Callable[[], object], trials: int) -> str:
    seconds = []
    for _ in range(trials):
        started = time.process_time()
        run()
        seconds.append(time.process_time() - started)
    return f"median {statistics.median(seconds) * 1000:.1f} ms, max {max(seconds) * 1000:.1f} ms"


def main(sizes: list[int], trials: int) -> None:
    for size in sizes:
        records = fleet(size)
        now = time.time()
        lost = dict(records)
        lost["n000001"] = msgspec.structs.replace(
            records["n000001"], state="stale", stale_since=now - 100
        )
        placed = workload(gpus=2)
        moving = workload(
            gpus=2, replicas=[Replica(index=0, node="n000001", cluster="c1", gpus=[0, 1])]
        )
        one = timed(partial(choose, placed, records, Taken()), trials)
        move = timed(partial(decide, moving, lost, Taken(), now, Timing(grace=10), "me"), trials)
        print(f"{size:>7} nodes: choose one replica: {one}; decide a move: {move}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="1000,10000,100000")
    parser.add_argument("--trials", type=int, default=5)
    args = parser.parse_args()
    main([int(size) for size in args.nodes.split(",")], args.trials)
