"""``node-agent status`` finds an agent on a port picked for it (``fleetctl up``) through
``<state_dir>/http.port``, and prints aligned columns."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import pytest

from actors.cli.node_agent import main
from actors.cli.node_status import render_status
from actors.node.config import HTTP_PORT_FILE
from tests.support.fleet import Fleet, wait_for


async def test_status_finds_the_port_in_the_state_dir(
    fleet: Fleet, capsys: pytest.CaptureFixture[str]
) -> None:
    agent = await fleet.start_agent()
    state_dir = Path(agent.config.state_dir)
    port_file = state_dir / HTTP_PORT_FILE
    await wait_for(port_file.exists)
    assert await asyncio.to_thread(main, ["status", "--state-dir", str(state_dir)]) == 0
    assert "n1 (cluster c1)" in capsys.readouterr().out
    await agent.stop()
    assert not port_file.exists()  # a stopped agent leaves no port to knock on


def test_status_without_a_port_file_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["status", "--state-dir", str(tmp_path)]) == 1
    assert capsys.readouterr().err == (
        f"error: no agent serves HTTP from {tmp_path} (no {HTTP_PORT_FILE} there)\n"
    )


async def test_status_is_bounded_by_its_timeout_in_all(capsys: pytest.CaptureFixture[str]) -> None:
    """An "agent" that answers a byte every 0.2 s (never idle for a socket timeout) is
    given up on after --timeout in all, with the one-line reason."""

    given_up, closed = asyncio.Event(), asyncio.Event()

    async def drip(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n")
        while not given_up.is_set():
            writer.write(b"x")
            await writer.drain()
            await asyncio.sleep(0.2)  # the slow agent's pace
        writer.close()
        await writer.wait_closed()
        closed.set()

    server = await asyncio.start_server(drip, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    async with server:
        code = await asyncio.to_thread(main, ["status", "--url", url, "--timeout", "1"])
        took = time.monotonic() - started
        given_up.set()
        await asyncio.wait_for(closed.wait(), timeout=10)
        server.close()
    assert code == 1
    assert capsys.readouterr().err == f"error: the agent at {url} did not answer within 1s\n"
    assert took < 4, took  # 1000 drips would take 200 s


def test_status_columns_align() -> None:
    status = {
        "health": {
            "status": "healthy",
            "score": 98,
            "components": [
                {"name": "gpu_temperature", "points": 20, "max_points": 20, "reason": "52 C"},
                {"name": "cpu", "points": 5, "max_points": 10, "reason": "busy"},
            ],
            "checks": [
                {"name": "probe_freshness", "status": "ok", "reason": "fresh"},
                {"name": "xid", "status": "unhealthy", "reason": "XID 79"},
            ],
        },
        "actors": {
            "heartbeat": {"phase": "running", "restarts": 0, "last_error": ""},
            "http_api": {"phase": "backoff", "restarts": 12, "last_error": "OSError: x"},
        },
    }
    lines = render_status(status).splitlines()

    def starts(prefix: str) -> list[int]:
        """Where each column starts in the lines that begin with ``prefix``."""
        rows = [line for line in lines if line.startswith(prefix)]
        return [m.start() for m in re.finditer(r"(?<=  )\S", rows[0])]

    for first, second in [("  gpu_temperature", "  cpu"), ("  check probe", "  check xid")]:
        assert starts(first)[:2] == starts(second)[:2], "\n".join(lines)
    assert starts("  heartbeat")[:2] == starts("  http_api")[:2]


def test_status_shows_gpus_and_passthrough_ones() -> None:
    """Each GPU a row (temperature, utilization, memory, LOST); the passthrough ones on a
    line of their own; before the first sample, says so."""
    gpu = {
        "index": 0,
        "name": "NVIDIA H100 80GB HBM3",
        "temperature_c": 41.0,
        "utilization_pct": 99.0,
        "memory_used": 2 * 2**30,
        "memory_total": 80 * 2**30,
    }
    status = {
        "gpu_source": "nvml",
        "gpus": [gpu, {**gpu, "index": 1, "temperature_c": None, "lost": True}],
        "passthrough_gpus": [
            {"pci_bus_id": "0000:3c:00.0", "device_id": "0x2330", "name": "NVIDIA H100 80GB HBM3"}
        ],
    }
    lines = render_status(status).splitlines()
    assert "gpus      2 (nvml)" in lines
    assert [line.split() for line in lines if line.startswith("  0")] == [
        ["0", "NVIDIA", "H100", "80GB", "HBM3", "41C", "99%", "2.0/80.0", "GiB"]
    ]
    assert [line.split()[-1] for line in lines if line.startswith("  1")] == ["LOST"]
    assert "passthrough 1 bound to vfio-pci (for VMs): 0000:3c:00.0 NVIDIA H100 80GB HBM3" in lines
    assert "gpus      (not sampled yet)" in render_status({}).splitlines()
