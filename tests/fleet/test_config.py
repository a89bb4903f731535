"""The aggregator's settings come in layers like the agent's: flags > env > TOML > defaults."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from actors.fleet.config import ENV_PREFIX, AggregatorConfig
from actors.runtime.config import ConfigError, build


def test_aggregator_config_layers_flags_over_env_over_file(tmp_path: Path) -> None:
    """A flag beats FLEET_AGGREGATOR_* which beats the TOML file which beats the default."""
    file = tmp_path / "aggregator.toml"
    file.write_text('prefix = "from-file"\noffline_after = 100\nreplicas = 3\nmax_skew = 7\n')
    config = build(
        AggregatorConfig,
        ENV_PREFIX,
        file=file,
        env={"FLEET_AGGREGATOR_OFFLINE_AFTER": "200", "FLEET_AGGREGATOR_REPLICAS": "2"},
        flags={"replicas": "1"},
    )
    assert (config.prefix, config.max_skew) == ("from-file", 7.0)
    assert config.offline_after == 200.0
    assert config.replicas == 1
    assert config.sweep_interval == AggregatorConfig().sweep_interval


def test_aggregator_config_refuses_bad_values_by_name(tmp_path: Path) -> None:
    """Out-of-range, unknown and mistyped settings are ConfigErrors naming the setting."""
    with pytest.raises(ConfigError, match="http_port"):
        build(AggregatorConfig, ENV_PREFIX, env={}, flags={"http_port": "70000"})
    with pytest.raises(ConfigError, match="replicas"):
        build(AggregatorConfig, ENV_PREFIX, env={}, flags={"replicas": "0"})
    with pytest.raises(ConfigError, match="unknown environment variable FLEET_AGGREGATOR_NOPE"):
        build(AggregatorConfig, ENV_PREFIX, env={"FLEET_AGGREGATOR_NOPE": "1"})
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("offline = 3\n")
    with pytest.raises(ConfigError, match="unknown setting"):
        build(AggregatorConfig, ENV_PREFIX, file=unknown, env={})


def test_bus_outage_max_is_a_duration_from_a_second_to_a_day() -> None:
    """bus_outage_max defaults to 2m, reads durations, and refuses under 1 s or over a
    day, naming the setting."""
    assert AggregatorConfig().bus_outage_max == 120.0
    env = {"FLEET_AGGREGATOR_BUS_OUTAGE_MAX": "5m"}
    assert build(AggregatorConfig, ENV_PREFIX, env=env).bus_outage_max == 300.0
    for bad in ("0.5", "2d"):
        with pytest.raises(ConfigError, match="bus_outage_max"):
            build(AggregatorConfig, ENV_PREFIX, env={}, flags={"bus_outage_max": bad})


def test_fleetctl_aggregator_bad_setting_is_one_line_and_exit_1() -> None:
    """`fleetctl aggregator --offline-after soon` prints one error line, no traceback."""
    result = subprocess.run(
        [sys.executable, "-m", "actors.cli.fleetctl", "aggregator", "--offline-after", "soon"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 1
    assert result.stderr.startswith("error: config: offline_after:")
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr


def test_example_aggregator_config_loads() -> None:
    """deploy/nats/aggregator.example.toml is a valid AggregatorConfig for the R3 cluster
    and mentions every AggregatorConfig field, so it cannot drift from the code."""
    example = Path(__file__).resolve().parents[2] / "deploy" / "nats" / "aggregator.example.toml"
    config = build(AggregatorConfig, ENV_PREFIX, file=example, env={})
    assert config.replicas == 3 and config.server.count("nats://") == 3
    text = example.read_text()
    missing = [
        field.name
        for field in msgspec.structs.fields(AggregatorConfig)
        if not re.search(rf"^#? ?{field.name} = ", text, re.MULTILINE)
    ]
    assert missing == []
