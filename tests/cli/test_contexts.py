"""fleetctl contexts (config.toml under XDG_CONFIG_HOME, as kubeconfig): the current
context reaches the fleet with no flags; --context, FLEETCTL_* and flags win in that
order; use-context, get-contexts and current-context; keys show."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from actors.runtime.bus import NatsBus
from schemas import codec, signing
from schemas.messages import NodeRecord
from schemas.subjects import BUCKET_NODES, Subjects
from tests.support.fleet import Fleet

REFUSED = "nats://127.0.0.1:1"
"""A server nobody listens on: connecting fails at once."""


def write_contexts(home: Path, fleet_url: str, prefix: str, key: Path) -> Path:
    path = home / "fleetctl" / "config.toml"
    path.parent.mkdir(parents=True)
    path.write_text(
        "# my fleets\n"
        'current-context = "lab"\n\n'
        "[contexts.lab]\n"
        f'server = "{fleet_url}"\n'
        f'prefix = "{prefix}"\n'
        f'key_file = "{key}"\n\n'
        "[contexts.prod]  # not reachable from a test\n"
        f'server = "{REFUSED}"\n'
    )
    path.chmod(0o644)  # whatever the umask: only its owner may write it
    return path


async def fleetctl(home: Path, *args: str, **env: str) -> tuple[int, str, str]:
    clean = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith("FLEETCTL_") and key != "NATS_URL"
    }
    process = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "actors.cli.fleetctl", *args),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**clean, "XDG_CONFIG_HOME": str(home), **env},
    )
    stdout, stderr = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode is not None
    return process.returncode, stdout.decode(), stderr.decode()


@pytest.fixture
def home(tmp_path: Path, fleet: Fleet, prefix: str) -> Path:
    signing.create_key_file(tmp_path / "keys" / "lab.nk")
    write_contexts(tmp_path / "config", fleet.url, prefix, tmp_path / "keys" / "lab.nk")
    return tmp_path / "config"


async def put_node(bus: NatsBus, prefix: str) -> None:
    bucket = await bus.kv(Subjects(prefix).bucket_name(BUCKET_NODES))
    record = NodeRecord(node_id="ctx-node", cluster="c1", state="active", last_seq=1, last_seen=1.0)
    await bucket.put(record.node_id, codec.encode(record))


async def test_current_context_reaches_the_fleet(home: Path, bus: NatsBus, prefix: str) -> None:
    """With the file alone (no flag, no variable) fleetctl nodes reads the context's
    server and prefix."""
    await put_node(bus, prefix)
    code, out, err = await fleetctl(home, "nodes")
    assert code == 0, err
    assert "ctx-node" in out


async def test_precedence_flag_env_context(home: Path, fleet: Fleet, prefix: str) -> None:
    """--context picks another context; FLEETCTL_SERVER beats the context; --server
    beats FLEETCTL_SERVER."""
    code, _, err = await fleetctl(home, "nodes", "--context", "prod", "--prefix", prefix)
    assert code == 1 and err.startswith("error: "), err
    code, _, err = await fleetctl(
        home, "nodes", "--context", "prod", "--prefix", prefix, FLEETCTL_SERVER=fleet.url
    )
    assert code == 0, err
    code, _, err = await fleetctl(home, "nodes", "--server", fleet.url, FLEETCTL_SERVER=REFUSED)
    assert code == 0, err
    code, _, err = await fleetctl(home, "nodes", "--server", REFUSED)
    assert code == 1


async def test_unknown_context_suggests(home: Path) -> None:
    """An unknown --context is one line naming the file, with a close name suggested."""
    code, out, err = await fleetctl(home, "nodes", "--context", "prdo")
    assert (code, out) == (1, "")
    path = home / "fleetctl" / "config.toml"
    assert err == f"error: config: no context 'prdo' in {path}; did you mean 'prod'?\n"


async def test_use_get_and_current_context(home: Path) -> None:
    """use-context rewrites only the current-context line (comments kept); get-contexts
    stars it; current-context prints it; an unknown name changes nothing (exit 1)."""
    path = home / "fleetctl" / "config.toml"
    assert (await fleetctl(home, "config", "current-context"))[1] == "lab\n"
    code, out, _ = await fleetctl(home, "config", "use-context", "prod")
    assert (code, out) == (0, 'Switched to context "prod".\n')
    text = path.read_text()
    assert 'current-context = "prod"' in text and "# my fleets" in text
    assert "not reachable from a test" in text and text.count("current-context") == 1
    code, out, _ = await fleetctl(home, "config", "get-contexts")
    rows = [line.split() for line in out.splitlines()]
    assert rows[0] == ["CURRENT", "NAME", "SERVER", "PREFIX", "KEY", "FILE"]
    assert rows[1][0] == "lab" and rows[2][:3] == ["*", "prod", REFUSED]
    code, _, err = await fleetctl(home, "config", "use-context", "nope")
    assert code == 1 and "no context 'nope'" in err
    assert path.read_text() == text


async def test_keys_show_context_env_flag(home: Path, tmp_path: Path) -> None:
    """keys show prints the context's key and fingerprint; FLEETCTL_KEY_FILE beats the
    context, --key-file beats both."""
    lab = signing.load_key_file(tmp_path / "keys" / "lab.nk")
    other = signing.create_key_file(tmp_path / "keys" / "other.nk")
    code, out, err = await fleetctl(home, "keys", "show")
    assert code == 0 and out == f"{lab.public_key}\n"
    assert err == f"fingerprint {signing.fingerprint(lab.public_key)}\n"
    env_key = str(tmp_path / "keys" / "other.nk")
    code, out, _ = await fleetctl(home, "keys", "show", FLEETCTL_KEY_FILE=env_key)
    assert out == f"{other.public_key}\n"
    code, out, _ = await fleetctl(
        home,
        "keys",
        "show",
        "--key-file",
        str(tmp_path / "keys" / "lab.nk"),
        FLEETCTL_KEY_FILE=env_key,
    )
    assert out == f"{lab.public_key}\n"


async def test_malformed_file_is_one_line(tmp_path: Path) -> None:
    """A context with an unknown key is refused in one line naming the file and key."""
    path = tmp_path / "fleetctl" / "config.toml"
    path.parent.mkdir()
    path.write_text('[contexts.a]\nserver = "nats://x:4222"\nsevrer = "y"\n')
    code, _, err = await fleetctl(tmp_path, "nodes")
    assert code == 1
    assert err.startswith(f"error: config: {path}: ") and "sevrer" in err
    assert len(err.splitlines()) == 1


@pytest.mark.parametrize("mode", [0o666, 0o664, 0o646])
async def test_contexts_file_others_may_write_is_warned_about(home: Path, mode: int) -> None:
    """A contexts file that group or others may write still works but is warned about in
    one line naming it and its mode, as a key file others may read is; 0644 is not."""
    path = home / "fleetctl" / "config.toml"
    code, out, err = await fleetctl(home, "config", "current-context")
    assert (code, out, err) == (0, "lab\n", "")
    path.chmod(mode)
    code, out, err = await fleetctl(home, "config", "current-context")
    assert (code, out) == (0, "lab\n")
    assert err == (
        f"SETTINGS FILE {path} IS WRITABLE BY GROUP OR OTHERS (mode {mode:04o}): anyone who "
        "writes it chooses what this program connects to, trusts and runs; chmod go-w it\n"
    )


async def test_use_context_keeps_the_file_mode(home: Path) -> None:
    """use-context rewrites the file with the mode it had: a file narrowed to 0600 is not
    widened to the umask's."""
    path = home / "fleetctl" / "config.toml"
    path.chmod(0o600)
    code, _, err = await fleetctl(home, "config", "use-context", "prod")
    assert (code, err) == (0, "")
    assert path.stat().st_mode & 0o777 == 0o600


