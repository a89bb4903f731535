"""The quick loop: lint, formatting, types, the import contracts and the tests that start
no server, no browser and no program (tests/conftest.py marks those), in under a minute
on 2 cores once mypy's cache is warm. ``python -m tests.quick`` runs it and stops at the
first step that fails; ``python -m pytest`` runs everything (CONTRIBUTING.md)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
QUICK_TESTS = "not server and not browser and not programs"
UNIT_WORKERS = 2
"""The unit tests compute rather than wait: one worker a core (the suite's six workers each
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
    """Run every step in order; the first failure's status, else 0."""
    started = time.monotonic()
    for name, command in STEPS:
        began = time.monotonic()
        result = subprocess.run(command, cwd=ROOT, check=False)
        took = time.monotonic() - began
        if result.returncode != 0:
            sys.stderr.write(f"quick: {name} failed ({took:.1f}s)\n")
            return result.returncode
        sys.stdout.write(f"quick: {name} ok ({took:.1f}s)\n")
    sys.stdout.write(f"quick: all ok in {time.monotonic() - started:.1f}s\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
