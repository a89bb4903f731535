"""The wheel that ``pip install .`` builds ships every module of actors/ and schemas/ (and the
JSON Schemas), and its console scripts run from that installed copy, not from this checkout.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wheel built the way ``pip install .`` builds one, from a copy of the project's files
    (an in-tree build would reuse a stale build/ directory and hide a missing package)."""
    source = tmp_path_factory.mktemp("source")
    for package in ("actors", "schemas"):
        shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("*.pyc"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(source)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (built,) = out.glob("nats_node_agent-*.whl")
    return built


def source_files() -> set[str]:
    """Every file a wheel must carry: each module, py.typed and schemas/json/*.json."""
    found = set()
    for package in ("actors", "schemas"):
        for path in (ROOT / package).rglob("*"):
            if path.suffix in (".py", ".json") or path.name == "py.typed":
                found.add(path.relative_to(ROOT).as_posix())
    return found


@pytest.mark.slow
def test_wheel_ships_every_module(wheel: Path) -> None:
    """Every .py of actors/ and schemas/ (subpackages included) is in the wheel."""
    with zipfile.ZipFile(wheel) as archive:
        shipped = set(archive.namelist())
    assert "actors/node/health/checks.py" in source_files()
    assert source_files() - shipped == set()


@pytest.mark.slow
def test_installed_wheel_runs_both_clis(wheel: Path, tmp_path: Path) -> None:
    """node-agent --help and fleetctl --help run from the installed wheel's own files."""
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "-t", str(target), str(wheel)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    for module, word in (("actors.cli.node_agent", "start"), ("actors.cli.fleetctl", "aggregator")):
        result = subprocess.run(
            [sys.executable, "-m", module, "--help"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0 and word in result.stdout, result.stderr
    where = subprocess.run(
        [sys.executable, "-c", "import actors.node.health.checks as m; print(m.__file__)"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert where.stdout.strip().startswith(str(target)), where.stdout + where.stderr
