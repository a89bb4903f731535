"""Both CLIs start with only what the command needs: fleetctl builds the parsers of the
command's groups alone (the same parser the whole tree has), and a command that does not
connect imports neither NATS nor aiohttp (tests/bench/bench_startup.py times them)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from actors.cli import node_agent
from actors.cli.fleetctl import main as fleetctl

HEAVY = ("nats", "aiohttp", "actors.fleet.process", "actors.node.agent", "pynvml")
"""Modules a short command must not import: the client library and the daemons' actors."""
LOOP = ("asyncio", "msgspec")
"""What ``--version`` and ``node-agent status --url`` start without (the standard library
answers them)."""


def commands(root: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    [action] = [a for a in root._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def imported_by(cli: str, *argv: str) -> list[str]:
    """The modules of HEAVY and LOOP that running ``cli`` with ``argv`` in a fresh
    interpreter loaded (exits and errors included: only the imports matter here; one
    deferred, :mod:`actors.cli.lazy`, is not loaded)."""
    script = (
        "import json, sys\n"
        f"from actors.cli.{cli} import main\n"
        "try:\n"
        f"    main({list(argv)!r})\n"
        "except SystemExit:\n"
        "    pass\n"
        f"heavy = {HEAVY + LOOP!r}\n"
        "from actors.cli.lazy import Deferred\n"
        "found = [sys.modules[m] for m in heavy if m in sys.modules]\n"
        "loaded = [m.__name__ for m in found if not isinstance(m, Deferred)]\n"
        "print(json.dumps(sorted(loaded)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    found: list[str] = json.loads(done.stdout.splitlines()[-1])
    return found


def test_every_command_is_built_by_the_groups_it_names() -> None:
    """COMMANDS names every fleetctl command, and the parser built from a command's groups
    alone is the whole tree's: the same help, usage and handler."""
    whole = commands(fleetctl.parser())
    assert set(whole) == set(fleetctl.COMMANDS)
    for name, groups in fleetctl.COMMANDS.items():
        alone = commands(fleetctl.parser(groups))[name]
        assert alone.format_help() == whole[name].format_help(), name
        assert alone.get_default("func") is whole[name].get_default("func"), name


def test_a_command_line_picks_its_groups() -> None:
    """A command's groups for a command; none for --version; all for help or a typo."""
    assert fleetctl.groups_for(["nodes", "--json"]) == ("views",)
    assert fleetctl.groups_for(["--version"]) == ()
    assert fleetctl.groups_for([]) == fleetctl.GROUPS
    assert fleetctl.groups_for(["--help"]) == fleetctl.GROUPS
    assert fleetctl.groups_for(["nodse"]) == fleetctl.GROUPS


@pytest.mark.parametrize(
    ("cli", "argv"),
    [
        ("fleetctl.main", ["--version"]),
        ("node_agent", ["--version"]),
        ("node_agent", ["status", "--url", "http://127.0.0.1:9", "--timeout", "1"]),
        ("node_agent", ["key", "show", "--key-file", "/nonexistent/node.nk"]),
    ],
    ids=lambda value: value if isinstance(value, str) else " ".join(value),
)
def test_a_command_that_does_not_connect_imports_no_client(cli: str, argv: list[str]) -> None:
    """--version, node-agent status and key show start without NATS, aiohttp or the actors;
    --version and status without asyncio or msgspec either."""
    found = imported_by(cli, *argv)
    if argv[0] in ("--version", "status"):
        assert found == []
    else:
        assert not set(HEAVY) & set(found), found


def test_every_node_agent_command_is_built_alone_as_in_the_whole_tree() -> None:
    """node-agent builds the parser of the command given alone: the same help, usage and
    choices as the whole tree's; none for --version, all for help or a typo."""
    whole = commands(node_agent.parser())
    assert list(whole) == list(node_agent.BUILDERS)
    for name in node_agent.BUILDERS:
        alone = commands(node_agent.parser((name,)))[name]
        assert alone.format_help() == whole[name].format_help(), name
    assert node_agent.commands_for(["status", "--json"]) == ("status",)
    assert node_agent.commands_for(["--version"]) == ()
    assert node_agent.commands_for(["--help"]) == tuple(node_agent.BUILDERS)
    assert node_agent.commands_for(["stauts"]) == tuple(node_agent.BUILDERS)


def test_fleetctl_nodes_imports_no_daemon() -> None:
    """fleetctl nodes loads the client, not the aggregator's process or an agent."""
    found = imported_by("fleetctl.main", "nodes", "--server", "nats://127.0.0.1:9")
    assert "nats" in found
    assert not {"actors.fleet.process", "actors.node.agent", "pynvml"} & set(found)
