"""Every flag of every subcommand of both CLIs explains itself in --help: what it means
and, where it has one, its default; the settings' help is their own docstring."""

from __future__ import annotations

import argparse
import re

import msgspec
import pytest

from actors.cli import node_agent
from actors.cli.common import SINGULAR_FLAGS, ClientConfig
from actors.cli.fleetctl import main as fleetctl
from actors.cli.fleetctl.aggregator import aggregator_settings
from actors.fleet.config import AggregatorConfig
from actors.node.config import AgentConfig
from actors.runtime import config_docs
from tests.cli.test_keys_help import parsers, run

ENV_ONLY = re.compile(r"\(?\benv [A-Z_]+\)?;?")
SETTINGS = [AgentConfig, AggregatorConfig, ClientConfig]


def flags(root: argparse.ArgumentParser) -> list[tuple[str, argparse.Action]]:
    """Every optional argument shown in --help, with its command line."""
    return [
        (f"{path} {action.option_strings[-1]}", action)
        for path, parser in parsers(root, root.prog)
        for action in parser._actions
        if action.option_strings
        and action.help != argparse.SUPPRESS
        and not isinstance(action, argparse._HelpAction | argparse._VersionAction)
    ]


@pytest.mark.parametrize("root", [fleetctl.parser(), node_agent.parser()], ids=lambda p: p.prog)
def test_every_flag_says_what_it_means_and_its_default(root: argparse.ArgumentParser) -> None:
    """No flag's help is only ``(env X)``: its meaning is at least three words, and a flag
    with a default (not a switch) names it."""
    missing = []
    for where, action in flags(root):
        text = ENV_ONLY.sub("", action.help or "")
        if len(text.split()) < 3:
            missing.append(f"{where}: {action.help!r}")
        switch = isinstance(action, argparse._StoreTrueAction | argparse._AppendAction)
        if action.default not in (None, False, "") and not switch and "default" not in text.lower():
            missing.append(f"{where}: no default in {action.help!r}")
    assert not missing, "\n".join(missing)


@pytest.mark.parametrize("config_type", SETTINGS, ids=lambda c: c.__name__)
def test_every_setting_has_a_docstring(config_type: type[msgspec.Struct]) -> None:
    """Each setting's meaning is written once, under the field; help and docs read it."""
    docs = config_docs.setting_docs(config_type)
    undocumented = [f.name for f in msgspec.structs.fields(config_type) if f.name not in docs]
    assert not undocumented


def test_setting_help_is_the_docstring_and_the_default() -> None:
    """--help of a setting shows its docstring's first sentence, default and variable."""
    start = dict(parsers(node_agent.parser(), "node-agent"))["node-agent start"]
    [action] = [a for a in start._actions if a.dest == "heartbeat_interval"]
    assert action.help == (
        "Seconds between two heartbeats (each jittered by up to 10 %%). Default: 10s. "
        "Env NODE_AGENT_HEARTBEAT_INTERVAL."
    )
    assert config_docs.default_text(AgentConfig, "stale_after") == "3 x heartbeat_interval"
    assert config_docs.default_text(AgentConfig, "max_command_lifetime") == "1d"
    assert config_docs.default_text(AggregatorConfig, "alert_repeat") == "5m"
    assert config_docs.default_text(AgentConfig, "probe_timeout") == "1s"


def test_help_renders_with_percent_signs() -> None:
    """A docstring's ``%`` does not break argparse's formatting (exit 0, text shown)."""
    result = run("node-agent", "start", "--help")
    assert result.returncode == 0, result.stderr
    assert "jittered by up to 10 %" in " ".join(result.stdout.split())


@pytest.mark.parametrize("program", ["fleetctl aggregator", "node-agent start"])
def test_trust_operator_has_one_name_in_both_clis(program: str) -> None:
    """Both CLIs show ``--trust-operator`` (repeatable); ``--trust-operators`` is a hidden
    alias that still sets the same setting."""
    result = run(*program.split(), "--help")
    assert "--trust-operator TRUST_OPERATOR" in result.stdout
    assert "--trust-operators " not in result.stdout
    root = fleetctl.parser() if program.startswith("fleetctl") else node_agent.parser()
    args = root.parse_args(
        [*program.split()[1:], "--trust-operator", "UA", "--trust-operators", "UB"]
    )
    assert args.trust_operators == ["UA", "UB"]
    assert SINGULAR_FLAGS["trust_operators"] == "trust-operator"


def test_aggregator_reads_fleetctl_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """FLEETCTL_SERVER gives fleetctl aggregator its server, below
    FLEET_AGGREGATOR_SERVER and the flag."""
    monkeypatch.setenv("FLEETCTL_SERVER", "nats://from-fleetctl:4222")
    monkeypatch.delenv("FLEET_AGGREGATOR_SERVER", raising=False)
    args = fleetctl.parser().parse_args(["aggregator"])
    assert aggregator_settings(args).server == "nats://from-fleetctl:4222"
    monkeypatch.setenv("FLEET_AGGREGATOR_SERVER", "nats://own:4222")
    assert aggregator_settings(args).server == "nats://own:4222"
    args = fleetctl.parser().parse_args(["aggregator", "--server", "nats://flag:4222"])
    assert aggregator_settings(args).server == "nats://flag:4222"
