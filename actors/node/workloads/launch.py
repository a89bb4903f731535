"""Command lines of workloads: the engines' launch templates and what a node allows.

Every engine is bound to 127.0.0.1 (the node's gateway and probes reach it there; nothing
outside the host does). The templates follow each engine's documented server command:
llama.cpp ``llama-server --host --port -m`` (tools/server/README.md), vLLM ``vllm serve
MODEL --host --port``, SGLang ``python -m sglang.launch_server --model-path --host --port``.
A ``process`` runs the deploy's own argv, with ``{port}``, ``{gpus}`` and ``{model}``
substituted, and only when the node lists both the ``process`` engine and the executable.
What a deploy adds (engine flags, environment) is checked against per-engine allow-lists
the node's config extends; where the workload then listens is checked by
:mod:`actors.node.workloads.listeners`.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from actors.node.config import AgentConfig
from actors.node.workloads.container import allowed_image, is_reference
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


ENGINE_ARGS: dict[str, frozenset[str]] = {
    "llamacpp": frozenset(
        "-c --ctx-size -n --n-predict -b --batch-size -ub --ubatch-size -t --threads "
        "-tb --threads-batch -ngl --gpu-layers --n-gpu-layers -sm --split-mode "
        "-ts --tensor-split -mg --main-gpu -fa --flash-attn -np --parallel "
        "-cb --cont-batching -nocb --no-cont-batching -ctk --cache-type-k "
        "-ctv --cache-type-v --mlock --no-mmap --numa -a --alias --metrics --slots "
        "--no-slots -to --timeout --threads-http -s --seed --temp --top-k --top-p --min-p "
        "--rope-scaling --rope-freq-base --rope-freq-scale --cache-reuse --jinja "
        "--reasoning-format -lv --log-verbosity --log-disable --log-colors --log-prefix "
        "--log-timestamps".split()
    ),
    "vllm": frozenset(
        "-tp --tensor-parallel-size -pp --pipeline-parallel-size -dp --data-parallel-size "
        "--max-model-len --gpu-memory-utilization --max-num-seqs --max-num-batched-tokens "
        "--dtype -q --quantization --kv-cache-dtype --enforce-eager --seed "
        "--served-model-name --block-size --swap-space --cpu-offload-gb "
        "--enable-prefix-caching --no-enable-prefix-caching --enable-chunked-prefill "
        "--no-enable-chunked-prefill --disable-log-requests --disable-log-stats "
        "--max-logprobs --uvicorn-log-level --disable-custom-all-reduce "
        "--enable-expert-parallel".split()
    ),
    "sglang": frozenset(
        "--tp-size --tensor-parallel-size --dp-size --data-parallel-size "
        "--mem-fraction-static --context-length --max-running-requests --max-total-tokens "
        "--max-prefill-tokens --chunked-prefill-size --dtype --quantization "
        "--kv-cache-dtype --random-seed --served-model-name --disable-cuda-graph "
        "--cuda-graph-max-bs --schedule-policy --schedule-conservativeness --log-level "
        "--log-requests --attention-backend --enable-torch-compile --disable-radix-cache "
        "--stream-interval".split()
    ),
    "process": frozenset(),
}
"""Flags a deploy may add to an engine's template, each matched exactly (a flag, or
``flag=value``): argparse takes any unambiguous prefix of a flag (``--hos`` for
``--host``), so only whole names on this list pass. Left out on purpose: where the
engine listens (``--host``, ``--port``, ``--uds``, TLS), what makes it load or run code
of the sender's choosing (``--trust-remote-code``, ``--chat-template``, ``--lora``,
``--middleware``, ``--config``, tokenizer and download locations), files it writes
(``--slot-save-path``, ``--log-file``), and what it fetches (``-hf``, ``--model-url``).
A node adds to it with ``workload_args`` (``ENGINE=FLAG``). A ``process`` deploy's argv
is its own: the node allows its executable instead."""

COMMON_ENV = frozenset(
    "OMP_NUM_THREADS MKL_NUM_THREADS TOKENIZERS_PARALLELISM HF_HUB_OFFLINE "
    "TRANSFORMERS_OFFLINE HF_DATASETS_OFFLINE HF_HUB_DISABLE_TELEMETRY NCCL_DEBUG "
    "NCCL_P2P_DISABLE NCCL_IB_DISABLE CUDA_LAUNCH_BLOCKING CUDA_DEVICE_MAX_CONNECTIONS "
    "PYTORCH_CUDA_ALLOC_CONF".split()
)
ENGINE_ENV: dict[str, frozenset[str]] = {
    "llamacpp": COMMON_ENV | {"LLAMA_LOG_VERBOSITY", "LLAMA_LOG_COLORS", "LLAMA_LOG_PREFIX"},
    "vllm": COMMON_ENV
    | {
        "VLLM_LOGGING_LEVEL",
        "VLLM_ATTENTION_BACKEND",
        "VLLM_USE_V1",
        "VLLM_NO_USAGE_STATS",
        "VLLM_DO_NOT_TRACK",
        "VLLM_WORKER_MULTIPROC_METHOD",
        "VLLM_ENGINE_ITERATION_TIMEOUT_S",
    },
    "sglang": COMMON_ENV,
    "process": COMMON_ENV,
}
"""Environment variables a deploy may set, by exact name: threads, offline switches,
NCCL and allocator tuning. Everything else is refused, among it what runs code or loads
files of the sender's choosing (``LD_PRELOAD``, ``PYTHONPATH``, ``OPENSSL_CONF``,
``GCONV_PATH``, ``BROWSER``), redirects downloads or traffic (``HF_ENDPOINT``,
``https_proxy``), an engine's own flags in environment form (``LLAMA_ARG_HOST``) and the
GPU pinning the node does (``CUDA_VISIBLE_DEVICES``). A node adds to it with
``workload_env`` (``ENGINE=NAME``)."""

LOOPBACK_ENV = {"NCCL_SOCKET_IFNAME": "lo", "GLOO_SOCKET_IFNAME": "lo"}
"""Set for every workload: NCCL's and Gloo's bootstrap sockets (an engine split over
several GPUs opens them) listen on the first non-loopback interface unless told, and a
workload listening beyond loopback is stopped (:mod:`actors.node.workloads.listeners`).
One node needs no other interface for them."""

BIND_FLAGS = frozenset({"--host", "--port"})
"""Never allowed, whatever a node's ``workload_args`` say: engines listen on 127.0.0.1 at
the port the node allocates."""


CONTAINER_HOST = "0.0.0.0"
"""Where an engine in a container listens: every address of the container's own network
namespace, reached only through the port podman publishes on 127.0.0.1."""


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


def capabilities(config: AgentConfig) -> list[str]:
    """What this node can run, as its heartbeat says (``Heartbeat.capabilities``): each
    engine it allows whose binary it finds (the ``ENGINE=PATH`` override, else the
    engine's own name, on PATH; ``process``: one of its workload_binaries), and
    ``container:<engine>`` for each engine it allows where it allows an image and finds
    its container runtime (``workload_podman``). Found, not proven: a binary may still
    fail to start, which the deploy's result says. (SGLang's binary is the Python that
    runs it: a Python without SGLang passes here.)"""
    found: list[str] = []
    binaries = overrides(config)
    for engine in config.workload_engines:
        if engine == "process":
            runnable = any(shutil.which(entry) for entry in allowed_executables(config))
        else:
            runnable = shutil.which(binaries.get(engine, ENGINE_BINARIES[engine])) is not None
        if runnable:
            found.append(engine)
    if config.workload_images and shutil.which(config.workload_podman):
        found += [f"container:{engine}" for engine in config.workload_engines]
    return found


def substitute(arg: str, port: int, deploy: Deploy) -> str:
    return (
        arg.replace("{port}", str(port))
        .replace("{gpus}", ",".join(str(gpu) for gpu in deploy.gpus))
        .replace("{model}", deploy.model)
    )


def _additions(entries: list[str], engine: str) -> set[str]:
    """The values of ``ENGINE=VALUE`` entries for ``engine``."""
    found = set()
    for entry in entries:
        name, _, value = entry.partition("=")
        if name == engine:
            found.add(value)
    return found


def check_env(config: AgentConfig, deploy: Deploy) -> None:
    """NotAllowed unless every variable ``deploy`` sets is on its engine's allow-list."""
    allowed = ENGINE_ENV[deploy.engine] | _additions(config.workload_env, deploy.engine)
    refused = sorted(name for name in deploy.env if name not in allowed)
    if refused:
        raise NotAllowed(
            f"environment {', '.join(refused)} may not be set for {deploy.engine}: not on "
            "the node's allow-list (the node's workload_env adds names)"
        )


