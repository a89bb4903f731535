"""The code base stays clean: ruff, mypy --strict and the import contracts run with the tests."""

from __future__ import annotations

import os
import shutil
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


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    """lint-imports with the contracts of ``root``/pyproject.toml over ``root``'s packages."""
    return subprocess.run(
        [str(BIN / "lint-imports"), "--no-cache"],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_import_contracts_are_kept() -> None:
    """The rooms import one way and actors never import each other (pyproject contracts)."""
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "3 kept, 0 broken" in result.stdout


def test_import_contracts_catch_a_forbidden_import(tmp_path: Path) -> None:
    """A node module importing the fleet side breaks the layers contract."""
    for package in ("actors", "schemas"):
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("*.pyc"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    latency = tmp_path / "actors" / "node" / "latency.py"
    latency.write_text(latency.read_text() + "\nfrom actors.fleet import registry  # noqa\n")
    result = lint_imports(tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "actors.node.latency -> actors.fleet.registry" in result.stdout
