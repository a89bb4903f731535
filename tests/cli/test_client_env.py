"""Every documented ``FLEETCTL_*`` variable is known to every fleetctl subcommand."""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from actors.cli.common import CLIENT_ENV_PREFIX, ClientConfig, operator_key_file, settings_from
from actors.cli.fleetctl import main as fleetctl

ROOT = Path(__file__).resolve().parents[2]


def documented_variables() -> set[str]:
    """The FLEETCTL_ variables README.md and docs/*.md name (``FLEETCTL_<FIELD>`` stands
    for every setting of ClientConfig)."""
    texts = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    found = set()
    for path in texts:
        found |= set(re.findall(r"FLEETCTL_[A-Z_]*[A-Z]", path.read_text()))
    return found


def leaves(
    parser: argparse.ArgumentParser, path: str = ""
) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """Every subcommand parser that runs something, with its name."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield path, parser
    for action in subs:
        for name, sub in action.choices.items():
            yield from leaves(sub, f"{path} {name}".strip())


def defaults(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """The namespace a subcommand gets when no optional flag is given."""
    return argparse.Namespace(
        **{a.dest: a.default for a in parser._actions if a.dest != argparse.SUPPRESS}
    )


def test_the_documented_variables_are_client_settings() -> None:
    """Each FLEETCTL_ variable the docs name is a setting fleetctl reads (KEY_FILE included)."""
    settings = {
        f"{CLIENT_ENV_PREFIX}{f.name.upper()}" for f in msgspec.structs.fields(ClientConfig)
    }
    documented = documented_variables()
    assert "FLEETCTL_KEY_FILE" in documented
    assert documented <= settings, documented - settings


def every_variable(tmp_path: Path) -> dict[str, str]:
    return {
        f"{CLIENT_ENV_PREFIX}{f.name.upper()}": (
            str(tmp_path / "op.nk")
            if f.name == "key_file"
            else "nats://127.0.0.1:4999"
            if f.name == "server"
            else ""
        )
        for f in msgspec.structs.fields(ClientConfig)
    }


@pytest.mark.parametrize("name", [name for name, _ in leaves(fleetctl.parser())])
def test_every_subcommand_takes_every_variable(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With every FLEETCTL_ variable set, each subcommand's settings load (no 'unknown
    environment variable') and a command that signs uses FLEETCTL_KEY_FILE's key."""
    for variable, value in every_variable(tmp_path).items():
        monkeypatch.setenv(variable, value)
    parser = dict(leaves(fleetctl.parser()))[name]
    args = defaults(parser)
    if "prefix" not in vars(args) or "config" not in vars(args):
        # config set-context takes a context's values (--prefix too) but connects nowhere.
        pytest.skip(f"fleetctl {name} does not connect as a client")
    config = settings_from(args, ClientConfig, CLIENT_ENV_PREFIX)
    assert config.server == "nats://127.0.0.1:4999"
    if "key_file" in vars(args):
        assert operator_key_file(args) == tmp_path / "op.nk"
