"""The test modules' rewritten asserts, written once a run before the workers start.

pytest rewrites a test module's asserts (to explain a failure) when it imports it, and
keeps the result in ``__pycache__``, checked by the source's hash, so a fresh clone's new
mtimes do not spoil it. On a fresh clone every worker found no cache and rewrote every
module of the run itself: six workers, each about 7 s of CPU before its first test, all
at once on two cores. :func:`write_rewritten` writes that cache from the controller, on
every core, and the workers only read it. Modules whose cache is current are skipped.

It uses pytest's own rewrite (private functions of ``_pytest.assertion.rewrite``): where a
pytest lacks them, it writes nothing and the workers rewrite as they always did.
"""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

PYTEST_FUNCTIONS = (
    "assertstate_key",
    "get_cache_dir",
    "PYC_TAIL",
    "try_makedirs",
    "_read_pyc",
    "_rewrite_test",
    "_write_pyc",
)
"""What :func:`_rewrite` uses of ``_pytest.assertion.rewrite``."""

_config: pytest.Config | None = None
"""The run's config, for the forked processes (set before they fork)."""


def modules_to_rewrite(config: pytest.Config) -> list[Path]:
    """The modules pytest will rewrite in this run: every ``test_*.py`` and
    ``conftest.py`` under the run's arguments (a file, a folder, a node id)."""
    found: set[Path] = set()
    for arg in config.args:
        path = Path(config.rootpath, arg.split("::", 1)[0])
        if path.is_file() and path.suffix == ".py":
            found.add(path)
        elif path.is_dir():
            found.update(path.rglob("test_*.py"))
            found.update(path.rglob("conftest.py"))
    return sorted(found)


def _rewrite(path: Path) -> bool:
    """Write ``path``'s rewritten module to pytest's cache unless it is current there;
    True if it wrote it. Runs in a forked process."""
    from _pytest.assertion import rewrite

    assert _config is not None
    state = _config.stash[rewrite.assertstate_key]
    pyc = rewrite.get_cache_dir(path) / (path.name[:-3] + rewrite.PYC_TAIL)
    if rewrite._read_pyc(path, pyc, state.trace) is not None:
        return False
    if not rewrite.try_makedirs(pyc.parent):
        return False
    source_hash, code = rewrite._rewrite_test(path, _config)
    return rewrite._write_pyc(state, code, source_hash, pyc)


def write_rewritten(config: pytest.Config) -> int:
    """Rewrite this run's test modules into pytest's cache, one process per core; the
    number written. Nothing where pytest's private rewrite functions are missing or
    assertion rewriting is off."""
    global _config
    try:
        from _pytest.assertion import rewrite
    except ImportError:
        return 0
    if not all(hasattr(rewrite, name) for name in PYTEST_FUNCTIONS):
        return 0
    if config.getoption("assertmode") != "rewrite" or rewrite.assertstate_key not in config.stash:
        return 0
    modules = modules_to_rewrite(config)
    _config = config
    try:
        fork = multiprocessing.get_context("fork")
        with ProcessPoolExecutor(max_workers=os.cpu_count() or 1, mp_context=fork) as pool:
            return sum(pool.map(_rewrite, modules, chunksize=8))
    finally:
        _config = None
