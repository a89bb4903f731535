"""How tests/conftest.py sets the suite up for its parallel workers: the long files are
handed out first, and pytest keeps the test modules it rewrote, rewritten once a run
before the workers start (docs/testing.md)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from _pytest.assertion.rewrite import PYC_TAIL

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[2]

WRITING_CONFTEST = """
import pytest

from tests.support import assert_cache

WRITTEN = pytest.StashKey[int]()


def pytest_configure(config):
    config.stash[WRITTEN] = assert_cache.write_rewritten(config)


def pytest_report_header(config):
    return f"rewritten: {config.stash[WRITTEN]}"
"""
"""A run's conftest calling assert_cache as tests/conftest.py does, saying what it wrote."""


def test_long_files_come_first_each_beside_a_short_one(request: pytest.FixtureRequest) -> None:
    """In the collected order the fault round's file comes first, then each file with a
    slow test followed by one without, until one kind runs out; no file's tests are split
    apart."""
    items = request.session.items
    files = [item.path for item in items]
    runs = [path for index, path in enumerate(files) if index == 0 or files[index - 1] != path]
    assert len(runs) == len(set(runs)), "a file's tests are split apart"
    faults = {item.path for item in items if item.get_closest_marker("faults")}
    slow = {item.path for item in items if item.get_closest_marker("slow")} - faults
    kinds = ["faults" if path in faults else "slow" if path in slow else "rest" for path in runs]
    first = len(faults)
    pairs = min(kinds.count("slow"), kinds.count("rest"))
    left = "slow" if kinds.count("slow") > pairs else "rest"
    expected = ["faults"] * first + ["slow", "rest"] * pairs
    expected += [left] * (len(kinds) - len(expected))
    assert kinds == expected, list(zip(kinds, map(str, runs), strict=True))


def test_the_controller_writes_the_rewritten_modules(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """assert_cache.write_rewritten, called where tests/conftest.py calls it (a run's
    pytest_configure), writes every test module of the run (conftest.py included, other
    modules not) to pytest's cache as pytest would rewrite it, and the tests pass reading
    it; the next run finds them current and writes none."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    pytester.makeconftest(WRITING_CONFTEST)
    pytester.makepyfile(test_one="def test_one():\n    assert 1 + 1 == 2\n", helper="X = 1\n")
    first = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    first.assert_outcomes(passed=1)
    first.stdout.fnmatch_lines(["rewritten: 2"])
    cache = pytester.path / "__pycache__"
    assert sorted(path.name for path in cache.glob(f"*{PYC_TAIL}")) == [
        f"conftest{PYC_TAIL}",
        f"test_one{PYC_TAIL}",
    ]
    again = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    again.assert_outcomes(passed=1)
    again.stdout.fnmatch_lines(["rewritten: 0"])


def test_rewritten_test_modules_are_kept() -> None:
    """Even under PYTHONDONTWRITEBYTECODE, this module's assert-rewritten code was written
    to __pycache__, for the next run's workers to read instead of rewriting it."""
    assert not sys.dont_write_bytecode
    here = Path(__file__)
    cached = here.parent / "__pycache__" / (here.name[:-3] + PYC_TAIL)
    assert cached.is_file(), f"{cached} not written"
