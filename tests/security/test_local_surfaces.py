"""The node's local surfaces from the attacker's side: its HTTP port (idle connections,
slow headers), its key files and the operator's terminal under ``fleetctl watch``."""

from __future__ import annotations

import asyncio
import logging
import resource
import signal
import sys
import time
from pathlib import Path

import aiohttp
import nats
import pytest

from actors.cli.render.tables import printable
from actors.fleet.storage.registry import approve
from actors.node.http_api import HttpApiActor
from schemas import signing
from schemas.subjects import Subjects
from tests.support.fleet import Fleet, wait_for, wait_record
from tests.support.ports import free_port

BIN = Path(sys.executable).parent
IDLE_CONNECTIONS = 1100
AGENT_NOFILE = 1024
"""The agent's descriptor limit in the idle-connection test: a common default, which 1,100
idle connections exceed."""
REQUEST_TIMEOUT = 1.0
UNITS = Path(__file__).resolve().parents[2] / "deploy" / "nats" / "systemd"


def limit_descriptors() -> None:
    """In the agent's child process: a soft descriptor limit of AGENT_NOFILE."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (AGENT_NOFILE, hard))


async def get_status(port: int) -> dict[str, object] | None:
    """The agent's /status on a new connection, or None if it is not served."""
    try:
        timeout = aiohttp.ClientTimeout(total=2)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            async with session.get(f"http://127.0.0.1:{port}/status") as response:
                if response.status != 200:
                    return None
                status: dict[str, object] = await response.json()
                return status
    except (aiohttp.ClientError, TimeoutError):
        return None


async def test_idle_connections_neither_starve_nor_stall_the_agent(fleet: Fleet) -> None:
    """1,100 idle connections to an agent limited to 1,024 descriptors: it keeps beating,
    refuses what is over its connection limit at once, cuts the idle ones off after the
    request timeout and then serves new requests, and no actor restarts."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < IDLE_CONNECTIONS + 200:
        pytest.skip(f"this process may open only {hard} descriptors")
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, IDLE_CONNECTIONS + 200), hard))
    fleet.stack.callback(resource.setrlimit, resource.RLIMIT_NOFILE, (soft, hard))
    await fleet.start_aggregator()
    config = fleet.config()
    key = signing.load_or_create_key_file(config.key_path)
    await approve(fleet.bus, Subjects(fleet.prefix), "n1", key.public_key)
    port = free_port()
    agent = await asyncio.create_subprocess_exec(
        str(BIN / "node-agent"),
        "start",
        *("--server", fleet.url, "--prefix", fleet.prefix, "--node-id", "n1"),
        *("--cluster", "c1", "--state-dir", config.state_dir, "--fake-gpus", "1"),
        *("--heartbeat-interval", "0.5", "--stale-after", "2", "--http-port", str(port)),
        *("--http-request-timeout", str(REQUEST_TIMEOUT)),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
        preexec_fn=limit_descriptors,
    )
    opened: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    try:
        await wait_record(fleet.bus, fleet.prefix, "n1", lambda r: r.state == "active")
        await wait_for(lambda: get_status(port))
        for _ in range(IDLE_CONNECTIONS):
            opened.append(await asyncio.open_connection("127.0.0.1", port))
        opened_at = time.monotonic()
        seq = (await wait_record(fleet.bus, fleet.prefix, "n1", lambda r: True)).last_seq
        # Every connection ends from the agent's side: over the cap at once with a 503,
        # the others when the request timeout cuts them off (read() returns at EOF).
        answers = await asyncio.wait_for(
            asyncio.gather(*(reader.read() for reader, _ in opened)), REQUEST_TIMEOUT + 10
        )
        refused = sum(answer.startswith(b"HTTP/1.1 503") for answer in answers)
        cut_off = sum(answer == b"" for answer in answers)
        assert refused + cut_off == IDLE_CONNECTIONS
        print(
            f"{IDLE_CONNECTIONS} idle connections: {refused} refused with 503, {cut_off} cut "
            f"off idle; all closed {time.monotonic() - opened_at:.1f}s after the last opened"
        )
        # It kept beating meanwhile, serves new requests, and no actor restarted.
        await wait_record(fleet.bus, fleet.prefix, "n1", lambda r: r.last_seq >= seq + 2)
        status = await wait_for(lambda: get_status(port))
        actors = status["actors"]
        assert isinstance(actors, dict)
        assert {name: actor["restarts"] for name, actor in actors.items()} == dict.fromkeys(
            actors, 0
        )
        assert agent.returncode is None
    finally:
        for _, writer in opened:
            writer.close()
        if agent.returncode is None:
            agent.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(agent.wait(), 20)
            except TimeoutError:
                agent.kill()
                await agent.wait()


async def test_slow_headers_are_cut_off(fleet: Fleet) -> None:
    """A client that sends its request headers a byte at a time is disconnected once the
    request timeout has passed, long before it would have finished."""
    agent = await fleet.start_agent(fleet.config(http_request_timeout=0.5))
    assert agent.supervisor is not None and await agent.supervisor.wait_ready(10)
    [http] = [actor for actor in agent.supervisor.actors if isinstance(actor, HttpApiActor)]
    assert http.port is not None
    reader, writer = await asyncio.open_connection("127.0.0.1", http.port)
    start = time.monotonic()
    cut_off = False
    try:
        writer.write(b"GET /status HTTP/1.1\r\nHost: localhost\r\n")
        for _ in range(100):  # 10 s of one header byte per 0.1 s
            writer.write(b"X")
            await writer.drain()
            await asyncio.sleep(0.1)
            if reader.at_eof() or writer.is_closing():
                cut_off = True
                break
            try:
                if await asyncio.wait_for(reader.read(1), 0.001) == b"":
                    cut_off = True
                    break
            except TimeoutError:
                pass
    except ConnectionError:
        cut_off = True
    finally:
        writer.close()
    # Cut off at 0.5 s; the bound leaves a loaded machine room, far below the 10 s it takes.
    assert cut_off and time.monotonic() - start < 6.0


def test_world_readable_key_file_is_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Loading a key file that group or others can read logs a warning naming the file."""
    path = tmp_path / "node.nk"
    signing.create_key_file(path)
    with caplog.at_level(logging.WARNING, logger="schemas.file_modes"):
        signing.load_key_file(path)
    assert caplog.records == []
    path.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="schemas.file_modes"):
        signing.load_key_file(path)
    [warning] = caplog.records
    assert warning.levelno == logging.WARNING
    assert warning.path == str(path) and warning.mode == "0644"  # type: ignore[attr-defined]


