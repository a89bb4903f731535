"""fleetctl up is the whole product on one machine: a remediation policy (--policy-file,
its key trusted by the agents) and labels on its agents (-l KEY=VALUE for all,
NODE:KEY=VALUE for one), so placement and rolling operations can be tried on it."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from actors.cli.fleetctl import up
from schemas import signing


def fleetctl(*args: str) -> list[str]:
    return [sys.executable, "-m", "actors.cli.fleetctl", *args]


def test_labels_parse_for_all_agents_or_one() -> None:
    """KEY=VALUE labels every agent, NODE:KEY=VALUE one (its own win); a label a node
    could not carry, or a missing '=', is refused in one line."""
    given = [up.node_label("rack=a"), up.node_label("node-2:rack=b"), up.node_label("tier=x")]
    options = up.UpOptions(store=Path("/tmp/unused"), labels=up.labels_by_node(given))
    assert up.agent_config(options, "", 1, "U").labels == {"rack": "a", "tier": "x"}
    assert up.agent_config(options, "", 2, "U").labels == {"rack": "b", "tier": "x"}
    for wrong in ("rack", "ra ck=a", "rack=a b", "no de:rack=a"):
        with pytest.raises(argparse.ArgumentTypeError):
            up.node_label(wrong)


@pytest.mark.timeout(120)
def test_up_runs_a_policy_and_labels_its_agents(tmp_path: Path) -> None:
    """`up --policy-file P -l rack=a -l node-2:tier=hi`: the banner names the policy (dry
    run), and `fleetctl nodes -l` finds the agents by those labels."""
    key_file = tmp_path / "policy.nk"
    signing.create_key_file(key_file)
    policy = tmp_path / "policy.toml"
    policy.write_text(f'key_file = "{key_file}"\nclasses = ["gpu"]\n')
    process = subprocess.Popen(
        fleetctl(
            *("up", "--nodes", "2", "--port", "0", "--store", str(tmp_path / "store")),
            *("--heartbeat-interval", "0.5", "--stale-after", "3", "--policy-file", str(policy)),
            *("-l", "rack=a", "-l", "node-2:tier=hi"),
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert process.stdout is not None
    banner: list[str] = []
    try:
        for line in process.stdout:
            banner.append(line)
            if line.startswith("Ctrl-C") or len(banner) > 20:
                break
        assert f"policy: {policy} (dry run: says what it would do; fleetctl policy status)\n" in (
            banner
        ), "".join(banner)
        server = banner[0].removeprefix("NATS: ").strip()
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETCTL_")}

        def nodes(selector: str) -> list[str]:
            listed = subprocess.run(
                fleetctl("nodes", "--server", server, "-l", selector, "-o", "json"),
                capture_output=True,
                text=True,
                timeout=30,
                env=env,
            )
            assert listed.returncode == 0, listed.stderr
            return sorted(record["node_id"] for record in json.loads(listed.stdout or "[]"))

        deadline = time.monotonic() + 30
        while nodes("rack=a") != ["node-1", "node-2"]:
            assert time.monotonic() < deadline, "".join(banner)
        assert nodes("tier=hi") == ["node-2"]
        process.send_signal(signal.SIGINT)
        process.communicate(timeout=20)
    finally:
        process.kill()
    assert process.returncode == 0
    # The dashboard's port is kept for the next up of this store (a bookmark keeps working).
    [dashboard] = [line for line in banner if line.startswith("dashboard: ")]
    port = int(dashboard.split(":")[-1].strip().rstrip("/"))
    assert up.last_port(tmp_path / "store") == port


def test_the_dashboard_port_is_kept_unless_taken(tmp_path: Path) -> None:
    """The stored port is used again while it is free; taken, unreadable or absent: 0."""
    assert up.last_port(tmp_path) == 0
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        port = holder.getsockname()[1]
        up.keep_port(tmp_path, port)
        assert up.last_port(tmp_path) == 0  # taken now
    assert up.last_port(tmp_path) == port
    (tmp_path / up.PORT_FILE).write_text("http\n")
    assert up.last_port(tmp_path) == 0
