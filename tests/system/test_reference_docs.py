"""The reference tables of docs/ are the code's: settings and metrics tables match what
``python -m actors.cli.reference`` writes, each setting once, and the README states no
test count that drifts."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from actors.cli import reference
from actors.node.config import AgentConfig

README = Path(__file__).parents[2] / "README.md"


@pytest.mark.parametrize("path", [reference.SETTINGS_DOC, reference.METRICS_DOC], ids=str)
def test_tables_match_the_code(path: Path) -> None:
    """docs/settings.md and docs/metrics.md hold exactly the generated tables; run
    ``python -m actors.cli.reference`` if this fails."""
    text = path.read_text()
    assert reference.with_tables(text, reference.tables()) == text


def test_every_table_has_its_markers() -> None:
    """Each generated table has its place in a docs file (a renamed marker would leave a
    table unwritten and this drift test blind)."""
    text = reference.SETTINGS_DOC.read_text() + reference.METRICS_DOC.read_text()
    for name, table in reference.tables().items():
        assert f"<!-- {name}:start" in text and table in text, name


def test_each_setting_is_listed_once_with_one_default() -> None:
    """The agent's table lists heartbeat_interval, fake_gpus and shutdown_timeout (listed
    twice with conflicting defaults by the old hand-written table) once each."""
    text = reference.SETTINGS_DOC.read_text()
    rows = re.findall(r"^\| `(\w+)` \| `--", text.split("## fleetctl aggregator")[0], re.M)
    assert len(rows) == len(set(rows)) == len(AgentConfig.__struct_fields__)
    for name, default in (("heartbeat_interval", "10s"), ("shutdown_timeout", "30s")):
        flag, env = name.replace("_", "-"), f"NODE_AGENT_{name.upper()}"
        assert f"| `{name}` | `--{flag}` | `{env}` | `{default}` |" in text


def test_a_changed_docstring_is_drift() -> None:
    """A table that no longer says what the code says is rewritten (the check can fail)."""
    text = reference.SETTINGS_DOC.read_text()
    stale = text.replace("Seconds between two heartbeats", "Seconds between heartbeats", 1)
    assert stale != text
    assert reference.with_tables(stale, reference.tables()) == text


def test_markdown_cells_are_escaped() -> None:
    """A pipe never splits a cell; < and * outside code spans stay literal."""
    assert reference._cell("a|b <x> *y* `<z>*`") == "a\\|b &lt;x> \\*y\\* `<z>*`"


def test_readme_states_no_test_count() -> None:
    """The README does not claim a number of tests (it said about 230 for 703)."""
    assert not re.search(r"\d+ tests", README.read_text())
