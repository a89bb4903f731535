"""Bulk enrollment as operators and nodes run it: ``fleetctl enroll-token create | list |
revoke`` in real processes, ``node-agent register --enroll-token`` and the enrollment
``node-agent start --enroll-token`` does before its actors start."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from actors.cli.node_commands import enroll_at_start
from actors.node.agent import NodeAgent
from schemas import signing
from tests.support.fleet import Fleet, wait_record

BIN = Path(sys.executable).parent


async def run(tool: str, *args: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        str(BIN / tool),
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


@pytest.mark.slow
async def test_token_lifecycle_end_to_end(fleet: Fleet, operator_file: Path) -> None:
    """create prints a token; start --enroll-token makes n1 active with no hand approval;
    register --enroll-token admits n2; list shows 2/2 used up; revoke marks it revoked;
    a third node with it stays pending."""
    operator = signing.load_key_file(operator_file)
    await fleet.start_aggregator(trust_operators=[operator.public_key])
    server = ("--server", fleet.url, "--prefix", fleet.prefix)
    code, token, err = await run(
        "fleetctl",
        "enroll-token",
        "create",
        "--cluster",
        "c1",
        "--uses",
        "2",
        "--ttl",
        "1h",
        "--key-file",
        str(operator_file),
        *server,
    )
    assert code == 0, err
    token = token.strip()
    assert token.count(".") == 2 and "2 use(s), cluster c1" in err

    config = fleet.config("n1", enroll_token=token)
    await enroll_at_start(config)
    agent = NodeAgent(config)
    await agent.start()
    fleet.stack.push_async_callback(agent.stop)
    await wait_record(fleet.bus, fleet.prefix, "n1", lambda r: r.state == "active")

    state = str(fleet.state_dir / "n2")
    code, out, err = await run("node-agent", "init", "--state-dir", state)
    assert code == 0, err
    register = ("register", "--node-id", "n2", "--cluster", "c1", "--state-dir", state, *server)
    code, out, err = await run("node-agent", *register, "--enroll-token", token)
    assert (code, err) == (0, "")
    assert out.startswith("n2: active - enrolled with token ")
    token_id = out.strip().rsplit(" ", 1)[1]

    code, out, err = await run("fleetctl", "enroll-token", "list", *server)
    assert code == 0 and token_id in out and "2/2" in out and "used up" in out
    code, out, err = await run("fleetctl", "enroll-token", "revoke", token_id, *server)
    assert code == 0 and out.startswith(f"revoked {token_id}")
    code, out, err = await run("fleetctl", "enroll-token", "list", *server)
    assert "revoked" in out
    state3 = str(fleet.state_dir / "n3")
    await run("node-agent", "init", "--state-dir", state3)
    code, out, err = await run(
        "node-agent",
        "register",
        "--node-id",
        "n3",
        "--cluster",
        "c1",
        "--state-dir",
        state3,
        "--enroll-token",
        token,
        *server,
    )
    assert out.strip() == "n3: pending - enrollment token refused: revoked"


@pytest.mark.slow
async def test_operator_mistakes_are_one_line(fleet: Fleet, operator_file: Path) -> None:
    """A bad --ttl or --uses is a usage error; revoking an unknown or malformed id is one
    error line, no traceback."""
    await fleet.start_aggregator()
    server = ("--server", fleet.url, "--prefix", fleet.prefix)
    code, _, err = await run("fleetctl", "enroll-token", "create", "--ttl", "60d", *server)
    assert code == 2 and "at most 30 days" in err
    code, _, err = await run("fleetctl", "enroll-token", "create", "--uses", "0", *server)
    assert code == 2 and "must be 1 to" in err
    code, _, err = await run("fleetctl", "enroll-token", "revoke", "f" * 32, *server)
    assert (code, err) == (1, f"error: enrollment token {'f' * 32} not found\n")
    code, _, err = await run("fleetctl", "enroll-token", "revoke", "nope", *server)
    assert code == 1 and err.startswith("error: 'nope' is not a token id")
