"""The per-file wall-clock table of docs/testing.md, from JUnit XML reports of the suite:
``python -m tests.timings IDLE.xml [BUSY.xml] [--top N]`` prints a Markdown table of the
files taking longest (each file's tests summed, as one process ran them), and the totals.
Make a report with ``python -m pytest -q --junitxml=IDLE.xml`` (and under ``python -m
tests.busy --runs 1 --junitxml=BUSY.xml`` for the busy column)."""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path


def per_file(report: Path) -> tuple[dict[str, float], Counter[str]]:
    """Seconds and test count of each test file in ``report``."""
    seconds: dict[str, float] = {}
    tests: Counter[str] = Counter()
    for case in ET.parse(report).getroot().iter("testcase"):
        name = case.get("classname", "").replace(".", "/") + ".py"
        seconds[name] = seconds.get(name, 0.0) + float(case.get("time", "0"))
        tests[name] += 1
    return seconds, tests


def table(idle: Path, busy: Path | None, top: int) -> str:
    """The Markdown table: the ``top`` slowest files idle, their time busy beside."""
    seconds, tests = per_file(idle)
    loaded = per_file(busy)[0] if busy else {}
    rows = ["| file | tests | idle (s) | one core busy (s) |", "|---|---:|---:|---:|"]
    for name, took in sorted(seconds.items(), key=lambda item: -item[1])[:top]:
        other = f"{loaded[name]:.1f}" if name in loaded else "-"
        rows.append(f"| {name} | {tests[name]} | {took:.1f} | {other} |")
    other = f"{sum(loaded.values()):.0f}" if busy else "-"
    rows.append(
        f"| all {len(seconds)} files | {sum(tests.values())} | {sum(seconds.values()):.0f} "
        f"| {other} |"
    )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.timings", description=__doc__)
    parser.add_argument("idle", type=Path, help="JUnit XML of a run on an idle machine")
    parser.add_argument("busy", type=Path, nargs="?", help="JUnit XML of a run with a core busy")
    parser.add_argument("--top", type=int, default=40, help="files listed (default 40)")
    args = parser.parse_args(argv)
    sys.stdout.write(table(args.idle, args.busy, args.top) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
