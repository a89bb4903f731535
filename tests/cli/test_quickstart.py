"""README.md's Quickstart, run as a newcomer runs it: `fleetctl up` in one terminal, the
export line it prints pasted into a second, then every command of the Quickstart as the
README writes it. Commands and their order are read from README.md, so a change there is
tested as written."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

import pytest

from actors.runtime.embedded import NatsServer

README = Path(__file__).resolve().parents[2] / "README.md"

TEST_FLAGS = ["--port", "0", "--heartbeat-interval", "0.5", "--stale-after", "3"]
"""Added to the README's `fleetctl up`: any free port (tests run side by side) and a
quicker beat, so that the inject is seen sooner. The commands that follow are as written."""

READY = "3 nodes: 3 active"
TIMEOUT = 30.0


def quickstart_blocks() -> list[list[str]]:
    """The `sh` code blocks of the README's Quickstart section, as lines without comments."""
    text = README.read_text()
    section = text[text.index("## Quickstart") :]
    section = section[: section.index("\n## ", 1)]
    blocks = re.findall(r"```sh\n(.*?)```", section, re.S)
    return [
        [strip_comment(line) for line in block.splitlines() if line.strip()] for block in blocks
    ]


def strip_comment(line: str) -> str:
    return re.sub(r"\s+#.*$", "", line).strip()


def up_command(blocks: list[list[str]]) -> str:
    """The `fleetctl up` of the first block: the part of its `&&` chain from there on
    (installing is what the test's own environment did already)."""
    (line,) = [line for line in blocks[0] if "fleetctl up" in line]
    parts = [part.strip() for part in line.split("&&")]
    start = next(i for i, part in enumerate(parts) if "fleetctl up" in part)
    assert start == len(parts) - 1, f"fleetctl up must end its line: {line}"
    return parts[start]


def newcomer_env(home: Path) -> dict[str, str]:
    """A fresh user's environment: a new HOME and none of our settings."""
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("FLEETCTL_", "NODE_AGENT_", "FLEET_AGGREGATOR_", "XDG_"))
        and name not in ("NATS_URL", "NO_COLOR")
    }
    return env | {"HOME": str(home)}


def read_until(stream: IO[str], marker: str, seen: list[str]) -> bool:
    """Read lines into ``seen`` until one holds ``marker``; False at the end of the stream."""
    for line in stream:
        seen.append(line)
        if marker in line:
            return True
    return False


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """A directory like a fresh clone after the install: `.venv` is this interpreter's."""
    work = tmp_path / "clone"
    work.mkdir()
    (work / ".venv").symlink_to(Path(sys.prefix))
    return work


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_quickstart_runs_as_written(workdir: Path, tmp_path: Path) -> None:
    """Every Quickstart command of README.md, with the printed export pasted, exits 0 against
    a real `fleetctl up`; its outputs are those the README describes; Ctrl-C stops it all."""
    blocks = quickstart_blocks()
    assert len(blocks) == 2, "the Quickstart is the `fleetctl up` block and the commands block"
    env = newcomer_env(tmp_path / "home")
    up = subprocess.Popen(
        ["bash", "-c", f"exec {up_command(blocks)} {' '.join(TEST_FLAGS)}"],
        cwd=workdir,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # a terminal of its own: its process group is fleetctl's
    )
    assert up.stdout is not None
    printed: list[str] = []
    try:
        assert read_until(up.stdout, READY, printed), "".join(printed)
        exports = [line.strip() for line in printed if line.strip().startswith("export ")]
        assert len(exports) == 1, "".join(printed)
        run_commands(blocks[1], exports[0], workdir, env)
        # Ctrl-C as a terminal sends it: SIGINT to the whole foreground process group.
        os.killpg(up.pid, signal.SIGINT)
        started = time.monotonic()
        rest, _ = up.communicate(timeout=TIMEOUT)
        took = time.monotonic() - started
    finally:
        up.kill()
        up.wait()
    assert up.returncode == 0, rest
    # Each agent said goodbye, and the aggregator took it before it stopped in turn.
    assert "3 nodes: 3 stopped\n" in rest and rest.endswith("stopped.\n"), rest
    assert "Traceback" not in rest and took < STOP_WITHIN, (took, rest)
    assert "stopped" in node_events(tmp_path / "home", "node-1"), "no stopped event recorded"


STOP_WITHIN = 20.0
"""Bounds a hang only: the README's "within 5 s" is for the goodbyes on an idle machine;
a loaded test machine stops the aggregator and the server more slowly."""


def node_events(home: Path, node: str) -> str:
    """`fleetctl events NODE` once `fleetctl up`'s store is served again (by a server of
    its own: the fleet is stopped)."""
    store = home / ".local" / "state" / "fleetctl" / "up"
    with NatsServer(store / "nats", name="fleetctl-up") as server:
        env = newcomer_env(home) | {"NATS_URL": server.url}
        fleetctl = Path(sys.prefix) / "bin" / "fleetctl"
        result = subprocess.run(
            [str(fleetctl), "events", node], env=env, capture_output=True, text=True, timeout=60
        )
    assert result.returncode == 0, result.stderr
    return result.stdout


def run_commands(commands: list[str], export: str, workdir: Path, env: dict[str, str]) -> None:
    """Each command in a shell where ``export`` was pasted, in the README's order."""
    sent_id = ""
    for command in commands:
        if "<id>" in command:
            assert sent_id, f"{command}: no command id printed before it"
            command = command.replace("<id>", sent_id)
        script = f"{export}\n{command}"
        if " watch " in f"{command} ":
            interrupted(script, workdir, env)
            continue
        result = shell(script, workdir, env)
        if command.endswith("describe node-3"):
            # After the inject: degraded once the node's next heartbeat carries it.
            deadline = time.monotonic() + TIMEOUT
            while "State:           degraded" not in result.stdout:
                assert time.monotonic() < deadline, result.stdout
                result = shell(script, workdir, env)
            assert "temperature" in result.stdout
        sent = re.search(r"^(\w+) sent: id=(\w+) node=(\S+)$", result.stdout, re.M)
        if sent:
            sent_id = sent.group(2)
        if "uncordon node-2" in command:
            assert sent is not None and sent.group(1, 3) == ("uncordon", "node-2"), result.stdout


def shell(script: str, workdir: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        ["bash", "-c", script],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert result.returncode == 0, f"{script}\nexit {result.returncode}\n{result.stderr}"
    assert "Traceback" not in result.stderr, result.stderr
    return result


def interrupted(script: str, workdir: Path, env: dict[str, str]) -> None:
    """A command that runs until Ctrl-C: once it says it is live, SIGINT ends it with 0."""
    process = subprocess.Popen(
        ["bash", "-c", script.replace("\n.venv/bin/", "\nexec .venv/bin/")],
        cwd=workdir,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stderr is not None
    said: list[str] = []
    try:
        assert read_until(process.stderr, "Ctrl-C", said), "".join(said)
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=TIMEOUT)
    finally:
        process.kill()
        process.wait()
    assert process.returncode == 0, f"{script}\n{''.join(said)}{err}"
    assert "Traceback" not in err
