"""deploy/install/Containerfile, built with the real podman from the artifact, as its
header says, on a base made here from this machine's own Python (no base image can be
downloaded here). ``podman run`` cannot start containers in this sandbox, so the test
runs what the image would: its entrypoint and environment, as its user, chrooted into
the image's mounted file system, with ``podman run``'s arguments in place of its CMD; the
aggregator that starts there takes the heartbeat partitions of a real nats-server. Skips,
saying why, where podman is missing or cannot build."""

from __future__ import annotations

import asyncio
import io
import json
import shutil
import subprocess
import sys
import tarfile
import uuid
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from actors.runtime.embedded import NatsServer
from tests.support.fleet import wait_for

ROOT = Path(__file__).resolve().parents[2]
CONTAINERFILE = ROOT / "deploy" / "install" / "Containerfile"
PYTHON = Path(f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}")
STDLIB = Path(f"/usr/lib/python{sys.version_info.major}.{sys.version_info.minor}")
TIMEOUT = 300
CHROOT = shutil.which("chroot") or "/usr/sbin/chroot"


def podman(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["podman", *args], capture_output=True, text=True, timeout=TIMEOUT, check=False
    )


def libraries(programs: list[Path]) -> set[Path]:
    """The shared libraries (and the loader) these programs load, as ldd names them."""
    found: set[Path] = set()
    for program in programs:
        listed = subprocess.run(["ldd", str(program)], capture_output=True, text=True, timeout=60)
        for line in listed.stdout.splitlines():
            words = line.split()
            path = words[2] if "=>" in words and len(words) > 2 else words[0]
            if path.startswith("/"):
                found.add(Path(path))
    return found


def compiled_modules(artifact: Path, where: Path) -> list[Path]:
    """The artifact's compiled modules, extracted to ``where`` (for ldd)."""
    with zipfile.ZipFile(artifact) as archive:
        names = [name for name in archive.namelist() if ".so" in Path(name).suffixes]
        return [Path(archive.extract(name, where)) for name in names]


def python_rootfs(tarball: Path, artifact: Path) -> None:
    """A root file system with this machine's Python: the interpreter, its standard
    library (less what an aggregator never imports), the libraries they and the
    artifact's compiled modules load, a /tmp and the users root and nobody."""
    skip = {"__pycache__", "dist-packages", "site-packages", "idlelib", "tkinter", "ensurepip"}
    extensions = sorted((STDLIB / "lib-dynload").glob("*.so"))
    extensions += compiled_modules(artifact, tarball.parent / "modules")
    with tarfile.open(tarball, "w") as archive:

        def add(path: Path, name: str | None = None) -> None:
            archive.add(path.resolve(), arcname=name or str(path), recursive=False)

        for folder in ("tmp", "etc"):
            info = tarfile.TarInfo(folder)
            info.type, info.mode = tarfile.DIRTYPE, 0o1777 if folder == "tmp" else 0o755
            archive.addfile(info)
        for name, text in (
            ("etc/passwd", "root:x:0:0::/root:/bin/sh\nnobody:x:65534:65534::/:/bin/false\n"),
            ("etc/group", "root:x:0:\nnogroup:x:65534:\n"),
        ):
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            archive.addfile(info, io.BytesIO(data))
        add(PYTHON)
        for library in sorted(libraries([PYTHON, *extensions])):
            add(library)
        for path in sorted(STDLIB.rglob("*")):
            if not skip & set(path.relative_to(STDLIB).parts):
                add(path)


