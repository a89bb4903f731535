"""How tests/conftest.py sets the suite up for its parallel workers: the long files are
handed out first, and pytest keeps the test modules it rewrote (docs/testing.md)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from _pytest.assertion.rewrite import PYC_TAIL


def test_long_files_come_first_each_file_in_one_piece(request: pytest.FixtureRequest) -> None:
    """In the collected order the fault round's file comes first, then every file with a
    slow test, then the rest, and no file's tests are split apart."""
    items = request.session.items
    files = [item.path for item in items]
    runs = [path for index, path in enumerate(files) if index == 0 or files[index - 1] != path]
    assert len(runs) == len(set(runs)), "a file's tests are split apart"
    faults = {item.path for item in items if item.get_closest_marker("faults")}
    slow = {item.path for item in items if item.get_closest_marker("slow")} - faults
    ranked = [(0 if path in faults else 1 if path in slow else 2, str(path)) for path in runs]
    ranks = [rank for rank, _ in ranked]
    assert ranks == sorted(ranks), ranked


def test_rewritten_test_modules_are_kept() -> None:
    """Even under PYTHONDONTWRITEBYTECODE, this module's assert-rewritten code was written
    to __pycache__, for the next run's workers to read instead of rewriting it."""
    assert not sys.dont_write_bytecode
    here = Path(__file__)
    cached = here.parent / "__pycache__" / (here.name[:-3] + PYC_TAIL)
    assert cached.is_file(), f"{cached} not written"
