"""Command lines of workloads: the engines' launch templates and what a node allows.

Every engine is bound to 127.0.0.1 (the node's gateway and probes reach it there; nothing
outside the host does). The templates follow each engine's documented server command:
llama.cpp ``llama-server --host --port -m`` (tools/server/README.md), vLLM ``vllm serve
MODEL --host --port``, SGLang ``python -m sglang.launch_server --model-path --host --port``.
A ``process`` runs the deploy's own argv, with ``{port}``, ``{gpus}`` and ``{model}``
substituted, and only when the node lists both the ``process`` engine and the executable.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from actors.node.config import AgentConfig
from schemas.workloads import Deploy

ENGINE_BINARIES: dict[str, str] = {"llamacpp": "llama-server", "vllm": "vllm", "sglang": "python"}
TEMPLATES: dict[str, list[str]] = {
    "llamacpp": ["--host", "127.0.0.1", "--port", "{port}", "-m", "{model}"],
    "vllm": ["serve", "{model}", "--host", "127.0.0.1", "--port", "{port}"],
    "sglang": [
        "-m",
        "sglang.launch_server",
        "--model-path",
        "{model}",
        "--host",
        "127.0.0.1",
        "--port",
        "{port}",
    ],
}


UNSAFE_ENV_PREFIXES = ("LD_", "DYLD_", "PYTHON", "BASH_", "CUDA_VISIBLE_", "NVIDIA_VISIBLE_")
UNSAFE_ENV = {"PATH", "ENV", "SHELLOPTS", "PERL5OPT", "NODE_OPTIONS", "HOME"}
"""Environment a deploy may not set: what makes the loader or an interpreter run code of
the sender's choosing (LD_PRELOAD, PYTHONPATH, ...), and the GPU pinning the node does."""


BIND_FLAGS = ("--host", "--port")
"""Engine flags a deploy's extra arguments may not give: the engines' last ``--host`` wins,
so ``--arg --host=0.0.0.0`` would expose the engine beyond the node."""


class NotAllowed(Exception):
    """The node's config does not let this deploy run; the message says why."""


def overrides(config: AgentConfig) -> dict[str, str]:
    """``ENGINE=PATH`` entries of workload_binaries."""
    found = {}
    for entry in config.workload_binaries:
        engine, sep, path = entry.partition("=")
        if sep and engine in ENGINE_BINARIES:
            found[engine] = path
    return found


def allowed_executables(config: AgentConfig) -> set[str]:
    """The executables a ``process`` workload may start: each listed one as written and as
    found on PATH, so ``podman`` allows ``/usr/bin/podman`` and the other way round."""
    allowed = set()
    for entry in config.workload_binaries:
        if "=" in entry and entry.partition("=")[0] in ENGINE_BINARIES:
            continue
        allowed.add(entry)
        resolved = shutil.which(entry)
        if resolved:
            allowed.add(str(Path(resolved).resolve()))
    return allowed


def substitute(arg: str, port: int, deploy: Deploy) -> str:
    return (
        arg.replace("{port}", str(port))
        .replace("{gpus}", ",".join(str(gpu) for gpu in deploy.gpus))
        .replace("{model}", deploy.model)
    )


def command_line(config: AgentConfig, deploy: Deploy, port: int) -> list[str]:
    """The argv to start ``deploy`` on ``port``; NotAllowed when the node forbids it."""
    unsafe = sorted(
        name for name in deploy.env if name in UNSAFE_ENV or name.startswith(UNSAFE_ENV_PREFIXES)
    )
    if unsafe:
        raise NotAllowed(f"environment {', '.join(unsafe)} may not be set by a deploy")
    if deploy.engine not in config.workload_engines:
        allowed = ", ".join(config.workload_engines) or "none"
        raise NotAllowed(f"engine {deploy.engine} not allowed on this node (allowed: {allowed})")
    if deploy.engine == "process":
        if not deploy.args:
            raise NotAllowed("a process workload needs its command line (--arg)")
        argv = [substitute(arg, port, deploy) for arg in deploy.args]
        resolved = shutil.which(argv[0])
        candidates = {argv[0], str(Path(resolved).resolve()) if resolved else argv[0]}
        if not candidates & allowed_executables(config):
            raise NotAllowed(f"executable {argv[0]} not in this node's workload_binaries")
        return argv
    if not deploy.model:
        raise NotAllowed(f"engine {deploy.engine} needs --model")
    rebinding = sorted(
        {arg.split("=")[0] for arg in deploy.args if arg.split("=")[0] in BIND_FLAGS}
    )
    if rebinding:
        raise NotAllowed(
            f"{', '.join(rebinding)} may not be given: engines listen on 127.0.0.1 at the "
            "port the node allocates (use --port)"
        )
    binary = overrides(config).get(deploy.engine, ENGINE_BINARIES[deploy.engine])
    template = [substitute(arg, port, deploy) for arg in TEMPLATES[deploy.engine]]
    return [binary, *template, *(substitute(arg, port, deploy) for arg in deploy.args)]
