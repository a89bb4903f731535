"""Helpers for workload tests: an executable ``llama-server`` that runs the stand-in, and
the cleanup of workloads an agent leaves running (on purpose: the next agent adopts them)."""

from __future__ import annotations

import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from actors.node.workloads import processes

REPO = Path(__file__).resolve().parents[2]


def standin_script(directory: Path) -> Path:
    """``directory/llama-server``, running :mod:`tests.support.llamacpp_standin`, for the
    llama.cpp launch template (``workload_binaries = ["llamacpp=<it>"]``)."""
    directory.mkdir(parents=True, exist_ok=True)
    script = directory / "llama-server"
    module = "tests.support.llamacpp_standin"
    script.write_text(f'#!/bin/sh\nPYTHONPATH={REPO} exec {sys.executable} -m {module} "$@"\n')
    script.chmod(0o755)
    return script


@contextmanager
def killing_leftovers() -> Iterator[None]:
    """Kill the process groups of workloads started inside the block that still run."""
    before = set(processes._children)
    try:
        yield
    finally:
        for pid in set(processes._children) - before:
            processes.signal_group(pid, signal.SIGKILL)
            processes._children.pop(pid).wait(timeout=5)


def fake_podman_script(directory: Path, state: Path) -> Path:
    """``directory/podman``, running :mod:`tests.support.fake_podman` with its state in
    ``state`` (for ``workload_podman``)."""
    directory.mkdir(parents=True, exist_ok=True)
    script = directory / "podman"
    module = "tests.support.fake_podman"
    script.write_text(
        f"#!/bin/sh\nFAKE_PODMAN_DIR={state} PYTHONPATH={REPO} "
        f'exec {sys.executable} -m {module} "$@"\n'
    )
    script.chmod(0o755)
    return script
