"""Fixtures of the CLI tests that run fleetctl against a live agent."""

from __future__ import annotations

from pathlib import Path

import pytest

from actors.node.agent import NodeAgent
from schemas import signing
from tests.support.fleet import Fleet, wait_record


@pytest.fixture
def operator_file(tmp_path: Path) -> Path:
    path = tmp_path / "operator.nk"
    signing.create_key_file(path)
    return path


@pytest.fixture
async def node(fleet: Fleet, operator_file: Path) -> NodeAgent:
    """An aggregator and agent n1 (cluster c1) trusting the operator key, both active."""
    operator = signing.load_key_file(operator_file)
    await fleet.start_aggregator(trust_operators=[operator.public_key])
    agent = await fleet.start_agent(fleet.config(trust_operators=[operator.public_key]))
    await wait_record(fleet.bus, fleet.prefix, "n1", lambda r: r.state == "active")
    return agent
