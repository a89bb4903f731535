"""Where the suite's CPU goes, per test file: a pytest plugin and its table.

``python -m pytest -q -p tests.cpu_per_file`` has each worker write, for every test file it
ran, the wall time and the CPU seconds spent in the worker itself and in the programs it
ran and waited for (nats-servers, CLIs, agents, Chromium: a child's CPU counts once it is
reaped, which a module's servers are by its last test) to ``CPU_PER_FILE_DIR`` (default
``.cpu-per-file/``), one JSON file a worker. ``python -m tests.cpu_per_file [DIR] [--top
N]`` prints the Markdown table of docs/testing.md from them, heaviest first.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

import pytest

DIR = Path(os.environ.get("CPU_PER_FILE_DIR", ".cpu-per-file"))
Row = list[float]
"""[wall seconds, CPU seconds in the worker, CPU seconds in its reaped children]."""


def _cpu() -> tuple[float, float]:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


class _Files:
    """The file now running in this process and what each file cost so far."""

    def __init__(self) -> None:
        self.rows: dict[str, Row] = {}
        self.runs_tests = True
        """False in pytest-xdist's controller, which only hears of the workers' tests."""
        self.current = ""
        self.began = 0.0
        self.cpu = (0.0, 0.0)

    def switch(self, file: str) -> None:
        """Close the running file's account and open ``file``'s ("" opens none)."""
        now, (own, children) = time.monotonic(), _cpu()
        if self.current:
            row = self.rows.setdefault(self.current, [0.0, 0.0, 0.0])
            row[0] += now - self.began
            row[1] += own - self.cpu[0]
            row[2] += children - self.cpu[1]
        self.current, self.began, self.cpu = file, now, (own, children)


_FILES = _Files()


def pytest_configure(config: pytest.Config) -> None:
    """Count in this process only if it runs the tests (a worker, or no workers)."""
    workers = config.getoption("numprocesses", default=None)
    _FILES.runs_tests = "PYTEST_XDIST_WORKER" in os.environ or not workers


def pytest_runtest_logstart(nodeid: str, location: tuple[str, int | None, str]) -> None:
    """A test starts: a new file's account opens when its first test does."""
    file = nodeid.split("::", 1)[0]
    if _FILES.runs_tests and file != _FILES.current:
        _FILES.switch(file)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Write this process's rows (a worker's, or the only process's)."""
    _FILES.switch("")
    if not _FILES.rows:
        return
    DIR.mkdir(parents=True, exist_ok=True)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    (DIR / f"{worker}.json").write_text(json.dumps(_FILES.rows))


def table(directory: Path, top: int) -> str:
    """The Markdown table of the ``top`` files with the most CPU, and the totals."""
    rows: dict[str, Row] = {}
    for path in sorted(directory.glob("*.json")):
        rows.update(json.loads(path.read_text()))
    lines = [
        "| file | wall (s) | CPU in the worker (s) | CPU in its programs (s) |",
        "|---|---:|---:|---:|",
    ]
    for name, (wall, own, children) in sorted(rows.items(), key=lambda i: -(i[1][1] + i[1][2]))[
        :top
    ]:
        lines.append(f"| {name} | {wall:.1f} | {own:.1f} | {children:.1f} |")
    totals = [sum(row[i] for row in rows.values()) for i in range(3)]
    lines.append(f"| all {len(rows)} files | {totals[0]:.0f} | {totals[1]:.0f} | {totals[2]:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.cpu_per_file", description=__doc__)
    parser.add_argument("directory", nargs="?", type=Path, default=DIR)
    parser.add_argument("--top", type=int, default=20, help="rows to print (default 20)")
    args = parser.parse_args(argv)
    if not any(args.directory.glob("*.json")):
        sys.stderr.write(
            f"error: no report in {args.directory} (run pytest -p tests.cpu_per_file)\n"
        )
        return 1
    sys.stdout.write(table(args.directory, args.top) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
