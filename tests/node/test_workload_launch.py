"""Workload command lines: the engines' launch templates, substitution and what a node's
config allows (no processes started)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from actors.node.config import AgentConfig
from actors.node.workloads.launch import NotAllowed, command_line
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
    assert command_line(config(), deploy, 9000) == [*argv, "--x"]


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
            {},
            "--host may not be given",
        ),
        (
            Deploy(name="w", engine="vllm", model="m", args=["--port", "80"]),
            {},
            "--port may not be given",
        ),
    ],
    ids=["process-off", "binary", "no-model", "env", "host", "port"],
)
def test_refusals(deploy: Deploy, settings: dict[str, object], reason: str) -> None:
    """What the node's config does not allow is refused with the reason."""
    with pytest.raises(NotAllowed, match=reason):
        command_line(config(**settings), deploy, 1)
