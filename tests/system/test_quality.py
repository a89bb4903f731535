"""The code base stays lint- and type-clean: ruff and mypy --strict run with the tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def test_ruff_is_clean() -> None:
    """ruff check (E, F, W, I, B, UP, ASYNC, RUF) finds nothing."""
    result = subprocess.run(
        [str(BIN / "ruff"), "check", "."], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_strict_is_clean() -> None:
    """mypy --strict (configured in pyproject.toml) finds nothing."""
    result = subprocess.run(
        [sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
