"""fleetctl up --gpus-per-node real|auto: the quickstart's agents on this machine's GPUs
through NVML; real without NVML is one line, auto falls back to simulated GPUs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from actors.cli.fleetctl import up
from schemas.errors import FleetError

NVML_COUNT, NVML_ERROR = up.nvml_gpus()
NO_NVML = pytest.mark.skipif(NVML_COUNT > 0, reason="this machine has GPUs NVML can read")


def fleetctl(*args: str) -> list[str]:
    return [sys.executable, "-m", "actors.cli.fleetctl", *args]


@NO_NVML
def test_real_without_nvml_is_one_line(tmp_path: Path) -> None:
    """`up --gpus-per-node real` on a machine without NVML: exit 1 and one line saying
    NVML is unavailable (in NVML's words) and what to use instead; nothing started."""
    result = subprocess.run(
        fleetctl("up", "--gpus-per-node", "real", "--port", "0", "--store", str(tmp_path)),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 1
    assert result.stderr == (
        f"error: --gpus-per-node real: NVML is unavailable ({NVML_ERROR}); use "
        "--gpus-per-node auto (falls back to 8 simulated GPUs) or a number\n"
    )
    assert result.stdout == "" and not (tmp_path / "nats").exists()


@NO_NVML
def test_auto_without_nvml_falls_back_to_simulated_gpus(tmp_path: Path) -> None:
    """`up --gpus-per-node auto` without NVML says so in its banner and runs agents with
    8 simulated GPUs each, which `fleetctl gpus` lists."""
    process = subprocess.Popen(
        fleetctl(
            *("up", "--gpus-per-node", "auto", "--nodes", "1", "--port", "0"),
            *("--store", str(tmp_path), "--heartbeat-interval", "0.5", "--stale-after", "3"),
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert process.stdout is not None
    banner = []
    try:
        for line in process.stdout:
            banner.append(line)
            if line.startswith("Ctrl-C") or len(banner) > 20:
                break
        expected = f"GPUs: 8 simulated per agent (auto: NVML is unavailable ({NVML_ERROR}))\n"
        assert expected in banner, "".join(banner)
        server = banner[0].removeprefix("NATS: ").strip()
        rows: list[dict[str, object]] = []
        deadline = time.monotonic() + 30
        while len(rows) < 8 and time.monotonic() < deadline:
            listed = subprocess.run(
                fleetctl("gpus", "--server", server, "-o", "json"),
                capture_output=True,
                text=True,
                timeout=30,
                env={k: v for k, v in os.environ.items() if not k.startswith("FLEETCTL_")},
            )
            rows = [json.loads(line) for line in listed.stdout.splitlines()]
        assert [(row["node"], row["index"]) for row in rows] == [("node-1", i) for i in range(8)]
        process.send_signal(signal.SIGINT)
        process.communicate(timeout=20)
    finally:
        process.kill()
    assert process.returncode == 0


def test_choice_follows_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    """real and auto use NVML when it sees GPUs; auto falls back when it sees none; a
    number is simulated GPUs whatever NVML says."""
    monkeypatch.setattr(up, "nvml_gpus", lambda: (2, ""))
    assert up.choose_gpus("real") == ("real", "real: 2 from NVML, read by every agent")
    assert up.choose_gpus("auto")[0] == "real"
    assert up.choose_gpus(4) == (4, "4 simulated per agent")
    monkeypatch.setattr(up, "nvml_gpus", lambda: (0, ""))
    assert up.choose_gpus("auto") == (8, "8 simulated per agent (auto: NVML sees no GPU)")
    with pytest.raises(FleetError, match="real: NVML sees no GPU"):
        up.choose_gpus("real")


def test_real_agents_read_nvml() -> None:
    """With ``real`` the agents' fake_gpus is unset, so their inventory reads NVML."""
    options = up.UpOptions(store=Path("/tmp/x"), gpus_per_node="real")
    assert up.agent_config(options, "nats://x", 1, "").fake_gpus is None
    options = up.UpOptions(store=Path("/tmp/x"), gpus_per_node=3)
    assert up.agent_config(options, "nats://x", 1, "").fake_gpus == 3


@pytest.mark.parametrize("value", ["eight", "65", "-1", "Real"])
def test_bad_gpus_per_node_is_a_usage_error(value: str) -> None:
    """Anything but real, auto or 0..64 is refused before anything starts (exit 2)."""
    result = subprocess.run(
        fleetctl("up", "--gpus-per-node", value), capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 2
    assert "use real, auto or a number from 0 to 64" in result.stderr