async def test_config_file_others_may_write_is_warned_about(
    home: Path, tmp_path: Path, fleet: Fleet
) -> None:
    """fleetctl's --config file is checked as the contexts file is."""
    config = tmp_path / "fleetctl.toml"
    config.write_text(f'server = "{fleet.url}"\n')
    config.chmod(0o666)
    code, _, err = await fleetctl(home, "nodes", "--config", str(config))
    assert code == 0
    assert err.startswith(f"SETTINGS FILE {config} IS WRITABLE BY GROUP OR OTHERS (mode 0666)")


async def test_set_and_delete_context(home: Path, fleet: Fleet, bus: NatsBus, prefix: str) -> None:
    """set-context creates a context (--current selects it) that then reaches the fleet,
    changes only the settings given of an existing one; delete-context removes it and
    the current-context line naming it; an unknown name is one line, exit 1."""
    await put_node(bus, prefix)
    code, out, err = await fleetctl(
        home, "config", "set-context", "new", "--server", fleet.url, "--prefix", prefix,
        "--current",
    )  # fmt: skip
    assert (code, out) == (0, 'Context "new" created.\n'), err
    code, out, _ = await fleetctl(home, "nodes", "-o", "json")
    assert code == 0 and [r["node_id"] for r in json.loads(out)] == ["ctx-node"]
    code, out, _ = await fleetctl(home, "config", "set-context", "new", "--key-file", "/k.nk")
    assert (code, out) == (0, 'Context "new" modified.\n')
    _, out, _ = await fleetctl(home, "config", "get-contexts", "-o", "json")
    body = json.loads(out)
    assert body["current-context"] == "new"
    given = {key: value for key, value in body["contexts"]["new"].items() if value is not None}
    assert given == {"server": fleet.url, "prefix": prefix, "key_file": "/k.nk"}
    assert "lab" in body["contexts"]
    code, out, _ = await fleetctl(home, "config", "delete-context", "new")
    assert code == 0 and out.startswith('Deleted context "new"')
    body = json.loads((await fleetctl(home, "config", "get-contexts", "-o", "json"))[1])
    assert "new" not in body["contexts"] and body.get("current-context", "") == ""
    code, _, err = await fleetctl(home, "config", "delete-context", "nope")
    assert code == 1 and "no context 'nope'" in err
