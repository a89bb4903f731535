"""The command lines: fleetctl up end to end, init/approve/nodes, and one-line errors."""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import pty
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from actors.cli.fleetctl import up
from actors.cli.fleetctl.up import fleet_view
from actors.cli.render import tables
from actors.fleet.aggregator import record_rules
from actors.runtime.bus import NatsBus
from actors.runtime.embedded import NatsServer
from schemas import signing
from tests.support.fleet import Fleet, heartbeat, wait_record


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, **(env or {})},
    )


def test_fleetctl_up_reaches_three_active_nodes_and_stops_on_sigint(tmp_path: Path) -> None:
    """`fleetctl up --nodes 3` shows three active nodes, the line that exports its server
    and operator key for fleetctl in another shell, and exits 0 on Ctrl-C."""
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "actors.cli.fleetctl",
            "up",
            "--nodes",
            "3",
            "--port",
            "0",
            "--store",
            str(tmp_path),
            "--heartbeat-interval",
            "0.5",
            "--stale-after",
            "3",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert process.stdout is not None
    seen = []
    deadline = time.monotonic() + 30
    try:
        for line in process.stdout:
            seen.append(line)
            if "3 nodes: 3 active" in line or time.monotonic() > deadline:
                break
        assert any("3 nodes: 3 active" in line for line in seen), "".join(seen)
        assert seen[0].startswith("NATS: nats://127.0.0.1:")
        url = seen[0].split()[1]
        key = tmp_path / "operator.nk"
        assert f"  export NATS_URL={url} FLEETCTL_KEY_FILE={key}\n" in seen
        process.send_signal(signal.SIGINT)
        rest, _ = process.communicate(timeout=20)
    finally:
        process.kill()
    assert process.returncode == 0, rest
    assert "stopped." in rest
    assert (tmp_path / "operator.nk").exists()


def test_init_approve_and_nodes(nats_server: NatsServer, tmp_path: Path) -> None:
    """init prints a public key that approve accepts; nodes --json lists records."""
    key_file = tmp_path / "node.nk"
    init = run("actors.cli.node_agent", "init", "--key-file", str(key_file))
    assert init.returncode == 0 and init.stdout.startswith("U")
    again = run("actors.cli.node_agent", "init", "--key-file", str(key_file))
    assert again.returncode == 1 and "already exists" in again.stderr

    public_key = init.stdout.strip()
    approve = run(
        "actors.cli.fleetctl",
        "approve",
        "n7",
        public_key,
        "--server",
        nats_server.url,
        "--prefix",
        "cli1",
    )
    # The trust bucket does not exist until an aggregator provisions the prefix.
    assert approve.returncode == 1 and "start an aggregator" in approve.stderr
    assert "Traceback" not in approve.stderr


async def test_nodes_lists_the_fleet(fleet: Fleet, bus: NatsBus, prefix: str) -> None:
    """fleetctl nodes (table and --json) shows an active agent."""
    await fleet.start_aggregator()
    await fleet.start_agent()
    await wait_record(bus, prefix, "n1", lambda r: r.state == "active")
    # In a thread: the aggregator and agent under test share this event loop.
    where = ("--server", fleet.url, "--prefix", prefix)
    table = await asyncio.to_thread(run, "actors.cli.fleetctl", "nodes", *where)
    assert table.returncode == 0 and "n1" in table.stdout and "active" in table.stdout
    listed = await asyncio.to_thread(run, "actors.cli.fleetctl", "nodes", "--json", *where)
    assert [node["node_id"] for node in json.loads(listed.stdout)] == ["n1"]


