"""``fleetctl watch --alerts`` folding an alert storm (alerts of one kind, severity and
cluster within ``--group-window``) into one line with a count, and ``--no-group`` showing
each: real fleetctl processes against a real server, alerts published by a plain client."""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from pathlib import Path

from actors.cli.fleetctl import storms
from actors.cli.render import tables
from actors.fleet.views.history import Entry
from schemas import codec
from schemas.messages import Alert
from schemas.subjects import Subjects
from tests.support.fleet import Fleet

FLEETCTL = str(Path(sys.executable).parent / "fleetctl")
STORM = [f"sim-{number:03d}" for number in range(1, 6)]


async def publish_storm(fleet: Fleet) -> None:
    """Five nodes of cluster local stale at once, and one offline node elsewhere."""
    subjects = Subjects(fleet.prefix)
    now = time.time()
    alerts = [
        Alert(
            id=f"s{node}",
            kind="stale",
            node_id=node,
            cluster="local",
            severity="warning",
            message="no heartbeat for 6s",
            ts=now,
        )
        for node in STORM
    ]
    alerts.append(
        Alert(
            id="o1",
            kind="offline",
            node_id="n9",
            cluster="far",
            severity="critical",
            message="offline",
            ts=now,
        )
    )
    for alert in alerts:
        await fleet.bus.publish(
            subjects.alert(alert.kind, alert.cluster, alert.node_id), codec.encode(alert)
        )
    await fleet.bus.flush()


async def watch(fleet: Fleet, *args: str) -> asyncio.subprocess.Process:
    """``fleetctl watch --alerts`` running, once it says it follows the live stream."""
    process = await asyncio.create_subprocess_exec(
        FLEETCTL,
        *("watch", "--alerts", *args, "--server", fleet.url, "--prefix", fleet.prefix),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )

    def kill_if_running() -> None:
        if process.returncode is None:
            process.kill()

    fleet.stack.callback(kill_if_running)
    assert process.stderr is not None
    said = await asyncio.wait_for(process.stderr.readline(), 20)
    assert said.startswith(b"watching alerts live")
    return process


async def lines(process: asyncio.subprocess.Process, count: int) -> list[list[str]]:
    """The next ``count`` lines it prints, split into words."""
    assert process.stdout is not None
    read = [await asyncio.wait_for(process.stdout.readline(), 20) for _ in range(count)]
    return [line.decode().split() for line in read]


async def interrupted(process: asyncio.subprocess.Process) -> bytes:
    """What it prints after Ctrl-C (SIGINT), having exited 0."""
    process.send_signal(signal.SIGINT)
    rest, _ = await asyncio.wait_for(process.communicate(), 20)
    assert process.returncode == 0
    return rest


async def test_watch_folds_a_storm_into_one_line_and_no_group_shows_each(fleet: Fleet) -> None:
    """Five stale alerts of cluster local at once are one line (5 nodes stale in cluster
    local (sim-001 ... sim-005)), a lone offline alert its own line; a replay folds the
    same; --no-group prints all six alerts, one a line."""
    await fleet.start_aggregator()
    live = await watch(fleet)
    await publish_storm(fleet)
    printed = await lines(live, 2)
    assert await interrupted(live) == b""
    [storm] = [line for line in printed if "stale" in line]
    assert storm[1:] == [
        *("warning", "5", "nodes", "stale", "in", "cluster", "local"),
        *("(sim-001", "...", "sim-005)"),
    ]
    [lone] = [line for line in printed if "stale" not in line]
    assert lone[1:4] == ["critical", "n9", "offline:"]

    replay = await watch(fleet, "--since", "1m")
    replayed = await lines(replay, 2)
    assert await interrupted(replay) == b""
    assert sorted(map(tuple, replayed)) == sorted(map(tuple, printed))

    each = await watch(fleet, "--since", "1m", "--no-group")
    separate = await lines(each, 6)
    assert await interrupted(each) == b""
    assert sorted(line[2] for line in separate) == sorted([*STORM, "n9"])


def test_a_group_names_nodes_once_and_counts_repeats() -> None:
    """One node raising three alerts of a kind in a window is one line that says so; a
    group of one alert (however often delivered) is that alert's own line."""
    entries = [
        Entry(ts=100.0 + n, subject="s", message=alert, body=codec.encode(alert))
        for n, alert in enumerate(
            Alert(
                id=f"a{n}",
                kind="anomaly",
                node_id="sim-001",
                cluster="local",
                severity="info",
                message="late",
                ts=100.0 + n,
            )
            for n in range(3)
        )
    ]
    group = storms.Group(first=entries[0], ids={"a0", "a1", "a2"}, nodes={"sim-001"})
    line = storms.group_line(("info", "anomaly", "local"), group)
    assert line.split()[1:] == [
        *("info", "1", "node", "anomaly", "in", "cluster", "local", "(sim-001,", "3", "alerts)")
    ]
    lone = storms.Group(first=entries[0], ids={"a0"}, nodes={"sim-001"})
    assert storms.group_line(("info", "anomaly", "local"), lone) == tables.event_line(entries[0])