@pytest.fixture
def image(artifact: Path, tmp_path: Path) -> Iterator[dict[str, Any]]:
    """The Containerfile built as its header says (context: the artifact's folder), on a
    base of this machine's Python; yields its config and the file system of a container
    created from it (``podman create``, mounted: writable, as a running one's is)."""
    if shutil.which("podman") is None:
        pytest.skip("podman is not installed (Debian's podman; .ci/run adds it)")
    tag = uuid.uuid4().hex[:12]
    base, built = f"localhost/nna-test-python:{tag}", f"localhost/nna-test-aggregator:{tag}"
    container = f"nna-test-aggregator-{tag}"
    tarball = tmp_path / "python.tar"
    python_rootfs(tarball, artifact)
    steps = [
        ("import", ["import", "--change", "ENV PATH=/usr/local/bin:/usr/bin:/bin",
                    str(tarball), base]),
        ("build", ["build", "-q", "-f", str(CONTAINERFILE), "--build-arg", f"BASE={base}",
                   "-t", built, str(artifact.parent)]),
    ]  # fmt: skip
    try:
        for what, args in steps:
            done = podman(*args)
            if done.returncode != 0:
                reason = f"podman {what} fails here: {done.stderr.strip()[-300:]}"
                print(f"SKIPPED (podman): {reason}")
                pytest.skip(reason)
        (config,) = json.loads(podman("image", "inspect", built).stdout)
        created = podman("create", "--name", container, built)
        mounted = podman("mount", container)
        if created.returncode != 0 or mounted.returncode != 0:
            reason = (created.stderr + mounted.stderr).strip()[-300:]
            pytest.skip(f"podman create and mount fail here: {reason}")
        yield {"config": config["Config"], "root": Path(mounted.stdout.strip())}
    finally:
        podman("umount", container)
        podman("rm", "--force", container)
        podman("rmi", "--force", built, base)


def check_image(config: dict[str, Any], root: Path, artifact: Path) -> dict[str, str]:
    """What the Containerfile promises of the image; returns its environment."""
    assert config["User"] == "65534:65534" and "9092/tcp" in config["ExposedPorts"]
    assert config["Cmd"] == ["--config", "/etc/fleetctl/aggregator.toml"]
    installed = root / "opt/nats-node-agent/nats-node-agent.pyz"
    assert installed.read_bytes() == artifact.read_bytes()
    env = dict(entry.split("=", 1) for entry in config["Env"])
    assert env["SHIV_ROOT"] == "/tmp/nats-node-agent"
    return env


def holders(server: str, prefix: str) -> set[str]:
    """The aggregators holding a partition of FLEET_HB, as `fleetctl aggregators` says."""
    listed = subprocess.run(
        [sys.executable, "-m", "actors.cli.fleetctl", "aggregators", "--json",
         "--server", server, "--prefix", prefix],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    rows = [json.loads(line) for line in listed.stdout.splitlines() if line.startswith("{")]
    return {str(row["holder"]) for row in rows if row.get("holder")}


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT)
async def test_the_aggregator_image_runs_its_entrypoint_as_nobody(
    image: dict[str, Any], artifact: Path, nats_server: NatsServer, prefix: str, tmp_path: Path
) -> None:
    """The image holds the artifact, runs as 65534 with SHIV_ROOT in its /tmp and exposes
    9092; its entrypoint, with `podman run IMAGE --server ...` arguments, starts an
    aggregator that takes the partitions of FLEET_HB on a real server."""
    config, root = image["config"], image["root"]
    env = await asyncio.to_thread(check_image, config, root, artifact)
    args = ["--server", nats_server.url, "--prefix", prefix, "--replicas", "1", "--http-port", "-1"]
    log = await asyncio.to_thread((tmp_path / "aggregator.log").open, "wb")
    aggregator = await asyncio.create_subprocess_exec(
        CHROOT, "--userspec=65534:65534", "--groups=65534", str(root),
        *config["Entrypoint"], *args,
        env=env, stdout=log, stderr=log,
    )  # fmt: skip

    async def held() -> set[str]:
        assert aggregator.returncode is None, "the aggregator ended: see aggregator.log"
        return await asyncio.to_thread(holders, nats_server.url, prefix)

    try:
        assert await wait_for(held, timeout=120, interval=0.5)
    finally:
        aggregator.terminate()
        await aggregator.wait()
        log.close()
    said = await asyncio.to_thread((tmp_path / "aggregator.log").read_text)
    assert aggregator.returncode == 0, said[-2000:]
    assert await asyncio.to_thread((root / "tmp/nats-node-agent").is_dir), "extracted in /tmp"
