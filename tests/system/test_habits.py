"""The habits of the repository hold: the changelog's newest version is the package's,
every path a doc or docstring names exists, commit subjects stay short, and the commit
hooks run this checkout's own tools."""

from __future__ import annotations

import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

import pytest

from schemas.version import AGENT_VERSION
from tests.commit_msg import SCISSORS, problems

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
RELEASE = re.compile(r"^## \[(\d+\.\d+\.\d+)\] - (\d{4}-\d{2}-\d{2})$", re.M)
PATH = re.compile(r"(?<![\w/.-])((?:actors|schemas|tests|deploy|docs)/[\w./-]*\w)")
"""A repository path as docs and docstrings write it (``actors/fleet/process.py``)."""


def test_the_changelogs_newest_version_is_the_package_version() -> None:
    """CHANGELOG.md opens with [Unreleased], then versions newest first, each dated; the
    newest is pyproject's version, which both programs' --version print and every
    heartbeat, /status and the build-info metric carry (AGENT_VERSION)."""
    text = (ROOT / "CHANGELOG.md").read_text()
    assert text.index("## [Unreleased]") < text.index("## [0.")
    releases = RELEASE.findall(text)
    numbers = [tuple(int(part) for part in number.split(".")) for number, _ in releases]
    assert numbers == sorted(numbers, reverse=True) and len(set(numbers)) == len(numbers)
    dates = [date for _, date in releases]
    assert dates == sorted(dates, reverse=True)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    installed = importlib.metadata.version("nats-node-agent")
    assert releases[0][0] == project["version"] == installed == AGENT_VERSION


def named_paths(text: str) -> set[str]:
    """The repository paths ``text`` names, wildcards and placeholders left out."""
    return {
        match.rstrip(".") for match in PATH.findall(text) if "*" not in match and "<" not in match
    }


def documents() -> list[Path]:
    """The docs, the deploy files and the code whose docstrings and comments name paths.
    CHANGELOG.md is history: it names paths as they were."""
    code = [
        path
        for folder in ("actors", "schemas", "tests")
        for path in (ROOT / folder).rglob("*.py")
        if "__pycache__" not in path.parts
    ]
    deploy = [path for path in (ROOT / "deploy").rglob("*") if path.is_file()]
    return [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *(ROOT / "docs").glob("*.md")] + (
        deploy + code
    )


def test_every_path_a_doc_or_docstring_names_exists() -> None:
    """Every actors/, schemas/, tests/, deploy/ or docs/ path named in the README,
    CONTRIBUTING.md, docs/, deploy/ or the code exists: a move that leaves a doc behind
    fails here."""
    missing = {
        f"{path.relative_to(ROOT)}: {named}"
        for path in documents()
        for named in named_paths(path.read_text(errors="replace"))
        if not (ROOT / named).exists()
    }
    assert not missing, sorted(missing)


def test_the_path_check_finds_a_path_that_does_not_exist() -> None:
    """The check reads paths as the docs write them, and a missing one is told."""
    missing = "docs/" + "none.md"  # split, so this file names no missing path itself
    text = f"see `actors/fleet/process.py`, actors/fleet/aggregator/judge.py and {missing}."
    found = named_paths(text)
    assert found == {"actors/fleet/process.py", "actors/fleet/aggregator/judge.py", missing}
    assert [named for named in sorted(found) if not (ROOT / named).exists()] == [missing]


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        ("Short subject\n\nThe detail.\n", []),
        ("x" * 71 + "\n", []),
        ("x" * 72 + "\n", ["the subject line is 72 characters"]),
        ("Subject\nbody at once\n", ["a blank line goes between"]),
        ("# only a comment\n\n", ["the message is empty"]),
        (f"Subject\n\nbody\n{SCISSORS}\n" + "y" * 200 + "\n", []),
        ("# git's help first\nSubject\n\nbody\n", []),
    ],
)
def test_commit_subjects_stay_under_72_characters(message: str, expected: list[str]) -> None:
    """The commit-msg hook refuses a subject of 72 characters or more, a body right under
    the subject and an empty message; comments and the diff below the scissors line are
    not the message."""
    found = problems(message)
    assert len(found) == len(expected)
    for problem, start in zip(found, expected, strict=True):
        assert problem.startswith(start)


def test_the_commit_hooks_run_this_checkouts_own_tools() -> None:
    """.pre-commit-config.yaml has local hooks only, each run by the system (the venv),
    for ruff, ruff format, mypy, the import contracts and the commit subject; each tool
    is installed beside this Python."""
    text = (ROOT / ".pre-commit-config.yaml").read_text()
    assert re.findall(r"^\s*- repo: (\S+)$", text, re.M) == ["local"]
    languages = re.findall(r"^\s*language: (\S+)$", text, re.M)
    entries = re.findall(r"^\s*entry: (.+)$", text, re.M)
    assert languages == ["system"] * len(entries)
    assert [entry.split()[:2] for entry in entries] == [
        ["ruff", "check"],
        ["ruff", "format"],
        ["mypy"],
        ["lint-imports"],
        ["python", "-m"],
    ]
    for tool in ("ruff", "mypy", "lint-imports"):
        assert (BIN / tool).exists(), tool
    assert "stages: [commit-msg]" in text and entries[-1] == "python -m tests.commit_msg"
