"""Setting values as people write them: durations (one parser for flags, env and TOML),
derived defaults, comma-separated lists and KEY=VALUE maps from the environment."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import pytest

from actors.cli.fleetctl.send import POSITIVE
from actors.cli.parsing import duration
from actors.fleet.config import ENV_PREFIX as AGG_PREFIX
from actors.fleet.config import AggregatorConfig
from actors.fleet.remediation.config import load_policy
from actors.node.config import ENV_PREFIX, AgentConfig
from actors.runtime.config import ConfigError, build
from actors.runtime.durations import DurationError, parse_duration


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("30", 30.0),
        ("30s", 30.0),
        ("2m", 120.0),
        ("1h", 3600.0),
        ("500ms", 0.5),
        ("1.5", 1.5),
        ("1d", 86400.0),
        (" 10s ", 10.0),
        (7, 7.0),
        (2.5, 2.5),
    ],
)
def test_parse_duration_units(text: str | float, seconds: float) -> None:
    """Plain seconds and the ms/s/m/h/d suffixes all become seconds."""
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["2x", "-1", "inf", "nan", "1h30m", "", "s", "1e3", "True"])
def test_parse_duration_refuses_garbage(text: str) -> None:
    """Anything else is one DurationError that shows the accepted forms."""
    with pytest.raises(DurationError, match="is not a duration"):
        parse_duration(text)


def test_flag_env_and_toml_accept_units(tmp_path: Path) -> None:
    """The same forms work as a flag, a NODE_AGENT_* variable and a TOML value."""
    toml = tmp_path / "agent.toml"
    toml.write_text('sample_interval = "2m"\nprobe_timeout = 1\n')
    config = build(
        AgentConfig,
        ENV_PREFIX,
        file=toml,
        env={"NODE_AGENT_ENGINE_TIMEOUT": "500ms"},
        flags={"heartbeat_interval": "30s", "spot_safety_margin": "0"},
    )
    assert config.sample_interval == 120.0
    assert config.probe_timeout == 1.0
    assert config.engine_timeout == 0.5
    assert config.heartbeat_interval == 30.0
    assert config.spot_safety_margin == 0.0


def test_aggregator_durations_parse() -> None:
    """The aggregator's duration settings take the same forms."""
    config = build(
        AggregatorConfig,
        AGG_PREFIX,
        env={"FLEET_AGGREGATOR_OFFLINE_AFTER": "10m"},
        flags={"alert_window": "1h"},
    )
    assert (config.offline_after, config.alert_window) == (600.0, 3600.0)


def test_heartbeat_interval_alone_derives_stale_after() -> None:
    """--heartbeat-interval 30 alone is valid: stale_after follows as 3 x the interval."""
    config = build(AgentConfig, ENV_PREFIX, env={}, flags={"heartbeat_interval": "30"})
    assert (config.heartbeat_interval, config.stale_after) == (30.0, 90.0)
    default = build(AgentConfig, ENV_PREFIX, env={}, flags={})
    assert (default.heartbeat_interval, default.stale_after) == (10.0, 30.0)


def test_explicit_stale_after_still_checked() -> None:
    """A stale_after that is set wins over the derived one, and is still checked."""
    config = build(
        AgentConfig, ENV_PREFIX, env={}, flags={"heartbeat_interval": "5", "stale_after": "1m"}
    )
    assert config.stale_after == 60.0
    with pytest.raises(ConfigError, match="must be longer than"):
        build(
            AgentConfig,
            ENV_PREFIX,
            env={},
            flags={"heartbeat_interval": "1m", "stale_after": "30s"},
        )


def test_bad_duration_is_one_line_naming_the_setting() -> None:
    """A bad duration is one ConfigError line that names the setting and the value."""
    with pytest.raises(ConfigError) as caught:
        build(AgentConfig, ENV_PREFIX, env={"NODE_AGENT_SAMPLE_INTERVAL": "5 minutes"})
    message = str(caught.value)
    assert message.startswith("config: sample_interval: '5 minutes' is not a duration")
    assert "\n" not in message


def test_fleetctl_duration_arguments_share_the_parser() -> None:
    """fleetctl's --since/--ttl style arguments read the same forms and refuse the same."""
    assert duration("500ms") == 0.5
    assert POSITIVE("2m") == 120.0
    with pytest.raises(argparse.ArgumentTypeError):
        duration("0")
    with pytest.raises(argparse.ArgumentTypeError):
        POSITIVE("soon")


def test_bounded_lists_and_maps_from_env_are_split() -> None:
    """A bounded list setting (engines) and a map (labels) given as NODE_AGENT_* variables
    are split on commas (engines was passed whole and refused)."""
    config = build(
        AgentConfig,
        ENV_PREFIX,
        env={
            "NODE_AGENT_ENGINES": "vllm=http://a:1,sglang=http://b:2",
            "NODE_AGENT_LABELS": "rack=r1,gpu=h100",
        },
    )
    assert config.engines == ["vllm=http://a:1", "sglang=http://b:2"]
    assert config.labels == {"rack": "r1", "gpu": "h100"}


def test_every_steering_file_reader_checks_the_mode(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A settings file (--config of every program), a policy file and a trust file (the
    agent's and the aggregator's) that others may write are read, and warned about."""
    operator = "U" + "A" * 55
    trust = tmp_path / "trust"
    trust.write_text(f"# operators\n{operator}\n")
    settings = tmp_path / "agent.toml"
    settings.write_text(f'trust_operators_file = "{trust}"\n')
    policy = tmp_path / "policy.toml"
    policy.write_text('key_file = "k"\n')
    for path in (trust, settings, policy):
        path.chmod(0o646)
    with caplog.at_level(logging.WARNING, logger="schemas.file_modes"):
        agent = build(AgentConfig, ENV_PREFIX, file=settings, env={})
        assert agent.operator_keys() == {operator}
        aggregator = build(
            AggregatorConfig, AGG_PREFIX, env={}, base={"trust_operators_file": str(trust)}
        )
        assert aggregator.operator_keys() == {operator}
        assert load_policy(policy).key_file == "k"
    warned = {record.path for record in caplog.records}  # type: ignore[attr-defined]
    assert warned == {str(trust), str(settings), str(policy)}