def test_key_directory_is_created_private(tmp_path: Path) -> None:
    """The directory created for a new key is 0700, whatever the umask."""
    path = tmp_path / "state" / "keys" / "node.nk"
    signing.create_key_file(path)
    assert path.parent.stat().st_mode & 0o777 == 0o700
    assert path.stat().st_mode & 0o777 == 0o600


def test_units_raise_the_descriptor_limit() -> None:
    """The agent's and aggregator's units set LimitNOFILE well above the HTTP servers'
    connection cap (256)."""
    for name in ("node-agent.service", "fleetctl-aggregator.service"):
        lines = (UNITS / name).read_text().splitlines()
        [limit] = [line.split("=", 1)[1] for line in lines if line.startswith("LimitNOFILE=")]
        assert int(limit) >= 4096, name


def test_printable_escapes_everything_that_drives_a_terminal() -> None:
    assert printable("plain text, ünïcode") == "plain text, ünïcode"
    assert printable("\x1b[2J\x07\r\n\x9b\u202e") == "\\x1b[2J\\x07\\x0d\\x0a\\x9b\\u202e"


async def test_watch_prints_no_escape_sequences(fleet: Fleet) -> None:
    """A node event or an alert carrying ESC [2J (clear screen) is printed with the ESC
    escaped, and the event is marked unsigned."""
    watch = await asyncio.create_subprocess_exec(
        str(BIN / "fleetctl"),
        *("watch", "--alerts", "--events", "--server", fleet.url, "--prefix", fleet.prefix),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )

    def kill_if_running() -> None:
        if watch.returncode is None:
            watch.kill()

    fleet.stack.callback(kill_if_running)
    stdout = watch.stdout
    assert stdout is not None
    nc = await nats.connect(fleet.url)
    fleet.stack.push_async_callback(nc.close)
    hostile = b'{"ts": 1, "reason": "\x1b[2J\x1b]0;pwned\x07"}'
    subjects = Subjects(fleet.prefix)

    async def printed(subject: str) -> bytes | None:
        # Published until the watcher, which subscribes after starting, prints it.
        await nc.publish(subject, hostile)
        try:
            return await asyncio.wait_for(stdout.readline(), 0.5)
        except TimeoutError:
            return None

    event = await wait_for(lambda: printed(subjects.event("n1", "state")))
    alert = await wait_for(lambda: printed(subjects.alert("stale", "c1", "n1")))
    for line in (event, alert):
        assert b"\x1b" not in line and b"\x07" not in line
        assert b"\\x1b[2J" in line
    assert event.startswith(f"{subjects.event('n1', 'state')} unsigned ".encode())
    watch.send_signal(signal.SIGINT)
    assert await asyncio.wait_for(watch.wait(), 10) == 0