def check_args(config: AgentConfig, deploy: Deploy) -> None:
    """NotAllowed unless every flag among ``deploy``'s extra arguments is on its engine's
    allow-list by its whole name; values (words not starting with ``-``, and numbers) pass."""
    allowed = ENGINE_ARGS[deploy.engine] | _additions(config.workload_args, deploy.engine)
    allowed -= BIND_FLAGS
    refused = []
    for arg in deploy.args:
        if arg.startswith("@"):  # an argparse file of arguments, if the engine reads them
            refused.append(arg)
        if not arg.startswith("-") or _is_number(arg):
            continue
        flag = arg.partition("=")[0]
        if flag not in allowed:
            refused.append(flag)
    if refused:
        raise NotAllowed(
            f"argument {', '.join(sorted(set(refused)))} may not be given to {deploy.engine}: "
            "not on the node's allow-list (whole flag names; the node's workload_args adds "
            "flags; it picks host and port)"
        )


def check_model(deploy: Deploy) -> None:
    """NotAllowed unless an engine's deploy names a model that no engine reads as an
    option (``vllm serve`` takes it as a positional, so ``--trust-remote-code`` would be
    one, past the flags' allow-list)."""
    if not deploy.model:
        raise NotAllowed(f"engine {deploy.engine} needs --model")
    if deploy.model.startswith("-"):
        raise NotAllowed(
            f"model {deploy.model!r} starts with '-' (an engine would read it as an option)"
        )


NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")
"""What argparse takes for a negative number rather than a flag (its own pattern)."""


def _is_number(arg: str) -> bool:
    return NEGATIVE_NUMBER.match(arg) is not None


def command_line(config: AgentConfig, deploy: Deploy, port: int) -> list[str]:
    """The argv to start ``deploy`` on ``port`` (for a deploy with an image, the command
    inside it); NotAllowed when the node forbids it."""
    if deploy.engine not in config.workload_engines:
        allowed = ", ".join(config.workload_engines) or "none"
        raise NotAllowed(f"engine {deploy.engine} not allowed on this node (allowed: {allowed})")
    check_env(config, deploy)
    if deploy.image:
        return _in_image(config, deploy, port)
    if deploy.engine == "process":
        if not deploy.args:
            raise NotAllowed("a process workload needs its command line (--arg)")
        argv = [substitute(arg, port, deploy) for arg in deploy.args]
        resolved = shutil.which(argv[0])
        candidates = {argv[0], str(Path(resolved).resolve()) if resolved else argv[0]}
        if not candidates & allowed_executables(config):
            raise NotAllowed(f"executable {argv[0]} not in this node's workload_binaries")
        return argv
    check_model(deploy)
    check_args(config, deploy)
    binary = overrides(config).get(deploy.engine, ENGINE_BINARIES[deploy.engine])
    template = [substitute(arg, port, deploy) for arg in TEMPLATES[deploy.engine]]
    return [binary, *template, *(substitute(arg, port, deploy) for arg in deploy.args)]


def _in_image(config: AgentConfig, deploy: Deploy, port: int) -> list[str]:
    """The command inside an allowed image: the engine's server listening on every
    address of the container's own network namespace (podman publishes the port on
    127.0.0.1 only), or a ``process`` deploy's argv (none: the image's own command)."""
    if not is_reference(deploy.image):
        raise NotAllowed(
            f"image {deploy.image!r} is not an image reference (name[:tag][@digest]: a "
            "lowercase repository path, no '..', nothing starting with '-')"
        )
    if not allowed_image(config, deploy.image):
        raise NotAllowed(f"image {deploy.image} not in this node's workload_images")
    if deploy.engine == "process":
        return [substitute(arg, port, deploy) for arg in deploy.args]
    check_model(deploy)
    check_args(config, deploy)
    template = [
        CONTAINER_HOST if arg == "127.0.0.1" else substitute(arg, port, deploy)
        for arg in TEMPLATES[deploy.engine]
    ]
    extra = [substitute(arg, port, deploy) for arg in deploy.args]
    return [ENGINE_BINARIES[deploy.engine], *template, *extra]
