"""Workload command lines: the engines' launch templates, substitution and what a node's
config allows (no processes started)."""

from __future__ import annotations

import shutil
from pathlib import Path

import msgspec
import pytest

from actors.node.config import AgentConfig
from actors.node.workloads.launch import NotAllowed, capabilities, command_line
from schemas.workloads import Deploy


def config(**settings: object) -> AgentConfig:
    return AgentConfig(state_dir="/nonexistent", **settings)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("engine", "argv"),
    [
        ("llamacpp", ["llama-server", "--host", "127.0.0.1", "--port", "9000", "-m", "/m"]),
        ("vllm", ["vllm", "serve", "/m", "--host", "127.0.0.1", "--port", "9000"]),
        (
            "sglang",
            ["python", "-m", "sglang.launch_server", "--model-path", "/m", "--host",
             "127.0.0.1", "--port", "9000"],
        ),
    ],
)  # fmt: skip
def test_engine_templates_bind_loopback(engine: str, argv: list[str]) -> None:
    """Each engine starts from its documented server command on 127.0.0.1, with --arg after."""
    deploy = Deploy(name="w", engine=engine, model="/m", args=["--x"])  # type: ignore[arg-type]
    assert command_line(config(workload_args=[f"{engine}=--x"]), deploy, 9000) == [*argv, "--x"]


def test_binary_override_and_process_substitution(tmp_path: Path) -> None:
    """ENGINE=PATH replaces an engine's binary; a process argv gets {port}, {gpus}, {model}."""
    override = config(workload_binaries=["llamacpp=/opt/llama/llama-server"])
    deploy = Deploy(name="w", engine="llamacpp", model="/m")
    assert command_line(override, deploy, 1)[0] == "/opt/llama/llama-server"
    echo = shutil.which("echo")
    assert echo is not None
    allowed = config(workload_engines=["process"], workload_binaries=[echo])
    job = Deploy(
        name="w", engine="process", gpus=[0, 2], model="m", args=["echo", "{port}:{gpus}:{model}"]
    )
    assert command_line(allowed, job, 7) == ["echo", "7:0,2:m"]


@pytest.mark.parametrize(
    ("deploy", "settings", "reason"),
    [
        (Deploy(name="w", engine="process", args=["echo"]), {}, "engine process not allowed"),
        (
            Deploy(name="w", engine="process", args=["/bin/sh", "-c", "x"]),
            {"workload_engines": ["process"], "workload_binaries": ["echo"]},
            "executable /bin/sh not in",
        ),
        (Deploy(name="w", engine="vllm"), {}, "needs --model"),
        (
            Deploy(name="w", engine="vllm", model="m", env={"PYTHONPATH": "/tmp"}),
            {},
            "environment PYTHONPATH may not be set",
        ),
        (
            Deploy(name="w", engine="llamacpp", model="m", args=["--host=0.0.0.0"]),
            {"workload_args": ["llamacpp=--host"]},
            "argument --host may not be given",
        ),
        (
            Deploy(name="w", engine="vllm", model="m", args=["--port", "80"]),
            {},
            "argument --port may not be given",
        ),
        (
            Deploy(name="w", engine="vllm", model="m", args=["--hos=0.0.0.0"]),
            {},
            "argument --hos may not be given",
        ),
        (
            Deploy(name="w", engine="sglang", model="m", args=["--trust-remote-code"]),
            {},
            "argument --trust-remote-code may not be given",
        ),
        (
            Deploy(name="w", engine="vllm", model="m", args=["--dtype", "@/tmp/args"]),
            {},
            "argument @/tmp/args may not be given",
        ),
        (
            Deploy(name="w", engine="vllm", model="m", args=["--seed", "-1e5", "--", "-inf"]),
            {},
            "argument --, -1e5, -inf may not be given",
        ),
        (
            Deploy(name="w", engine="vllm", model="--trust-remote-code"),
            {},
            "model '--trust-remote-code' starts with '-'",
        ),
    ],
    ids=[
        "process-off",
        "binary",
        "no-model",
        "env",
        "host",
        "port",
        "prefix",
        "remote-code",
        "file",
        "not-numbers",
        "model-as-flag",
    ],
)
def test_refusals(deploy: Deploy, settings: dict[str, object], reason: str) -> None:
    """What the node's config does not allow is refused with the reason."""
    with pytest.raises(NotAllowed, match=reason):
        command_line(config(**settings), deploy, 1)


