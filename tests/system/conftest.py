"""The single-file artifact, built once for the run's system tests that run it
(tests/support/artifact.py), and a fresh Python to run it with."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.artifact import Fresh, built_once, fresh_python


@pytest.fixture(scope="session")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``python -m deploy.build``'s artifact of this checkout and environment, one for the
    whole run: a worker's base temp's parent is the run's (pytest-N), a single process's
    base temp is."""
    base = tmp_path_factory.getbasetemp()
    return built_once(base.parent if "PYTEST_XDIST_WORKER" in os.environ else base)


@pytest.fixture(scope="session")
def fresh(tmp_path_factory: pytest.TempPathFactory, artifact: Path) -> Fresh:
    """A new venv's Python without our packages, sharing one extracted artifact."""
    return fresh_python(tmp_path_factory.mktemp("fresh"), artifact)
