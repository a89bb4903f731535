"""Keys and help: FLEETCTL_KEY_FILE, node-agent init --state-dir and key show, approving
a node's registered key, refusing a pasted seed, --version, help on every flag, no
abbreviations and shell completion."""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from actors.cli import node_agent
from actors.cli.common import settings_from
from actors.cli.fleetctl import main as fleetctl
from actors.fleet.aggregator.record_rules import pending_record
from actors.fleet.config import ENV_PREFIX as AGGREGATOR_ENV_PREFIX
from actors.fleet.config import AggregatorConfig
from actors.fleet.storage import registry
from actors.runtime.bus import NatsBus
from schemas import codec, signing
from schemas.subjects import BUCKET_NODES, Subjects
from tests.support.fleet import Fleet

BIN = Path(sys.executable).parent


def run(
    *args: str, env: dict[str, str] | None = None, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / args[0]), *args[1:]],
        capture_output=True,
        text=True,
        timeout=30,
        input=stdin,
        env={**os.environ, **(env or {})},
    )


def parsers(
    parser: argparse.ArgumentParser, path: str
) -> list[tuple[str, argparse.ArgumentParser]]:
    """``parser`` and every subcommand parser under it, with its command line."""
    found = [(path, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found.extend(parsers(sub, f"{path} {name}"))
    return found


@pytest.mark.parametrize("root", [fleetctl.parser(), node_agent.parser()])
def test_every_flag_has_help_and_no_parser_abbreviates(root: argparse.ArgumentParser) -> None:
    """Each argument of each (sub)command says what it is for, and no parser silently
    takes an abbreviation of a flag."""
    for path, parser in parsers(root, root.prog):
        assert not parser.allow_abbrev, path
        for action in parser._actions:
            if not isinstance(action, argparse._SubParsersAction):  # its choices have help
                assert action.help, f"{path} {action.option_strings or action.dest}"


def test_abbreviated_flag_is_refused() -> None:
    """`--dead` is not taken for `--deadline`: exit 2, before anything connects."""
    result = run("fleetctl", "drain", "n1", "--dead", "5")
    assert result.returncode == 2
    assert "unrecognized arguments: --dead 5" in result.stderr


def test_aggregator_trusts_the_operator_keys_its_flags_name(tmp_path: Path) -> None:
    """fleetctl aggregator --trust-operator KEY (docs/operations.md), repeatable and also
    spelled like its setting, --trust-operators KEY, trusts those keys besides the file's."""
    first, second, third = (signing.KeyPair.generate().public_key for _ in range(3))
    listed = tmp_path / "operators"
    listed.write_text(f"# from the file\n{third}\n")
    args = fleetctl.parser().parse_args(
        ["aggregator", "--trust-operators", first, "--trust-operator", second,
         "--trust-operators-file", str(listed)]
    )  # fmt: skip
    config = settings_from(args, AggregatorConfig, AGGREGATOR_ENV_PREFIX)
    assert config.trust_operators == [first, second]
    assert config.operator_keys() == {first, second, third}


@pytest.mark.parametrize("program", ["fleetctl", "node-agent"])
def test_version(program: str) -> None:
    result = run(program, "--version")
    version = importlib.metadata.version("nats-node-agent")
    assert result.returncode == 0 and result.stdout == f"{program} {version}\n"


def test_key_file_env_is_the_operator_key(tmp_path: Path) -> None:
    """FLEETCTL_KEY_FILE names the operator key for every command that takes --key-file:
    keys init writes it there, drain signs with it, and the help says so; a missing one is
    an error naming `fleetctl keys init`."""
    path = tmp_path / "ops" / "operator.nk"
    env = {"FLEETCTL_KEY_FILE": str(path)}
    result = run("fleetctl", "keys", "init", env=env)
    assert result.returncode == 0, result.stderr
    assert signing.load_key_file(path).public_key == result.stdout.strip()
    assert "FLEETCTL_KEY_FILE" in run("fleetctl", "drain", "--help", env=env).stdout
    # With the key there, drain gets past its settings to the (unreachable) server.
    drain = ("fleetctl", "drain", "n1", "--server", "nats://127.0.0.1:1")
    result = run(*drain, env=env)
    assert result.returncode == 1
    assert result.stderr.startswith("error: cannot reach NATS at nats://127.0.0.1:1")
    elsewhere = tmp_path / "missing.nk"
    result = run(*drain, env={"FLEETCTL_KEY_FILE": str(elsewhere)})
    assert result.returncode == 1
    assert result.stderr == (
        f"error: operator key {elsewhere} not found: create one with 'fleetctl keys init', "
        "or export FLEETCTL_KEY_FILE (the line 'fleetctl up' prints), or pass --key-file\n"
    )


def test_init_state_dir_and_key_show(tmp_path: Path) -> None:
    """init --state-dir writes <state dir>/node.nk; key show prints the same public key
    (stdout) and its fingerprint (stderr); a missing key is one line, exit 1."""
    state = tmp_path / "state"
    init = run("node-agent", "init", "--state-dir", str(state))
    assert init.returncode == 0, init.stderr
    public_key = init.stdout.strip()
    assert signing.load_key_file(state / "node.nk").public_key == public_key
    show = run("node-agent", "key", "show", "--state-dir", str(state))
    assert show.returncode == 0 and show.stdout == f"{public_key}\n"
    assert show.stderr == f"fingerprint {signing.fingerprint(public_key)}\n"
    missing = run("node-agent", "key", "show", "--state-dir", str(tmp_path / "none"))
    assert missing.returncode == 1 and len(missing.stderr.splitlines()) == 1


def test_a_pasted_seed_is_refused_as_a_seed(tmp_path: Path) -> None:
    """`fleetctl approve NODE SU...` says it is a seed, not a public key, before connecting."""
    seed = signing.create_key_file(tmp_path / "node.nk").seed
    result = run("fleetctl", "approve", "n1", seed, "--server", "nats://127.0.0.1:1")
    assert result.returncode == 1
    assert result.stderr.startswith("error: that is a seed (the secret key, SU...)")
    assert seed not in result.stderr and len(result.stderr.splitlines()) == 1


async def test_approve_takes_the_key_of_the_pending_registration(
    fleet: Fleet, bus: NatsBus, prefix: str, tmp_path: Path
) -> None:
    """`approve NODE` shows the registered key and its fingerprint; without a terminal it
    approves only with --yes. A node with no registration is one error line."""
    key = signing.create_key_file(tmp_path / "node.nk")
    nodes = await bus.kv(Subjects(prefix).bucket_name(BUCKET_NODES))
    await nodes.put("n9", codec.encode(pending_record("n9", "c1", key.public_key, time.time())))
    server = ("--server", fleet.url, "--prefix", prefix)

    refused = await asyncio.to_thread(run, "fleetctl", "approve", "n9", *server, stdin="")
    assert refused.returncode == 1, refused.stderr
    assert f"fingerprint {signing.fingerprint(key.public_key)}" in refused.stderr
    assert refused.stderr.splitlines()[-1] == "error: n9 not approved"
    assert await registry.trust_entry(bus, Subjects(prefix), "n9") is None

    approved = await asyncio.to_thread(run, "fleetctl", "approve", "n9", "--yes", *server)
    assert approved.returncode == 0 and approved.stdout == "approved n9\n", approved.stderr
    entry = await registry.trust_entry(bus, Subjects(prefix), "n9")
    assert entry is not None and entry.public_key == key.public_key

    unknown = await asyncio.to_thread(run, "fleetctl", "approve", "n8", "--yes", *server)
    assert unknown.returncode == 1
    assert unknown.stderr.startswith("error: node n8 has not registered")


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("fleetctl dra", "drain"),
        ("fleetctl drain n1 --dead", "--deadline"),
        ("node-agent ke", "key"),
    ],
)
def test_shell_completion(tmp_path: Path, line: str, expected: str) -> None:
    """argcomplete answers the shell's completion request (what `eval "$(register-python-
    argcomplete fleetctl)"` sets up) with the subcommands and flags."""
    out = tmp_path / "completions"
    env = {
        "_ARGCOMPLETE": "1",
        "COMP_LINE": line,
        "COMP_POINT": str(len(line)),
        "_ARGCOMPLETE_STDOUT_FILENAME": str(out),
    }
    result = run(line.split()[0], env=env)
    assert result.returncode == 0, result.stderr
    assert expected in out.read_text().split()


def test_init_names_the_node_its_config_names(tmp_path: Path) -> None:
    """init --config with node_id in the file prints the approve line with that id, not a
    placeholder."""
    config = tmp_path / "gpu-a.toml"
    config.write_text(f'node_id = "gpu-a"\nstate_dir = "{tmp_path / "state"}"\n')
    init = run("node-agent", "init", "--config", str(config))
    assert init.returncode == 0, init.stderr
    public_key = init.stdout.strip()
    assert f"  fleetctl approve gpu-a {public_key}\n" in init.stderr
