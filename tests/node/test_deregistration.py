"""Deregistration is terminal (issue 9): the agent records it in its state dir, 'node-agent
start' then exits EXIT_DEREGISTERED (which the systemd unit names), and the node comes
back only when an operator re-admits it and the node is started with --rejoin."""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

import pytest

from actors.fleet.storage.registry import approve, readmit
from actors.node import deregistration
from actors.node.deregistration import EXIT_DEREGISTERED
from actors.runtime.bus import NatsBus
from schemas import signing
from schemas.messages import Deregister
from schemas.subjects import Subjects
from tests.support.commanding import send
from tests.support.fleet import Fleet, wait_record

NODE_AGENT = str(Path(sys.executable).parent / "node-agent")
UNIT = Path(__file__).parents[2] / "deploy" / "nats" / "systemd" / "node-agent.service"


def test_the_unit_does_not_restart_a_deregistered_agent() -> None:
    """RestartPreventExitStatus= in node-agent.service names the agent's exit status."""
    values = [
        line.split("=", 1)[1].split()
        for line in UNIT.read_text().splitlines()
        if line.startswith("RestartPreventExitStatus=")
    ]
    assert values == [[str(EXIT_DEREGISTERED)]]


def test_marker_round_trip(tmp_path: Path) -> None:
    """mark, refusal names the node and the way back, clear removes it once."""
    assert deregistration.refusal(tmp_path, "n1") is None
    deregistration.mark(tmp_path, "retired", "cmd-1")
    message = deregistration.refusal(tmp_path, "n1")
    assert message is not None and "n1" in message and "retired" in message
    assert "--rejoin" in message and "\n" not in message
    assert deregistration.clear(tmp_path) and not deregistration.clear(tmp_path)
    (tmp_path / deregistration.MARKER).write_text("garbage")
    assert deregistration.refusal(tmp_path, "n1") is not None


async def start(
    fleet: Fleet, state_dir: str, operator: str, *extra: str
) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        NODE_AGENT,
        "start",
        *("--server", fleet.url, "--prefix", fleet.prefix, "--node-id", "n1"),
        *("--cluster", "c1", "--state-dir", state_dir, "--fake-gpus", "1"),
        *("--heartbeat-interval", "0.5", "--stale-after", "2", "--http-port", "0"),
        *("--trust-operator", operator),
        *extra,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )


@pytest.mark.slow
async def test_deregistered_agent_stays_down_until_readmitted_and_rejoined(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """Deregister: the agent exits EXIT_DEREGISTERED with one line; starting it again
    exits the same at once; after the operator re-admits it, 'start --rejoin' is active."""
    await fleet.start_aggregator()
    operator = signing.KeyPair.generate()
    config = fleet.config()
    key = signing.load_or_create_key_file(config.key_path)
    await approve(bus, Subjects(prefix), "n1", key.public_key)
    process = await start(fleet, config.state_dir, operator.public_key)
    try:
        await wait_record(bus, prefix, "n1", lambda r: r.state == "active")
        await send(bus, prefix, operator, Deregister(deadline=5), reason="retired")
        _, stderr = await asyncio.wait_for(process.communicate(), 30)
        assert process.returncode == EXIT_DEREGISTERED, stderr.decode()
        assert "deregistered" in stderr.decode().splitlines()[-1]
        left = await wait_record(bus, prefix, "n1", lambda r: r.state == "deregistered")

        again = await start(fleet, config.state_dir, operator.public_key)
        _, stderr = await asyncio.wait_for(again.communicate(), 30)
        assert again.returncode == EXIT_DEREGISTERED
        lines = stderr.decode().strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: node n1 deregistered")

        assert await readmit(bus, Subjects(prefix), "n1")
        process = await start(fleet, config.state_dir, operator.public_key, "--rejoin")
        # Back as it left, drained (an operator uncordons it), under a new boot.
        back = await wait_record(bus, prefix, "n1", lambda r: r.boot_id != left.boot_id)
        assert back.state == "drained" and not back.deregistered
        assert deregistration.read(Path(config.state_dir)) is None
        process.send_signal(signal.SIGTERM)
        await asyncio.wait_for(process.communicate(), 30)
        assert process.returncode == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
