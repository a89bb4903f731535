"""The agent's systemd unit gives SIGTERM's bounded drain time to finish: TimeoutStopSec
is above the longest stop the agent's default settings allow."""

from __future__ import annotations

import configparser
from pathlib import Path

from actors.node.agent import STOP_STEP_TIMEOUT
from actors.node.config import AgentConfig

UNIT = Path(__file__).parents[2] / "deploy" / "nats" / "systemd" / "node-agent.service"


def test_timeout_stop_sec_is_above_the_default_shutdown() -> None:
    """TimeoutStopSec exceeds the default shutdown_timeout plus stopping the actors and
    the connection, so systemd never SIGKILLs a default agent in the middle of a drain."""
    unit = configparser.ConfigParser(interpolation=None, strict=False)
    unit.optionxform = str  # type: ignore[assignment,method-assign]  # case-sensitive keys
    unit.read(UNIT)
    defaults = AgentConfig(node_id="n1")
    assert defaults.shutdown_drain and not defaults.deregister_on_shutdown
    assert defaults.shutdown_timeout == 30.0
    stop = float(unit["Service"]["TimeoutStopSec"])
    assert stop > defaults.shutdown_timeout + 2 * STOP_STEP_TIMEOUT
