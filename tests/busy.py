"""The suite on a busy machine: ``python -m tests.busy [--runs N] [PYTEST ARGS...]`` keeps
one core busy with a burner process (a Python loop that never sleeps) and runs the README's
test command (``python -m pytest -q``, pyproject's addopts included) under it, N times in a
row (default 3), printing each run's wall time; it stops at the first run that fails and
returns its status. A test that passes idle and fails here waits for time, not for its
condition (docs/testing.md)."""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BURNER = "while True: pass"


def run_busy(pytest_args: list[str]) -> tuple[int, float]:
    """One run of the suite beside a burner; its exit status and wall time."""
    burner = subprocess.Popen([sys.executable, "-c", BURNER])
    try:
        began = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", *pytest_args], cwd=ROOT, check=False
        )
        return done.returncode, time.monotonic() - began
    finally:
        burner.kill()
        burner.wait()


def main(argv: list[str] | None = None) -> int:
    """Run the suite ``--runs`` times with a core busy; the first failure's status, else 0."""
    parser = argparse.ArgumentParser(prog="python -m tests.busy", description=__doc__)
    parser.add_argument("--runs", type=int, default=3, help="runs in a row (default 3)")
    args, pytest_args = parser.parse_known_args(argv)
    for run in range(1, args.runs + 1):
        code, took = run_busy(pytest_args)
        verdict = "passed" if code == 0 else f"failed ({code})"
        sys.stdout.write(f"busy: run {run} of {args.runs} {verdict} in {took / 60:.1f} min\n")
        if code != 0:
            return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
