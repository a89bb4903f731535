"""``fleetctl cordon | drain | uncordon | deregister`` as an operator runs them: a real
process against a real nats-server, with the node agent running in the test."""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

from actors.node.agent import NodeAgent
from actors.runtime.bus import NatsBus
from actors.runtime.embedded import NatsServer
from schemas import codec, signing
from schemas.messages import Alert
from schemas.subjects import Subjects
from tests.support.commanding import Results, set_in_flight
from tests.support.fleet import Fleet, wait_for, wait_record

FLEETCTL = str(Path(sys.executable).parent / "fleetctl")


async def fleetctl(
    server: NatsServer, prefix: str, key: Path, *args: str
) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        FLEETCTL,
        *args,
        "--server",
        server.url,
        "--prefix",
        prefix,
        "--key-file",
        str(key),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )


async def finish(process: asyncio.subprocess.Process) -> tuple[int, str, str]:
    out, err = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def test_drain_wait_shows_progress_and_exits_zero(
    nats_server: NatsServer,
    fleet: Fleet,
    bus: NatsBus,
    prefix: str,
    operator_file: Path,
    node: NodeAgent,
) -> None:
    """drain --wait prints a labelled line with the command id, a progress line per result
    and exits 0 once the node is drained; the cluster comes from fleet_nodes."""
    results = await Results().start(bus, prefix)
    await set_in_flight(fleet, 2)
    process = await fleetctl(
        nats_server, prefix, operator_file, "drain", "n1", "--deadline", "30", "--wait"
    )
    await wait_for(lambda: any(r.in_flight == 2 for r in results.results))
    await set_in_flight(fleet, 0)
    code, out, err = await finish(process)
    lines = out.splitlines()
    assert code == 0, err
    command_id = results.results[0].command_id
    assert lines[0] == f"drain sent: id={command_id} node=n1"
    assert "accepted" in lines[1]
    assert any(line.startswith("in_progress: draining: 2 in flight") for line in lines)
    assert lines[-1].startswith("done: drained [drained")
    await wait_record(bus, prefix, "n1", lambda r: r.state == "drained")


async def test_cordon_and_uncordon_without_wait(
    nats_server: NatsServer, bus: NatsBus, prefix: str, operator_file: Path, node: NodeAgent
) -> None:
    """cordon and uncordon print a labelled line with the command id, exit 0, and the
    record follows."""
    code, out, err = await finish(
        await fleetctl(nats_server, prefix, operator_file, "cordon", "n1", "--reason", "fw")
    )
    assert code == 0 and out.startswith("cordon sent: id=") and out.endswith(" node=n1\n"), err
    record = await wait_record(bus, prefix, "n1", lambda r: r.state == "cordoned")
    assert record.heartbeat is not None and record.heartbeat.schedulability_reason == "fw"
    code, _, err = await finish(
        await fleetctl(nats_server, prefix, operator_file, "uncordon", "n1", "--wait")
    )
    assert code == 0, err
    await wait_record(bus, prefix, "n1", lambda r: r.state == "active")


async def test_rejected_command_exits_nonzero(
    nats_server: NatsServer, prefix: str, tmp_path: Path, node: NodeAgent
) -> None:
    """A command signed by a key the node does not trust is reported rejected, exit 1."""
    stranger = tmp_path / "stranger.nk"
    signing.create_key_file(stranger)
    code, out, _ = await finish(
        await fleetctl(nats_server, prefix, stranger, "cordon", "n1", "--wait")
    )
    assert code == 1
    assert out.splitlines()[-1].startswith("rejected: signed by an untrusted key")


async def test_wait_times_out_when_node_is_down(
    nats_server: NatsServer, bus: NatsBus, prefix: str, operator_file: Path, node: NodeAgent
) -> None:
    """--wait on a stopped node gives up at --timeout with one error line and exit 2."""
    await node.stop()
    code, _, err = await finish(
        await fleetctl(
            nats_server, prefix, operator_file, "cordon", "n1", "--wait", "--timeout", "1"
        )
    )
    assert code == 2
    assert err.splitlines()[-1] == "error: no final result from n1 within 1s"


async def test_unknown_node_is_one_error_line(
    nats_server: NatsServer, bus: NatsBus, prefix: str, operator_file: Path
) -> None:
    """A node that is not in fleet_nodes (and no --cluster) is one clear error, exit 1."""
    code, _, err = await finish(await fleetctl(nats_server, prefix, operator_file, "drain", "nx"))
    assert code == 1
    assert err.splitlines()[-1].startswith("error: node nx not found (--cluster C queues")


async def test_watch_prints_alerts_until_sigint(fleet: Fleet) -> None:
    """`fleetctl watch --alerts` prints each alert as one line (time, severity, node, kind,
    message) once it is listening, one that is not an Alert as unreadable with its body,
    and exits 0 on Ctrl-C."""
    process = await asyncio.create_subprocess_exec(
        FLEETCTL,
        *("watch", "--alerts", "--server", fleet.url, "--prefix", fleet.prefix),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )

    def kill_if_running() -> None:
        if process.returncode is None:
            process.kill()

    fleet.stack.callback(kill_if_running)
    subject = Subjects(fleet.prefix).alert("stale", "c1", "n1")
    alert = Alert(
        id="a1",
        kind="stale",
        node_id="n1",
        cluster="c1",
        severity="warning",
        message="no heartbeat for 6s",
        ts=1_800_000_000.0,
    )
    stdout = process.stdout
    assert stdout is not None

    async def printed(body: bytes, mark: bytes) -> bytes | None:
        # Published until the watcher, which subscribes after starting, prints one with
        # `mark` (a line left from an earlier repeat is passed over).
        await fleet.bus.publish(subject, body)
        try:
            line = await asyncio.wait_for(stdout.readline(), 0.5)
        except TimeoutError:
            return None
        return line if mark in line else None

    line = await wait_for(lambda: printed(codec.encode(alert), b"warning"))
    assert line.decode() == "2027-01-15T08:00:00Z warning  n1 stale: no heartbeat for 6s\n"
    line = await wait_for(lambda: printed(b'{"kind":"stale"}', b"unreadable"))
    assert line.decode().endswith(' ?        n1 unreadable: {"kind":"stale"}\n')
    process.send_signal(signal.SIGINT)
    assert await asyncio.wait_for(process.wait(), 10) == 0
