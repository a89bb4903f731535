"""Every list setting of both programs works as a flag, repeated or comma-separated, under
each of its spellings, and as a variable; an empty item is one clear line. The walk reads
the parsers themselves, so a list setting added later is covered (or fails for want of
sample items)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

import msgspec
import pytest

from actors.cli import node_agent
from actors.cli.common import settings_from
from actors.cli.fleetctl import main as fleetctl
from actors.cli.fleetctl.aggregator import aggregator_settings
from actors.fleet.config import ENV_PREFIX as AGGREGATOR_ENV_PREFIX
from actors.fleet.config import AggregatorConfig
from actors.node.config import ENV_PREFIX as AGENT_ENV_PREFIX
from actors.node.config import AgentConfig
from actors.runtime.config import ConfigError, build, list_fields
from tests.cli.test_keys_help import parsers

SAMPLES: dict[str, tuple[str, str]] = {
    "engines": ("vllm=http://127.0.0.1:8000", "sglang=http://127.0.0.1:30000"),
    "gpu_thresholds": ("pcie_replays_per_min=20", "persistence_off=off"),
    "labels": ("rack=r1", "gpu=h100"),
    "peers": ("node-2", "node-3"),
    "required_binaries": ("nvidia-smi", "slurmd"),
    "required_modules": ("nvidia", "nvidia_uvm"),
    "trust_operators": ("UA" + "A" * 54, "UB" + "B" * 54),
    "version_programs": ("nvidia-smi", "podman"),
    "workload_args": ("vllm=--enable-lora", "sglang=--trust-remote-code"),
    "workload_binaries": ("/usr/bin/true", "llamacpp=/opt/llama/llama-server"),
    "workload_engines": ("llamacpp", "process"),
    "workload_env": ("vllm=VLLM_USE_DEEP_GEMM", "process=OMP_NUM_THREADS"),
    "workload_images": ("registry.example/vllm", "registry.example/sglang:v1"),
    "alertmanager_urls": ("http://am-1:9093", "http://am-2:9093"),
    "http_public_names": ("fleet.example.com", "dash.example.com"),
    "workloads_operators": ("UC" + "C" * 54, "UD" + "D" * 54),
    "xid_thresholds": ("13=5/600", "79=1/60"),
}
"""Two valid items of each list setting."""

Settings = Callable[[argparse.Namespace], msgspec.Struct]
PROGRAMS: list[tuple[str, argparse.ArgumentParser, type[msgspec.Struct], str, Settings]] = [
    (
        "node-agent start",
        node_agent.parser(),
        AgentConfig,
        AGENT_ENV_PREFIX,
        lambda args: settings_from(args, AgentConfig, AGENT_ENV_PREFIX),
    ),
    (
        "node-agent register",
        node_agent.parser(),
        AgentConfig,
        AGENT_ENV_PREFIX,
        lambda args: settings_from(args, AgentConfig, AGENT_ENV_PREFIX),
    ),
    (
        "fleetctl aggregator",
        fleetctl.parser(),
        AggregatorConfig,
        AGGREGATOR_ENV_PREFIX,
        aggregator_settings,
    ),
]


def list_flags() -> list[tuple[str, str, str]]:
    """(program, setting, flag) for every spelling of every list setting's flag."""
    found = []
    for program, root, config_type, _, _ in PROGRAMS:
        parser = dict(parsers(root, root.prog))[program]
        lists = list_fields(config_type)
        spelled = {
            (action.dest, flag)
            for action in parser._actions
            if action.dest in lists
            for flag in action.option_strings
        }
        assert {dest for dest, _ in spelled} == lists, f"{program}: a list setting has no flag"
        found += [(program, dest, flag) for dest, flag in sorted(spelled)]
    return found


FLAGS = list_flags()


def program(name: str) -> tuple[argparse.ArgumentParser, type[msgspec.Struct], str, Settings]:
    [(root, config_type, prefix, settings)] = [p[1:] for p in PROGRAMS if p[0] == name]
    return root, config_type, prefix, settings


def expected(setting: str, items: tuple[str, ...]) -> object:
    if setting == "labels":
        return dict(item.split("=") for item in items)
    return list(items)


@pytest.fixture(autouse=True)
def no_setting_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    """The settings come from the flags alone, whatever the environment holds."""
    for name in list(os.environ):
        if name.startswith((AGENT_ENV_PREFIX, AGGREGATOR_ENV_PREFIX, "FLEETCTL_", "NATS_URL")):
            monkeypatch.delenv(name)


def test_every_list_setting_has_samples() -> None:
    """The walk below knows two valid items of every list setting of both programs."""
    assert list_fields(AgentConfig) | list_fields(AggregatorConfig) == set(SAMPLES)
    assert {setting for _, setting, _ in FLAGS} == set(SAMPLES)


@pytest.mark.parametrize(("name", "setting", "flag"), FLAGS, ids=lambda v: str(v))
def test_list_flag_repeated_and_comma_separated(name: str, setting: str, flag: str) -> None:
    """``FLAG a FLAG b``, ``FLAG a,b`` and ``FLAG a,b FLAG a`` give the setting those
    items, in order."""
    root, _, _, settings = program(name)
    command = name.split()[1:]
    first, second = SAMPLES[setting]
    repeated = root.parse_args([*command, flag, first, flag, second])
    assert getattr(settings(repeated), setting) == expected(setting, (first, second))
    joined = root.parse_args([*command, flag, f"{first},{second}"])
    assert getattr(settings(joined), setting) == expected(setting, (first, second))
    if setting != "labels":  # a mapping keeps one value per key
        both = root.parse_args([*command, flag, f"{first},{second}", flag, first])
        assert getattr(settings(both), setting) == [first, second, first]


@pytest.mark.parametrize(("name", "setting", "flag"), FLAGS, ids=lambda v: str(v))
@pytest.mark.parametrize("shape", ["{a},,{b}", "{a},", ",{a}", "", " , "])
def test_list_flag_with_an_empty_item_is_one_line(
    name: str, setting: str, flag: str, shape: str
) -> None:
    """A flag value with an empty item (a stray comma, nothing at all) is refused in one
    line that names the setting and says what is wrong."""
    root, _, _, settings = program(name)
    first, second = SAMPLES[setting]
    value = shape.format(a=first, b=second)
    args = root.parse_args([*name.split()[1:], flag, value])
    with pytest.raises(ConfigError) as caught:
        settings(args)
    message = str(caught.value)
    assert message == (
        f"config: {setting}: {value!r} has an empty item; give items comma-separated (a,b) "
        "or repeat the flag"
    )


@pytest.mark.parametrize(
    ("config_type", "prefix", "setting"),
    [
        (config_type, prefix, setting)
        for config_type, prefix in (
            (AgentConfig, AGENT_ENV_PREFIX),
            (AggregatorConfig, AGGREGATOR_ENV_PREFIX),
        )
        for setting in sorted(list_fields(config_type))
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_list_variable_comma_separated(
    config_type: type[msgspec.Struct], prefix: str, setting: str
) -> None:
    """A list setting's variable reads ``a,b`` as those items, empty as none, and refuses
    ``a,,b`` in one line naming the variable."""
    variable = f"{prefix}{setting.upper()}"
    first, second = SAMPLES[setting]
    config = build(config_type, prefix, env={variable: f"{first},{second}"})
    assert getattr(config, setting) == expected(setting, (first, second))
    assert not getattr(build(config_type, prefix, env={variable: ""}), setting)
    with pytest.raises(ConfigError, match=rf"^config: {variable}: .* has an empty item; [^\n]*$"):
        build(config_type, prefix, env={variable: f"{first},,{second}"})
