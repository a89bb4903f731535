"""The quick loop: lint, formatting, types, the import contracts and the tests that start
no server, no browser and no program (tests/conftest.py marks those), in under a minute
on 2 cores once mypy's cache is warm. ``python -m tests.quick`` runs every step at once
(they are independent, and the static checks and the unit tests each keep a core busy),
prints each one's result as it ends and the output of those that failed, and exits with
the first failure's status; ``python -m pytest`` runs everything (CONTRIBUTING.md)."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
QUICK_TESTS = "not server and not browser and not programs"
UNIT_WORKERS = 2
"""The unit tests compute rather than wait: one worker a core (the suite's workers each
collect it all first: the quick loop took 54 s of CPU with six, 39 s with two)."""
STEPS: list[tuple[str, list[str]]] = [
    ("ruff", [str(BIN / "ruff"), "check", "."]),
    ("ruff format", [str(BIN / "ruff"), "format", "--check", "."]),
    ("mypy", [sys.executable, "-m", "mypy"]),
    ("import contracts", [str(BIN / "lint-imports")]),
    (
        "unit tests",
        [sys.executable, "-m", "pytest", "-q", "-n", str(UNIT_WORKERS), "-m", QUICK_TESTS],
    ),
]


def main() -> int:
    """Start every step, wait for all; the first failed step's status (in STEPS' order),
    else 0."""
    started = time.monotonic()
    running: list[tuple[str, subprocess.Popen[bytes], IO[bytes]]] = []
    for name, command in STEPS:
        log = tempfile.TemporaryFile()
        process = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        running.append((name, process, log))
    failed = 0
    for name, process, output in running:
        status = process.wait()
        took = time.monotonic() - started
        if status == 0:
            sys.stdout.write(f"quick: {name} ok ({took:.1f}s)\n")
            continue
        output.seek(0)
        sys.stdout.write(output.read().decode(errors="replace"))
        sys.stdout.write(f"quick: {name} failed ({took:.1f}s)\n")
        failed = failed or status
    sys.stdout.flush()
    verdict = "failed" if failed else "all ok"
    sys.stdout.write(f"quick: {verdict} in {time.monotonic() - started:.1f}s\n")
    return failed


if __name__ == "__main__":
    sys.exit(main())