@pytest.mark.parametrize(
    "name",
    ["OPENSSL_CONF", "GCONV_PATH", "HF_ENDPOINT", "https_proxy", "BROWSER", "LLAMA_ARG_HOST"],
)
@pytest.mark.parametrize("engine", ["llamacpp", "vllm", "sglang", "process"])
def test_environment_outside_the_allow_list_is_refused(engine: str, name: str) -> None:
    """Environment variables that redirect traffic or load code are refused for every
    engine, however harmless their value looks."""
    settings = {"workload_engines": [engine], "workload_binaries": ["echo"]}
    args = ["echo"] if engine == "process" else []
    deploy = Deploy(name="w", engine=engine, model="m", args=args, env={name: "x"})  # type: ignore[arg-type]
    with pytest.raises(NotAllowed, match=f"environment {name} may not be set for {engine}"):
        command_line(config(**settings), deploy, 1)


def test_allow_lists_take_whole_names_and_the_node_extends_them() -> None:
    """Listed flags (alone, with =value, with negative numbers) and variables pass; the
    node's workload_args and workload_env add names for one engine only."""
    deploy = Deploy(
        name="w",
        engine="vllm",
        model="m",
        args=["--max-model-len=4096", "-tp", "2", "--seed", "-1", "--enable-lora"],
        env={"VLLM_LOGGING_LEVEL": "DEBUG", "EXTRA_ONE": "1"},
    )
    with pytest.raises(NotAllowed, match="argument --enable-lora may not be given to vllm"):
        command_line(config(workload_env=["vllm=EXTRA_ONE"]), deploy, 1)
    with pytest.raises(NotAllowed, match="environment EXTRA_ONE may not be set for vllm"):
        command_line(config(workload_args=["vllm=--enable-lora"]), deploy, 1)
    extended = config(workload_args=["vllm=--enable-lora"], workload_env=["vllm=EXTRA_ONE"])
    assert command_line(extended, deploy, 1)[-6:] == deploy.args
    elsewhere = config(workload_args=["sglang=--enable-lora"], workload_env=["sglang=EXTRA_ONE"])
    with pytest.raises(NotAllowed):
        command_line(elsewhere, deploy, 1)


def test_config_additions_must_name_an_engine_and_a_whole_flag() -> None:
    """A workload_args entry without an engine, or one that is not a flag, is refused when
    the config is read."""
    for bad in (["--enable-lora"], ["vllm=enable-lora"], ["other=--x"], ["vllm=--a b"]):
        with pytest.raises(msgspec.ValidationError):
            msgspec.convert({"state_dir": "/x", "workload_args": bad}, AgentConfig)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"state_dir": "/x", "workload_env": ["vllm=A-B"]}, AgentConfig)


def test_capabilities_name_what_the_node_allows_and_finds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node says it can run an engine it allows whose binary it finds (an override's
    path included), ``process`` when one of its binaries is found, and
    ``container:<engine>`` for each allowed engine once an image is allowed and its
    container runtime found; nothing it does not allow or cannot find."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("llama-server", "podman", "tool"):
        script = bin_dir / name
        script.write_text("#!/bin/sh\n")
        script.chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    assert capabilities(config()) == ["llamacpp"]  # vllm and python are not on PATH
    vllm = tmp_path / "vllm"
    vllm.write_text("#!/bin/sh\n")
    vllm.chmod(0o755)
    every = config(
        workload_engines=["llamacpp", "vllm", "process"],
        workload_binaries=[f"vllm={vllm}", "tool"],
        workload_images=["registry.example/engines"],
    )
    assert capabilities(every) == [
        "llamacpp",
        "vllm",
        "process",
        "container:llamacpp",
        "container:vllm",
        "container:process",
    ]
    assert capabilities(config(workload_engines=["vllm"], workload_images=["r/x"])) == [
        "container:vllm"
    ]
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert capabilities(config(workload_images=["r/x"])) == []
