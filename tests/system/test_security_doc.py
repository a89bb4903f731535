"""docs/security.md cannot drift from the suite: every test it names exists, and every
row of its tables names a test or says it has none."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

from tests.support.python_source import parse_file

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "security.md"
REFERENCE = re.compile(r"(?<![\w/.-])(tests/[\w/]+\.py)(?:::(\w+)(?:\[[^\]\s]*\])?)?")
"""A test file under tests/, alone, with ``::test_name``, or with ``::test_name[param-id]``."""
MINIMUM_REFERENCES = 200
"""The document names hundreds of tests: far fewer means the pattern stopped finding them."""


@cache
def defined_tests(path: Path) -> frozenset[str]:
    """The names of the test functions defined anywhere in the file at ``path``."""
    tree = parse_file(path)
    return frozenset(
        node.name
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test")
    )


def broken_references(text: str) -> list[str]:
    """Each reference in ``text`` to a test file that does not exist, or to a test
    function its file does not define."""
    broken = []
    for file, name in REFERENCE.findall(text):
        path = ROOT / file
        if not path.is_file():
            broken.append(file)
        elif name and name not in defined_tests(path):
            broken.append(f"{file}::{name}")
    return broken


def test_every_test_the_security_doc_names_exists() -> None:
    """Every ``FILE::name`` in docs/security.md (FILE under tests/) names a test function
    of that file (a parametrised id counts by its function); every bare FILE exists."""
    text = DOC.read_text()
    assert len(REFERENCE.findall(text)) >= MINIMUM_REFERENCES
    assert broken_references(text) == []


def capability_rows(text: str) -> list[str]:
    """The body rows of the tables whose header has a ``capability`` column."""
    rows: list[str] = []
    header = ""
    for line in text.splitlines():
        if not line.startswith("|"):
            header = ""
        elif not header:
            header = line
        elif "capability" in header and not line.startswith("|---"):
            rows.append(line)
    return rows


def test_every_row_names_a_test_or_says_it_has_none() -> None:
    """Each capability row of the document's tables cites a test or says "no test", so a
    capability cannot be listed unproven without saying so."""
    rows = capability_rows(DOC.read_text())
    assert len(rows) >= 100
    assert [row for row in rows if not REFERENCE.search(row) and "no test" not in row] == []


def test_a_missing_test_or_file_is_told() -> None:
    """The check reads references as the document writes them and names each broken one;
    a parametrised id and a bare file that exist pass."""
    here = "tests/system/test_security_doc.py"
    gone = "tests/system/" + "test_gone.py"  # split, so no doc check reads a missing path here
    text = (
        f"`{here}::test_a_missing_test_or_file_is_told[x-1]`, `{here}`, "
        f"`{here}::test_nothing_like_this`, {gone}::test_x."
    )
    assert broken_references(text) == [f"{here}::test_nothing_like_this", gone]
