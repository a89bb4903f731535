"""The code base stays clean: ruff, mypy --strict and the import contracts run with the tests."""

from __future__ import annotations

import ast
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.python_source import parse_file

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
    """The rooms import one way, actors never import each other, the fleet's wings and the
    aggregator's parts import only those below them, its judge is pure, the views never
    import the aggregator, only the live reader reads fleet_nodes' records raw and the
    node's GPU knowledge imports no node module (pyproject contracts)."""
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "9 kept, 0 broken" in result.stdout


def copy_of_the_code(root: Path) -> None:
    """The packages and the contracts, copied under ``root`` to be broken there."""
    for package in ("actors", "schemas"):
        shutil.copytree(ROOT / package, root / package, ignore=shutil.ignore_patterns("*.pyc"))
    shutil.copy(ROOT / "pyproject.toml", root / "pyproject.toml")


def test_import_contracts_catch_a_forbidden_import(tmp_path: Path) -> None:
    """A node module importing the fleet side breaks the layers contract."""
    copy_of_the_code(tmp_path)
    latency = tmp_path / "actors" / "node" / "latency.py"
    injected = "\nfrom actors.fleet.storage import registry  # noqa\n"
    latency.write_text(latency.read_text() + injected)
    result = lint_imports(tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "actors.node.latency -> actors.fleet.storage.registry" in result.stdout


def test_aggregator_contracts_catch_a_part_calling_up_and_an_impure_judge(tmp_path: Path) -> None:
    """The judge importing the bus breaks the purity contract; the ledger importing
    ownership (a part above it) breaks the parts' layers."""
    copy_of_the_code(tmp_path)
    for module, imported in (
        ("judge", "actors.runtime.bus"),
        ("ledger", "actors.fleet.aggregator.ownership"),
    ):
        path = tmp_path / "actors" / "fleet" / "aggregator" / f"{module}.py"
        path.write_text(path.read_text() + f"\nimport {imported}  # noqa\n")
    result = lint_imports(tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert (
        "The judge is pure: no bus, no KV, no runtime, no other part of the aggregator BROKEN"
        in (" ".join(result.stdout.split()))
    )
    assert "actors.fleet.aggregator.judge -> actors.runtime.bus" in result.stdout
    assert "actors.fleet.aggregator.ledger -> actors.fleet.aggregator.ownership" in result.stdout
    assert "7 kept, 2 broken" in result.stdout


@pytest.mark.parametrize(
    ("module", "line", "contract", "chain"),
    [
        (
            "fleet/storage/registry.py",
            "import actors.fleet.aggregator.hot_state",
            "The fleet's wings import only the wings below them; every module of the fleet is "
            "in one",
            "actors.fleet.storage.registry -> actors.fleet.aggregator.hot_state",
        ),
        (
            "fleet/live/reader.py",
            "import actors.fleet.aggregator.hot_state",
            "The views and the live reader never import the aggregator: they read what it "
            "holds through live.held",
            "actors.fleet.live.reader -> actors.fleet.aggregator.hot_state",
        ),
        (
            "fleet/views/api.py",
            "import actors.fleet.storage.records",
            "Every view and decision reads nodes through actors.fleet.live: only it reads "
            "fleet_nodes' records raw",
            "actors.fleet.views.api -> actors.fleet.storage.records",
        ),
        (
            "fleet/placement/actor.py",
            "from actors.fleet.storage.records import read_records",
            "Every view and decision reads nodes through actors.fleet.live: only it reads "
            "fleet_nodes' records raw",
            "actors.fleet.placement.actor -> actors.fleet.storage.records",
        ),
        (
            "cli/fleetctl/gpus.py",
            "from actors.fleet.storage import records",
            "Every view and decision reads nodes through actors.fleet.live: only it reads "
            "fleet_nodes' records raw",
            "actors.cli.fleetctl.gpus -> actors.fleet.storage.records",
        ),
        (
            "node/gpu/xid.py",
            "import actors.node.config",
            "The node's GPU knowledge is shared, not owned: gpu/ imports no other node module",
            "actors.node.gpu.xid -> actors.node.config",
        ),
        (
            "fleet/aggregator/reads.py",
            "import actors.fleet.aggregator.writes",
            "The aggregator's parts import only the parts below them (actor.py wires them; none "
            "calls back up)",
            "actors.fleet.aggregator.reads -> actors.fleet.aggregator.writes",
        ),
    ],
)
def test_fleet_and_node_contracts_catch_an_import_against_them(
    tmp_path: Path, module: str, line: str, contract: str, chain: str
) -> None:
    """A wing importing one above it, a view importing the aggregator, a view or a
    decision reading fleet_nodes' records raw (not through actors.fleet.live), the GPU
    knowledge importing the node's config and one of the aggregator's parts importing its
    sibling each break their contract, which names the import."""
    copy_of_the_code(tmp_path)
    path = tmp_path / "actors" / module
    path.write_text(path.read_text() + f"\n{line}  # noqa\n")
    result = lint_imports(tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    # Compared without whitespace: lint-imports wraps long contract names anywhere.
    assert "".join(f"{contract} BROKEN".split()) in "".join(result.stdout.split())
    assert chain in result.stdout


def test_a_fleet_module_outside_every_wing_breaks_the_wings_contract(tmp_path: Path) -> None:
    """The fleet's wings are exhaustive: a new module at the fleet's top (or the
    aggregator's) that no layer names is reported, so its place is chosen, not drifted
    into."""
    copy_of_the_code(tmp_path)
    for place in ("fleet", "fleet/aggregator"):
        (tmp_path / "actors" / place / "stray.py").write_text('"""A module in no layer."""\n')
    result = lint_imports(tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    text = " ".join(result.stdout.split())
    assert "actors.fleet.stray" in text and "actors.fleet.aggregator.stray" in text


RESERVED_LOG_KEYS = frozenset(logging.LogRecord("n", 0, "p", 0, "m", None, None).__dict__) | {
    "message",
    "asctime",
}
"""Attributes every LogRecord has: a log call whose ``extra`` names one raises KeyError
(and with it the actor that logged), once its level is enabled."""


def test_no_log_call_overwrites_a_log_record_attribute() -> None:
    """No logging call in actors/ passes ``extra`` with a key a LogRecord already has
    (``created``, ``name``, ...): it would raise only when that level is on, as in
    production, where it crashed an aggregator's command-consumer loop."""
    found = []
    for path in (ROOT / "actors").rglob("*.py"):
        for node in ast.walk(parse_file(path)):
            if not isinstance(node, ast.Call):
                continue
            for keyword in node.keywords:
                if keyword.arg == "extra" and isinstance(keyword.value, ast.Dict):
                    found += [
                        f"{path.relative_to(ROOT)}:{node.lineno}: {key.value}"
                        for key in keyword.value.keys
                        if isinstance(key, ast.Constant) and key.value in RESERVED_LOG_KEYS
                    ]
    assert found == []
