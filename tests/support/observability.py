"""Test helpers for the programs operators already run: a real Alertmanager and a real
Prometheus (Debian's packages, which ``.ci/run`` installs), and an agent as its own
process, so a test can SIGKILL it as a crash would."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from actors.node.config import AgentConfig
from tests.support.fleet import HANG, wait_for
from tests.support.ports import free_port

ALERTMANAGER = "prometheus-alertmanager"
PROMETHEUS = "prometheus"

ALERTMANAGER_CONFIG = """\
route:
  receiver: blackhole
  group_wait: 1s
  group_interval: 1s
  repeat_interval: 1h
receivers:
  - name: blackhole
"""


def program(name: str) -> str:
    """The path of ``name``, or a skip naming the Debian package that brings it."""
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed (Debian package {name}; .ci/run installs it)")
    return path


async def wait_ready(
    url: str, timeout: float = HANG, headers: dict[str, str] | None = None
) -> None:
    """Poll ``url`` (with ``headers``: a login, say) until it answers 200."""
    async with aiohttp.ClientSession(headers=headers) as session:

        async def ready() -> bool:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with session.get(url, timeout=aiohttp.ClientTimeout(total=2)) as answer:
                    return answer.status == 200
            return False

        try:
            await wait_for(ready, timeout, interval=0.2)
        except AssertionError:
            raise AssertionError(f"{url} not ready within {timeout:g}s") from None


def write_config(path: Path, text: str) -> Path:
    """``text`` written to ``path`` (its directory made); the path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@contextlib.contextmanager
def running(argv: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """``argv`` as a process logging to ``log``; SIGTERM, then SIGKILL, when done."""
    with log.open("wb") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        try:
            yield process
        finally:
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)


@contextlib.asynccontextmanager
async def alertmanager(workdir: Path) -> AsyncIterator[str]:
    """A real Alertmanager on a free loopback port, not clustered; its base URL."""
    binary = program(ALERTMANAGER)
    config = write_config(workdir / "alertmanager.yml", ALERTMANAGER_CONFIG)
    port = free_port()
    argv = [
        binary,
        f"--config.file={config}",
        f"--storage.path={workdir / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--cluster.listen-address=",
    ]
    url = f"http://127.0.0.1:{port}"
    with running(argv, workdir / "alertmanager.log"):
        await wait_ready(f"{url}/-/ready")
        yield url


async def alertmanager_alerts(url: str) -> list[dict[str, Any]]:
    """The alerts Alertmanager holds as firing (``GET /api/v2/alerts``, active only)."""
    async with aiohttp.ClientSession() as session:
        async with session.get(
            f"{url}/api/v2/alerts",
            params={"active": "true", "silenced": "true", "inhibited": "true"},
            timeout=aiohttp.ClientTimeout(total=5),
        ) as answer:
            assert answer.status == 200
            alerts: list[dict[str, Any]] = await answer.json()
            return alerts


def agent_argv(config: AgentConfig) -> list[str]:
    """``node-agent start`` with ``config``'s settings as flags."""
    argv = [
        sys.executable,
        "-m",
        "actors.cli.node_agent",
        "start",
        "--server",
        config.server,
        "--prefix",
        config.prefix,
        "--node-id",
        config.node_id,
        "--cluster",
        config.cluster,
        "--state-dir",
        config.state_dir,
        "--heartbeat-interval",
        str(config.heartbeat_interval),
        "--stale-after",
        str(config.stale_after),
        "--fake-gpus",
        str(config.fake_gpus),
        "--http-port",
        str(config.http_port),
        "--gateway-port",
        str(config.gateway_port),
        "--scheduler",
        config.scheduler,
    ]
    for key, value in config.labels.items():
        argv += ["--label", f"{key}={value}"]
    return argv


@contextlib.contextmanager
def agent_process(config: AgentConfig, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """The agent of ``config`` as its own process (its key must exist and be approved)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with log.open("wb") as out:
        process = subprocess.Popen(
            agent_argv(config), stdout=out, stderr=subprocess.STDOUT, env=env
        )
        try:
            yield process
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGKILL)
            process.wait(10)
