"""The single-file artifact's entry point: the program named first runs with the rest of
the arguments, anything else is its usage, and a Python that cannot load the compiled
modules is told so in one line."""

from __future__ import annotations

import sys
import sysconfig
from pathlib import Path

import pytest

from actors.cli import single_file


def test_the_named_program_gets_the_rest_of_the_arguments(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`fleetctl --version` after the file's name is fleetctl's own answer."""
    with pytest.raises(SystemExit) as stopped:
        single_file.main(["fleetctl", "--version"])
    assert stopped.value.code == 0
    assert capsys.readouterr().out.startswith("fleetctl ")


def test_usage_without_a_program_and_refusal_of_an_unknown_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """No argument or --help: the usage, exit 0; an unknown program: usage and exit 2."""
    assert single_file.main([]) == 0
    assert "{node-agent,fleetctl,install}" in capsys.readouterr().out
    assert single_file.main(["fleet-ctl", "nodes"]) == 2
    assert "error: unknown program 'fleet-ctl'" in capsys.readouterr().err


def test_a_python_that_cannot_load_the_modules_is_told_which_it_needs(tmp_path: Path) -> None:
    """The message names the Python the file was built for and the one running it."""
    (tmp_path / "built-for").write_text("CPython 3.99 on linux-x86_64\n")
    message = single_file.cannot_load(ImportError("no module msgspec._core"), tmp_path)
    here = (
        f"CPython {sys.version_info.major}.{sys.version_info.minor} on {sysconfig.get_platform()}"
    )
    assert message == (
        "cannot load this file's compiled modules (no module msgspec._core): "
        f"built for CPython 3.99 on linux-x86_64, this is {here}"
    )


def test_install_outside_the_artifact_says_where_it_lives(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Run from a checkout or a venv (no install.sh beside the packages): exit 2, one line."""
    assert single_file.install(["--role", "node"], tmp_path) == 2
    assert capsys.readouterr().err == (
        "error: install: only the single-file artifact carries install.sh\n"
    )
