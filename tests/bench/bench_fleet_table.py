"""docs/performance.md's rows of the aggregator at fleet size (issue 48) from one command
(a script, not a test): each bench below runs in turn as its own process, exactly as it
runs alone, its output passed through as it comes; at the end the rows of their closing
tables are printed together as one table, each step's minutes and the machine's load
before it beside them (the figures are meant for an idle machine: a load above
:data:`IDLE_LOAD` at a step's start is marked).

1. the same-run ratio at 5,000 nodes of 8 GPUs, five runs (``bench_aggregator.py --fleet``);
2. the fleet-wide jobs' CPU at 100,000 idle nodes (``bench_rounds.py``);
3. the RSS at 100,000 nodes, records loaded (``bench_aggregator.py --memory``);
4. the listings at 100,000 nodes of 8 GPUs, every record current (``bench_listings.py
   --fill``);
5. the same with every record a beat behind its node's latest heartbeat, as between
   checkpoints (``bench_listings.py --fill --behind``);
6. the CPU per heartbeat at 100,000 nodes against 10,000 (``bench_scale.py``).

A step that fails (its exit status not 0, or no closing table) is a row saying so; the
next step runs. Ctrl-C stops the step running and the rest.

Run: ``python tests/bench/bench_fleet_table.py`` (about 2 h 40 min on 2 cores, most of it
nats-server making the 100,000 nodes' command consumers of step 6), ``--quick`` for small
sizes (about 10 minutes: the same code paths, figures not comparable with the targets),
``--steps 1,3`` for some.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
IDLE_LOAD = 0.5
"""The 1-minute load average above which a step's start is marked not idle."""
TABLE_HEAD = re.compile(r"^\| .+ \| target \| measured \|$")


@dataclass(frozen=True)
class Step:
    what: str
    script: str
    args: str
    quick: str
    """The same step's arguments at small sizes (``--quick``)."""


STEPS = (
    Step("same-run ratio", "bench_aggregator.py", "--fleet",
         "--fleet --runs 1 --fleet-nodes 500 --fleet-rate 150 --fleet-duration 20"),
    Step("fleet-wide jobs, idle", "bench_rounds.py", "",
         "--nodes 2000 --window 20 --settle 5"),
    Step("RSS", "bench_aggregator.py", "--memory", "--memory --big-nodes 2000"),
    Step("listings", "bench_listings.py", "--fill --nodes 100000 --kill 300",
         "--fill --nodes 2000 --kill 20 --runs 1 --loads 1"),
    Step("listings, records a beat behind", "bench_listings.py",
         "--fill --behind --nodes 100000 --kill 300",
         "--fill --behind --nodes 2000 --kill 20 --runs 1"),
    Step("CPU per heartbeat against fleet size", "bench_scale.py", "",
         "--sizes 1000,2000 --interval 10 --window 20 --idle 5"),
)  # fmt: skip


def options() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, for a look")
    parser.add_argument(
        "--steps",
        default=",".join(str(n) for n in range(1, len(STEPS) + 1)),
        help=f"which steps, by number (default all: 1 to {len(STEPS)})",
    )
    return parser


def closing_rows(output: list[str]) -> list[str]:
    """The rows of the last table ``output`` printed (after its head and rule)."""
    heads = [i for i, line in enumerate(output) if TABLE_HEAD.match(line)]
    if not heads:
        return []
    return [line for line in output[heads[-1] + 2 :] if line.startswith("| ")]


def run_step(step: Step, quick: bool) -> tuple[list[str], str]:
    """Run ``step`` with its output passed through; its closing rows and a note (its
    minutes, the load before it, a failure)."""
    load = os.getloadavg()[0]
    started = time.monotonic()
    command = [
        sys.executable,
        str(HERE / step.script),
        *(step.quick if quick else step.args).split(),
    ]
    print(f"\n## {step.what}: {' '.join(command[1:])} (load {load:.2f})", flush=True)
    output: list[str] = []
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True, bufsize=1) as process:
        assert process.stdout is not None
        for line in process.stdout:
            sys.stdout.write(line)
            output.append(line.rstrip("\n"))
    minutes = (time.monotonic() - started) / 60
    note = f"{minutes:.0f} min, load {load:.2f} at the start" + (
        "" if load <= IDLE_LOAD else " (not idle)"
    )
    rows = closing_rows(output)
    if process.returncode != 0 or not rows:
        failed = f"| {step.what} | | ✗ failed (exit status {process.returncode}) |"
        return [*rows, failed], note
    return rows, note


def main() -> int:
    args = options().parse_args()
    try:
        chosen = [STEPS[int(n) - 1] for n in args.steps.split(",")]
    except (ValueError, IndexError):
        raise SystemExit(f"--steps: numbers from 1 to {len(STEPS)}, e.g. 1,3") from None
    print(
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {os.cpu_count()} cores"
        + ("; --quick: small sizes, not the targets' figures" if args.quick else ""),
        flush=True,
    )
    table: list[str] = []
    notes: list[str] = []
    try:
        for step in chosen:
            rows, note = run_step(step, args.quick)
            table += rows
            notes.append(f"- {step.what}: {note}")
    except KeyboardInterrupt:
        print("\ninterrupted: the steps done so far", flush=True)
    print("\n| benchmark | target | measured |\n|---|---|---|")
    print("\n".join(table))
    print("\n" + "\n".join(notes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
