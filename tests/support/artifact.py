"""The single-file artifact for tests: built once a run by ``deploy.build`` (offline,
from this environment) and shared by the run's workers, and run by a fresh Python that
has none of our packages."""

from __future__ import annotations

import fcntl
import importlib.util
import os
import subprocess
import venv
from dataclasses import dataclass
from pathlib import Path

import pytest

from deploy.build import build

RUN_TIMEOUT = 120


def build_or_skip(output: Path) -> Path:
    """The artifact built into ``output``; a skip, saying why, where the build tools are
    missing (``pip install -e '.[test]'`` brings them)."""
    for module in ("shiv", "packaging", "setuptools"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed here (pip install -e '.[test]')")
    return build(output)


def built_once(run: Path) -> Path:
    """The artifact in ``run``/artifact, built there by the first worker that asks: the
    others wait for it under a lock and take it (a build costs about 6.5 CPU-s; each of
    three workers made its own). Built aside and renamed, so a build that fails leaves
    nothing half-written for the next to take."""
    shared = run / "artifact"
    with (run / "artifact.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not shared.is_dir():
            aside = run / f"artifact-{os.getpid()}"
            build_or_skip(aside)
            aside.rename(shared)
    [artifact] = shared.glob("*.pyz")
    return artifact


@dataclass(frozen=True)
class Fresh:
    """A Python with no packages of ours (a new venv without pip), the environment a new
    machine gives it (no venv on PATH, a home and SHIV_ROOT of its own), and the artifact."""

    python: Path
    artifact: Path
    env: dict[str, str]

    def argv(self, *args: str) -> list[str]:
        """The command line that runs the artifact: isolated mode, so no variable or user
        site-packages of this machine reaches it."""
        return [str(self.python), "-I", str(self.artifact), *args]

    def run(self, *args: str, timeout: float = RUN_TIMEOUT) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.argv(*args),
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def popen(self, *args: str, log: Path) -> subprocess.Popen[bytes]:
        """A long-running program of the artifact, its output into ``log``."""
        with log.open("wb") as sink:
            return subprocess.Popen(self.argv(*args), env=self.env, stdout=sink, stderr=sink)


def fresh_python(where: Path, artifact: Path) -> Fresh:
    venv.EnvBuilder(with_pip=False).create(where / "venv")
    home = where / "home"
    home.mkdir()
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(home),
        "LANG": "C.UTF-8",
        "SHIV_ROOT": str(where / "shiv"),
    }
    return Fresh(where / "venv" / "bin" / "python", artifact, env)
