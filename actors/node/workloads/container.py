"""Workloads in containers: a deploy with an ``image`` runs its engine's server command
(or a ``process`` deploy's argv) inside that image through ``podman run``.

Only images the node lists in ``workload_images`` run (``registry/repo`` allows any tag
or digest of it; ``registry/repo:tag`` only that tag), each an image reference in the
registry's own grammar (lowercase repository path, no ``..``, nothing that starts with
``-``); ``--`` ends podman's options before the image, so neither the image nor anything
after it (the container's own command) is read as an option. The container gets its own network
namespace with its port published on 127.0.0.1 only (``--publish 127.0.0.1:P:P``; the
engine inside listens on 0.0.0.0 of that namespace, which nothing outside reaches), no
capabilities and no new privileges; it runs as the agent's user, so rootless when the
agent is not root. GPUs go in by CDI (``--device nvidia.com/gpu=N``) where a CDI spec of
NVIDIA's is installed (``nvidia-ctk cdi generate``), else by ``NVIDIA_VISIBLE_DEVICES``
and ``CUDA_VISIBLE_DEVICES`` for the NVIDIA container hook. ``podman run`` stays in the
foreground as the workload's process (its output is the container's, it forwards
SIGTERM to it, ``--rm`` removes the container once it exits), so readiness, logs,
restarts and stops are a process's; a stop that needed SIGKILL removes the container too
(``podman rm -f``). The image is pulled first when missing (``workload_image_pull``),
each line of podman's progress a result of the deploy.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Final

from actors.node.config import AgentConfig
from schemas.workloads import Deploy

log = logging.getLogger(__name__)

CDI_DIRS: Final = (Path("/etc/cdi"), Path("/var/run/cdi"))
"""Where CDI specs live (the CDI specification's default directories)."""
PROGRESS_EVERY: Final = 1.0
"""Least seconds between two pull-progress results (the last line always goes out)."""
COMMAND_TIMEOUT: Final = 30.0
"""Seconds ``podman image exists`` and ``podman rm`` may take."""


_PATH_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_DOMAIN_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_DOMAIN = rf"{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*(?::[0-9]+)?"
_TAG = r":\w[\w.-]{0,127}"
_DIGEST = r"@[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}"
TAG_OR_DIGEST: Final = re.compile(rf"(?:{_TAG})?(?:{_DIGEST})?", re.ASCII)
REFERENCE: Final = re.compile(
    rf"(?P<name>(?:{_DOMAIN}/)?{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*){TAG_OR_DIGEST.pattern}",
    re.ASCII,
)
"""``name[:tag][@digest]`` in the grammar of distribution's ``reference`` package
(regexp.go), which podman and the registries follow."""
MAX_NAME: Final = 255
"""Characters of an image's name at most (the same package's NameTotalLengthMax)."""


class ContainerError(Exception):
    """podman could not do what the workload needs; the message says what and why."""


def is_reference(image: str) -> bool:
    """Whether ``image`` is ``name[:tag][@digest]`` in the registry's grammar."""
    match = REFERENCE.fullmatch(image)
    return match is not None and len(match["name"]) <= MAX_NAME


def allowed_image(config: AgentConfig, image: str) -> bool:
    """Whether ``image`` is on the node's ``workload_images``: the entry itself, or for an
    entry naming a repository only, that repository with a tag or digest."""
    for entry in config.workload_images:
        if image == entry:
            return True
        if ":" not in entry.rpartition("/")[2] and "@" not in entry:
            rest = image.removeprefix(entry)
            if rest != image and rest and TAG_OR_DIGEST.fullmatch(rest):
                return True
    return False


def container_name(config: AgentConfig, deploy: Deploy) -> str:
    return f"node-agent-{config.node_id}-{deploy.name}"


def cdi_available(dirs: tuple[Path, ...] = CDI_DIRS) -> bool:
    """Whether a CDI spec for NVIDIA GPUs is installed."""
    for directory in dirs:
        with contextlib.suppress(OSError):
            for path in directory.iterdir():
                if path.name.startswith("nvidia") and path.suffix in (".yaml", ".yml", ".json"):
                    return True
    return False


def run_argv(
    config: AgentConfig,
    deploy: Deploy,
    port: int,
    inner: list[str],
    cidfile: Path,
    env: dict[str, str],
    cdi: bool,
) -> list[str]:
    """``podman run`` for ``deploy``: ``inner`` is the command inside the image (empty:
    the image's own), ``env`` its environment (PORT is set to ``port``)."""
    argv = [
        config.workload_podman,
        "run",
        "--rm",
        "--replace",
        "--name",
        container_name(config, deploy),
        "--cidfile",
        str(cidfile),
        "--pull",
        "never",
        "--publish",
        f"127.0.0.1:{port}:{port}",
        "--cap-drop",
        "all",
        "--security-opt",
        "no-new-privileges",
        "--label",
        f"node-agent.workload={deploy.name}",
    ]
    gpus = ",".join(str(gpu) for gpu in deploy.gpus)
    if cdi:
        for gpu in deploy.gpus:
            argv += ["--device", f"nvidia.com/gpu={gpu}"]
    else:
        env = {**env, "NVIDIA_VISIBLE_DEVICES": gpus or "void", "CUDA_VISIBLE_DEVICES": gpus}
    for name, value in sorted({**env, "PORT": str(port)}.items()):
        argv += ["--env", f"{name}={value}"]
    # "--" ends podman's options: the image and the command after it are never options.
    return [*argv, "--", deploy.image, *inner]


def container_id(cidfile: Path) -> str:
    """The id podman wrote to ``cidfile`` ("" until it has)."""
    try:
        return cidfile.read_text().strip()[:128]
    except OSError:
        return ""


async def _podman(config: AgentConfig, *args: str) -> int:
    """Run ``podman ARGS`` quietly within COMMAND_TIMEOUT; its exit status."""
    try:
        process = await asyncio.create_subprocess_exec(
            config.workload_podman,
            *args,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
    except OSError as exc:
        raise ContainerError(f"cannot run {config.workload_podman}: {exc.strerror}") from None
    try:
        async with asyncio.timeout(COMMAND_TIMEOUT):
            return await process.wait()
    except TimeoutError:
        process.kill()
        await process.wait()
        raise ContainerError(f"podman {args[0]} took over {COMMAND_TIMEOUT:g}s") from None


async def remove(config: AgentConfig, deploy: Deploy) -> None:
    """Remove the workload's container, running or not (nothing when there is none)."""
    try:
        await _podman(config, "rm", "--force", "--time", "0", container_name(config, deploy))
    except ContainerError as exc:
        log.warning("container not removed", extra={"workload": deploy.name, "reason": str(exc)})


async def ensure_image(
    config: AgentConfig, image: str, progress: Callable[[str], Awaitable[None]]
) -> None:
    """Pull ``image`` as ``workload_image_pull`` says, each line of podman's progress
    passed to ``progress`` (at most one a PROGRESS_EVERY, and the last); ContainerError
    when it is missing and may not be pulled, or the pull fails."""
    policy = config.workload_image_pull
    if policy != "always" and await _podman(config, "image", "exists", "--", image) == 0:
        return
    if policy == "never":
        raise ContainerError(f"image {image} is not on this node (workload_image_pull = never)")
    await progress(f"pulling {image}")
    process = await asyncio.create_subprocess_exec(
        config.workload_podman,
        "pull",
        "--",
        image,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    assert process.stderr is not None
    last, said, sent_at = "", "", 0.0
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(config.workload_pull_timeout):
            while raw := await process.stderr.readline():
                line = raw.decode("utf-8", "replace").strip()
                if not line:
                    continue
                last = line
                if loop.time() - sent_at >= PROGRESS_EVERY:
                    said, sent_at = line, loop.time()
                    await progress(f"pulling {image}: {line}")
            code = await process.wait()
    except TimeoutError:
        process.kill()
        await process.wait()
        raise ContainerError(
            f"pulling {image} took over {config.workload_pull_timeout:g}s"
        ) from None
    if code != 0:
        raise ContainerError(f"pulling {image} failed (podman exit {code}): {last[-300:]}")
    if last and last != said:
        await progress(f"pulling {image}: {last}")
