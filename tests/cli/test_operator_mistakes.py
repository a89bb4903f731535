"""Operator mistakes end in one ``error:`` line on stderr and a non-zero exit: no traceback,
no process left running half-blind, no restart loop. And signals stop the agent in every
phase, its first connection's retries included."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from actors.runtime.bus import NatsBus
from actors.runtime.embedded import NatsServer
from schemas import codec, signing
from schemas.messages import NodeRecord
from schemas.subjects import BUCKET_NODES, Subjects


def run(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "NOTIFY_SOCKET": ""},
    )


def one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    """The single ``error:`` line of a failed command (asserting that is all there is)."""
    assert result.returncode == 1, (result.returncode, result.stderr)
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    return result.stderr.strip()


@pytest.fixture
def node_key(tmp_path: Path) -> Path:
    path = tmp_path / "state" / "node.nk"
    signing.create_key_file(path)
    return path


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A loopback port something else listens on."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield int(holder.getsockname()[1])


def test_up_with_a_store_it_cannot_create(tmp_path: Path) -> None:
    result = run("actors.cli.fleetctl", "up", "--store", "/proc/nope", "--port", "0")
    assert one_error_line(result) == "error: config: --store /proc/nope: No such file or directory"


def test_up_with_stale_after_not_above_the_interval(tmp_path: Path) -> None:
    result = run(
        "actors.cli.fleetctl",
        "up",
        *("--store", str(tmp_path), "--port", "0"),
        *("--heartbeat-interval", "10", "--stale-after", "5"),
    )
    assert one_error_line(result) == (
        "error: config: --stale-after (5s) must be longer than --heartbeat-interval (10s)"
    )
    assert not (tmp_path / "nats").exists()  # refused before anything started


def test_up_on_a_taken_port_does_not_suggest_the_same_store(
    taken_port: int, tmp_path: Path
) -> None:
    """--port 0 alone would start a second server on the first one's JetStream store."""
    result = run("actors.cli.fleetctl", "up", "--port", str(taken_port), "--store", str(tmp_path))
    line = one_error_line(result)
    assert f"port {taken_port} is taken" in line and "--port 0 with another --store" in line


@pytest.mark.parametrize("command", ["node_agent start", "fleetctl aggregator"])
def test_unknown_log_level(command: str, node_key: Path) -> None:
    module, sub = command.split()
    result = run(f"actors.cli.{module}", sub, "--log-level", "loud", "--log-format", "json")
    assert one_error_line(result) == "error: config: log_level: invalid enum value 'loud'"


def test_aggregator_replicas_on_a_single_server(nats_server: NatsServer) -> None:
    """Fatal, not an actor restarted forever: no restart turns one server into a cluster."""
    started = time.monotonic()
    result = run(
        "actors.cli.fleetctl",
        "aggregator",
        *("--server", nats_server.url, "--prefix", "replicas3", "--http-port", "-1"),
        *("--replicas", "3"),
    )
    assert one_error_line(result) == (
        "error: replicas = 3 needs a clustered nats-server; this one is not (use replicas = 1)"
    )
    assert time.monotonic() - started < 15


def test_agent_whose_http_port_is_taken_exits(
    nats_server: NatsServer, node_key: Path, taken_port: int
) -> None:
    """An agent that cannot serve /healthz and /metrics must not run on without them."""
    result = run(
        "actors.cli.node_agent",
        "start",
        *("--server", nats_server.url, "--prefix", "porttaken", "--node-id", "n1"),
        *("--state-dir", str(node_key.parent), "--http-port", str(taken_port)),
        "--fake-gpus=2",
    )
    assert one_error_line(result) == (
        f"error: cannot serve HTTP on 127.0.0.1:{taken_port}: address already in use"
    )


@pytest.fixture
async def known_node(bus: NatsBus, prefix: str) -> str:
    """Node n1's record, with 8 GPUs, as an aggregator keeps it."""
    bucket = await bus.kv(Subjects(prefix).bucket_name(BUCKET_NODES))
    record = NodeRecord(
        node_id="n1", cluster="c1", state="active", last_seq=1, last_seen=time.time(), gpus_total=8
    )
    await bucket.put("n1", codec.encode(record))
    return "n1"


@pytest.mark.parametrize(
    ("node", "gpu", "message"),
    [
        ("ghost", "0", "error: node ghost not found"),
        ("n1", "99", "error: node n1 has 8 GPUs (0-7), no GPU 99"),
    ],
)
async def test_inject_into_an_unknown_node_or_gpu(
    nats_server: NatsServer,
    prefix: str,
    known_node: str,
    node_key: Path,
    node: str,
    gpu: str,
    message: str,
) -> None:
    """inject naming a node the fleet does not know, or a GPU its node lacks, is one
    error line saying which."""
    result = await asyncio.to_thread(
        run,
        "actors.cli.node_agent",
        "inject",
        *("temp", "90", "--gpu", gpu, "--node-id", node),
        *("--server", nats_server.url, "--prefix", prefix, "--key-file", str(node_key)),
    )
    assert one_error_line(result) == message


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_while_retrying_the_first_connection(sig: int, node_key: Path) -> None:
    """Under systemd a stop ignored here ends in SIGKILL after TimeoutStopSec."""
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        closed = int(probe.getsockname()[1])
    agent = subprocess.Popen(
        [
            *(sys.executable, "-m", "actors.cli.node_agent", "start"),
            *("--server", f"nats://127.0.0.1:{closed}", "--connect-timeout", "1"),
            *("--state-dir", str(node_key.parent), "--log-format", "json"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert agent.stdout is not None
        for line in agent.stdout:  # wait until it is retrying
            if "nats connect failed; retrying" in line:
                break
        sent = time.monotonic()
        agent.send_signal(sig)
        out, err = agent.communicate(timeout=10)
    finally:
        agent.kill()
    assert agent.returncode == 0, err
    assert time.monotonic() - sent < 5
    assert "node agent stopped before connecting" in out
    assert "Traceback" not in out + err
