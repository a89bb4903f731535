"""Node names complete from the fleet (argcomplete, as the shell asks), within a short
timeout and silently when the fleet cannot be read; a mistyped subcommand, flag, choice
or setting gets the closest right one."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from actors.runtime.bus import NatsBus
from schemas import codec
from schemas.messages import NodeRecord
from schemas.subjects import BUCKET_NODES, Subjects
from tests.support.fleet import Fleet

BIN = Path(sys.executable).parent


async def complete(tmp_path: Path, line: str, **env: str) -> tuple[list[str], str, float]:
    """What `fleetctl` offers for ``line`` (the shell's COMP_LINE), its stderr and the
    seconds it took."""
    out = tmp_path / "completions"
    clean = {k: v for k, v in os.environ.items() if not k.startswith("FLEETCTL_")}
    started = time.monotonic()
    process = await asyncio.create_subprocess_exec(
        str(BIN / "fleetctl"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={
            **clean,
            "XDG_CONFIG_HOME": str(tmp_path),
            "_ARGCOMPLETE": "1",
            "COMP_LINE": line,
            "COMP_POINT": str(len(line)),
            "_ARGCOMPLETE_STDOUT_FILENAME": str(out),
            **env,
        },
    )
    _, stderr = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode == 0, stderr
    return out.read_text().split(), stderr.decode(), time.monotonic() - started


async def put_nodes(bus: NatsBus, prefix: str, *nodes: str) -> None:
    bucket = await bus.kv(Subjects(prefix).bucket_name(BUCKET_NODES))
    for node in nodes:
        record = NodeRecord(node_id=node, cluster="c1", state="active", last_seq=1, last_seen=1.0)
        await bucket.put(node, codec.encode(record))


async def test_node_names_complete_from_the_fleet(
    fleet: Fleet, bus: NatsBus, prefix: str, tmp_path: Path
) -> None:
    """`fleetctl describe gpu-` offers the fleet's nodes starting with gpu-, and so do
    `--node` options and the signed commands' NODE."""
    await put_nodes(bus, prefix, "gpu-01", "gpu-02", "cpu-01")
    server = {"FLEETCTL_SERVER": fleet.url}
    offered, err, _ = await complete(
        tmp_path, f"fleetctl describe --prefix {prefix} gpu-", **server
    )
    assert offered == ["gpu-01", "gpu-02"] and err == ""
    offered, _, _ = await complete(tmp_path, f"fleetctl drain --prefix {prefix} c", **server)
    assert offered == ["cpu-01"]
    offered, _, _ = await complete(
        tmp_path, f"fleetctl gpus --prefix {prefix} --node gpu-0", **server
    )
    assert offered == ["gpu-01", "gpu-02"]


async def test_completion_is_silent_and_quick_without_a_fleet(tmp_path: Path) -> None:
    """No server listening, or a broken setting: nothing offered, nothing on stderr,
    answered within the completion timeout (1.5 s) past what a completion that asks no
    server takes (its start, measured beside it: a loaded machine slows both)."""
    offered, _, start = await complete(tmp_path, "fleetctl descr")
    assert offered == ["describe"]
    offered, err, took = await complete(
        tmp_path, "fleetctl describe n", FLEETCTL_SERVER="nats://127.0.0.1:1"
    )
    assert (offered, err) == ([], "")
    assert took < start + 1.5 + 3.0, f"{took:.2f}s, a completion without a server {start:.2f}s"
    offered, err, _ = await complete(tmp_path, "fleetctl describe n", FLEETCTL_SERVR="x")
    assert (offered, err) == ([], "")


@pytest.mark.parametrize(
    ("args", "hint"),
    [
        (["desribe", "n1"], "did you mean 'describe'?"),
        (["nodes", "--sevrer", "x"], "did you mean '--server'?"),
        (["nodes", "-o", "jsn"], "did you mean 'json'?"),
        (["config", "use-contxt", "a"], "did you mean 'use-context'?"),
    ],
)
def test_usage_errors_suggest(args: list[str], hint: str) -> None:
    """A mistyped subcommand, flag or choice: exit 2 and the closest right one."""
    result = subprocess.run(
        [str(BIN / "fleetctl"), *args], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 2
    assert result.stderr.rstrip().endswith(hint), result.stderr


def test_unknown_settings_suggest(tmp_path: Path) -> None:
    """A mistyped variable or TOML key is one line with the closest setting."""
    env = {**os.environ, "NODE_AGENT_HEARTBEAT_INTERVL": "5"}
    result = subprocess.run(
        [str(BIN / "node-agent"), "start"], capture_output=True, text=True, timeout=30, env=env
    )
    assert result.returncode == 1
    assert result.stderr == (
        "error: config: unknown environment variable NODE_AGENT_HEARTBEAT_INTERVL; "
        "did you mean NODE_AGENT_HEARTBEAT_INTERVAL?\n"
    )
    config = tmp_path / "agent.toml"
    config.write_text('sevrer = "nats://x:4222"\n')
    result = subprocess.run(
        [str(BIN / "node-agent"), "start", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.stderr == "error: config: unknown setting `sevrer`; did you mean 'server'?\n"
