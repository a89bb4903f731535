"""The single-file artifact, built once for the session's system tests that run it
(tests/support/artifact.py), and a fresh Python to run it with."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.artifact import Fresh, build_or_skip, fresh_python


@pytest.fixture(scope="session")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``python -m deploy.build``'s artifact of this checkout and environment."""
    return build_or_skip(tmp_path_factory.mktemp("dist"))


@pytest.fixture(scope="session")
def fresh(tmp_path_factory: pytest.TempPathFactory, artifact: Path) -> Fresh:
    """A new venv's Python without our packages, sharing one extracted artifact."""
    return fresh_python(tmp_path_factory.mktemp("fresh"), artifact)
