"""``fleetctl aggregator`` as shipped starts cleanly on a server nothing provisioned: with
the policy, the reconciler, the dashboard's commands and the Alertmanager forwarder on,
no actor crashes over a start, a stop and a start again (each of the last three read
streams the aggregator had not made yet, and crashed once at every fresh start)."""

from __future__ import annotations

import asyncio
import base64
import json
import signal
from pathlib import Path

from actors.runtime.embedded import NatsServer
from actors.runtime.http_login import hash_password
from schemas import signing
from tests.support.deploy import FLEETCTL
from tests.support.observability import running, wait_ready
from tests.support.ports import free_port

STOP_TIMEOUT = 30.0
PROBE_USER, PROBE_PASSWORD = "probe", "probe-password"
"""The health probe's user: with the dashboard's commands on, every path needs a login."""
PROBE_LOGIN = {
    "Authorization": "Basic " + base64.b64encode(f"{PROBE_USER}:{PROBE_PASSWORD}".encode()).decode()
}


def aggregator_argv(server: str, prefix: str, tmp_path: Path, port: int) -> list[str]:
    """The aggregator with every actor a deployment may turn on."""
    key = tmp_path / "keys" / "operator.nk"
    if not key.exists():
        signing.create_key_file(key)
    policy = tmp_path / "policy.toml"
    policy.write_text(f'key_file = "{key}"\n')
    users = tmp_path / "users"
    users.write_text(f"{PROBE_USER}:{hash_password(PROBE_PASSWORD, iterations=1000)}\n")
    return [
        FLEETCTL,
        "aggregator",
        "--server",
        server,
        "--prefix",
        prefix,
        "--policy-file",
        str(policy),
        "--workloads-key-file",
        str(key),
        "--http-port",
        str(port),
        "--dashboard",
        "--allow-ui-commands",
        "--ui-key-file",
        str(key),
        "--http-users-file",
        str(users),
        "--alertmanager-url",
        f"http://127.0.0.1:{free_port()},http://127.0.0.1:{free_port()}",
        "--log-format",
        "json",
    ]


async def run_once(argv: list[str], url: str, log: Path) -> list[dict[str, object]]:
    """Start the program, wait until every actor runs (/healthz 200), stop it with
    SIGTERM; its log lines."""
    with running(argv, log) as process:
        await wait_ready(f"{url}/healthz", timeout=60, headers=PROBE_LOGIN)
        process.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(process.wait, STOP_TIMEOUT)
    text = await asyncio.to_thread(log.read_text)
    assert code == 0, text[-2000:]
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


async def test_fresh_start_stop_and_start_crash_nothing(
    nats_server: NatsServer, prefix: str, tmp_path: Path
) -> None:
    """Zero 'actor crashed' lines over a first start on an empty server (the streams are
    created then), a stop and a second start; every actor ran each time."""
    port = free_port()
    argv = aggregator_argv(nats_server.url, prefix, tmp_path, port)
    first = await run_once(argv, f"http://127.0.0.1:{port}", tmp_path / "first.log")
    second = await run_once(argv, f"http://127.0.0.1:{port}", tmp_path / "second.log")
    assert any(line["msg"] == "stream created" for line in first), "not a fresh start"
    assert not any(line["msg"] == "stream created" for line in second)
    crashed = [
        line for line in first + second if "crash" in str(line["msg"]) or line["level"] == "error"
    ]
    assert crashed == []
