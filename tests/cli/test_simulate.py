"""fleetctl simulate: signed simulated nodes accepted by a real aggregator; one-line errors."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time

import msgspec

from actors.cli.simulate.publisher import SimOptions, template
from actors.fleet.storage.records import read_records
from actors.node.labels import found_labels
from actors.runtime.bus import NatsBus
from actors.runtime.embedded import NatsServer
from schemas.messages import Heartbeat
from schemas.settings import SettingsStatus
from schemas.subjects import Subjects
from tests.support.fleet import Fleet


async def fleetctl(*args: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "actors.cli.fleetctl",
        *args,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    stdout, stderr = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode is not None
    return process.returncode, stdout.decode(), stderr.decode()


def test_template_is_a_full_heartbeat_with_markers() -> None:
    """The pre-encoded body decodes as a Heartbeat with G fake GPUs and a scored Health,
    and what an agent adds on such a node: the labels it finds for those GPUs, the
    settings status of a node the fleet sets nothing for, and when it started."""
    options = SimOptions(nodes=10, rate=1.0, duration=1.0, gpus=4)
    before = time.time()
    heartbeat = msgspec.json.decode(template("sim-1", options, "b00t"), type=Heartbeat)
    assert heartbeat.sample is not None and len(heartbeat.sample.gpus) == 4
    assert heartbeat.health is not None and heartbeat.health.status == "healthy"
    assert len(heartbeat.health.components) == 5
    assert (heartbeat.interval, heartbeat.stale_after) == (10.0, 30.0)
    assert heartbeat.labels == found_labels(heartbeat.sample, {})
    assert heartbeat.labels["gpu.count"] == "4" and "gpu.product" in heartbeat.labels
    assert heartbeat.settings == SettingsStatus()
    assert heartbeat.started is not None and before <= heartbeat.started <= time.time()


async def test_simulated_nodes_are_all_accepted(fleet: Fleet, bus: NatsBus, prefix: str) -> None:
    """20 nodes at 100/s for 2 s: each node ends active at seq 10, and the figures print."""
    # The figures simulate prints follow the records as written: their checkpoints, not
    # what this test is about, come every 0.5 s (the default is 60 s).
    await fleet.start_aggregator(checkpoint_interval=0.5)
    code, out, err = await fleetctl(
        "simulate",
        *("--server", fleet.url, "--prefix", prefix),
        *("--nodes", "20", "--rate", "100", "--duration", "2", "--gpus", "2"),
    )
    found = await read_records(bus, Subjects(prefix))
    assert (code, err) == (0, ""), out + err
    lines = out.splitlines()
    assert len(lines) == 4, out
    published = re.fullmatch(
        r"published 200 heartbeats from 20 nodes in ([\d.]+)s: ([\d.]+)/s \(asked 100/s\), "
        r"0 not acknowledged",
        lines[0],
    )
    assert published, lines[0]
    assert 50 < float(published.group(2)) <= 110
    caught_up = r"caught up: 20/20 records current [\d.]+s after the last publish"
    assert re.fullmatch(caught_up, lines[1]), lines[1]
    assert re.fullmatch(r"accepted: \d+ record updates for 200 heartbeats", lines[2]), lines[2]
    latency = (
        r"publish-to-record latency of the first heartbeat of each of 20 nodes \(a new boot, "
        r"written at once; .*\): p50 \d+ ms, p99 \d+ ms"
    )
    assert re.fullmatch(latency, lines[3]), lines[3]
    assert len(found) == 20
    assert {(r.state, r.last_seq, r.cluster, r.gpus_total) for r in found} == {
        ("active", 10, "sim", 2)
    }


async def test_unreachable_server_is_one_error_line() -> None:
    """A server nobody listens on: exit 1 and one line on stderr, no traceback."""
    code, out, err = await fleetctl("simulate", "--server", "nats://127.0.0.1:1", "--nodes", "2")
    assert code == 1 and out == ""
    assert err.startswith("error: cannot reach NATS at nats://127.0.0.1:1")
    assert len(err.splitlines()) == 1


async def test_unprovisioned_server_is_one_error_line(nats_server: NatsServer) -> None:
    """A server without the fleet's streams: exit 1 and one line saying to start an aggregator."""
    code, out, err = await fleetctl(
        "simulate", "--server", nats_server.url, "--prefix", "nothere", "--nodes", "2"
    )
    assert code == 1 and out == ""
    assert err.startswith("error: FLEET_HB_NOTHERE does not exist") and "aggregator" in err
    assert len(err.splitlines()) == 1