def test_errors_are_one_line_without_traceback(tmp_path: Path) -> None:
    """Unreachable server and bad config are one 'error:' line, exit 1; a bad node id is
    a usage error (exit 2) naming the argument, before anything connects."""
    unreachable = run("actors.cli.fleetctl", "nodes", "--server", "nats://127.0.0.1:1")
    assert unreachable.returncode == 1
    assert unreachable.stderr.startswith("error: cannot reach NATS at nats://127.0.0.1:1")
    valid_key = signing.KeyPair.generate().public_key
    bad_id = run(
        "actors.cli.fleetctl", "approve", "bad.node", valid_key, "--server", "nats://127.0.0.1:1"
    )
    assert bad_id.returncode == 2 and "Traceback" not in bad_id.stderr
    assert bad_id.stderr.splitlines()[-1].startswith(
        "fleetctl approve: error: argument node: invalid node id 'bad.node'"
    )
    bad_config = run(
        "actors.cli.node_agent",
        "start",
        "--heartbeat-interval",
        "fast",
        "--state-dir",
        str(tmp_path),
    )
    assert bad_config.returncode == 1
    assert bad_config.stderr.strip() == (
        "error: config: heartbeat_interval: 'fast' is not a duration (use 30, 30s, 500ms, 2m, 1h)"
    )
    for result in (unreachable, bad_config):
        assert "Traceback" not in result.stderr and result.stderr.count("\n") == 1


def test_up_on_a_taken_port_says_what_to_do(nats_server: NatsServer, tmp_path: Path) -> None:
    """fleetctl up on a port in use fails with one line suggesting --port 0."""
    result = run(
        "actors.cli.fleetctl", "up", "--port", str(nats_server.port), "--store", str(tmp_path)
    )
    assert result.returncode == 1
    assert "is taken" in result.stderr and "--port 0" in result.stderr
    assert "Traceback" not in result.stderr


def test_fleetctl_up_on_a_short_terminal_summarises_in_place(tmp_path: Path) -> None:
    """On a terminal 5 lines tall, 3 nodes (a table of 5 lines) are shown as the counts by
    cluster and state, and every redraw fits above the cursor's line: nothing is pushed
    into the scrollback."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 5, 120, 0, 0))
    process = subprocess.Popen(
        [
            *(sys.executable, "-m", "actors.cli.fleetctl", "up", "--port", "0"),
            *("--store", str(tmp_path), "--heartbeat-interval", "0.5", "--stale-after", "3"),
        ],
        stdout=follower,
        stderr=follower,
        # As a shell runs it: pytest's LINES and COLUMNS (24 x 80) are not the terminal's.
        env={k: v for k, v in os.environ.items() if k not in ("LINES", "COLUMNS")},
    )
    os.close(follower)
    seen = b""
    try:
        deadline = time.monotonic() + 30
        while b"3 nodes, summarised" not in seen.split(b"Ctrl-C to stop.")[-1]:
            assert time.monotonic() < deadline, seen.decode(errors="replace")
            seen += os.read(leader, 65536)
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=20) == 0
    finally:
        process.kill()
        process.wait()
        os.close(leader)
    frames = seen.split(b"Ctrl-C to stop.")[-1].split(b"\x1b[J")[1:]
    assert all(frame.count(b"\n") <= 4 for frame in frames), frames
    first = next(i for i, frame in enumerate(frames) if b"3 nodes, summarised" in frame)
    assert frames[first].startswith(b"CLUSTER  ACTIVE  TOTAL\r\nlocal    3       3\r\n")


def test_a_terminal_without_a_size_gets_a_screenful(monkeypatch: pytest.MonkeyPatch) -> None:
    """A terminal reporting 0 lines (``script``, some container ttys) is one of unknown
    size: the live view gets a screenful, not one line (3 nodes summarised); a real
    height is the height less the cursor's line."""
    sizes = iter([os.terminal_size((0, 0)), os.terminal_size((80, 40))])
    monkeypatch.setattr(os, "get_terminal_size", lambda fd: next(sizes))
    assert up.view_lines(interactive=True) == tables.SUMMARY_ABOVE + 2
    assert up.view_lines(interactive=True) == 39
    assert up.view_lines(interactive=False) == tables.SUMMARY_ABOVE + 2


def test_the_live_view_fits_the_lines_it_has() -> None:
    """fleet_view: the table while it fits, else the counts by cluster and state."""
    records = [
        record_rules.accept(record_rules.pending_record(f"n{i}", "c1"), heartbeat(f"n{i}"), "U", 1)
        for i in range(10)
    ]
    assert fleet_view(records, 12).splitlines()[-1] == "10 nodes: 10 active"
    summary = fleet_view(records, 11).splitlines()
    assert summary[0].split() == ["CLUSTER", "ACTIVE", "TOTAL"]
    assert summary[-1] == "10 nodes, summarised; 'fleetctl nodes --all' lists them"
