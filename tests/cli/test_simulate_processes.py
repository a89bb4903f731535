"""fleetctl simulate --processes: worker processes publish every node's beats, stop with
their parent, and a failing worker is one error line."""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys

import psutil
import pytest

from actors.cli.common import ClientConfig
from actors.cli.simulate.processes import WorkerFailed
from actors.cli.simulate.publisher import SimOptions
from actors.cli.simulate.run import Progress, _in_workers
from actors.fleet.storage.records import read_records
from actors.runtime.bus import NatsBus
from schemas.subjects import Subjects
from tests.support.fleet import Fleet, wait_for


async def test_two_processes_publish_every_nodes_beats(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """21 nodes over 2 workers at 105/s for 2 s: all 210 beats acked, every node ends
    active at seq 10, and the parent prints the figures once, saying 2 processes."""
    # The figures simulate prints follow the records as written: their checkpoints, not
    # what this test is about, come every 0.5 s (at the default 60 s this test waited a
    # minute for "caught up", as long as simulate's --wait).
    await fleet.start_aggregator(checkpoint_interval=0.5)
    process = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "actors.cli.fleetctl", "simulate"),
        *("--server", fleet.url, "--prefix", prefix, "--processes", "2"),
        *("--nodes", "21", "--rate", "105", "--duration", "2", "--gpus", "1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    stdout, stderr = await asyncio.wait_for(process.communicate(), 90)
    out = stdout.decode()
    assert (process.returncode, stderr.decode()) == (0, ""), out
    assert re.match(
        r"published 210 heartbeats from 21 nodes in [\d.]+s by 2 processes: [\d.]+/s "
        r"\(asked 105/s\), 0 not acknowledged\n",
        out,
    ), out
    assert "caught up: 21/21 records current" in out, out
    assert out.count("publish-to-record latency of the first heartbeat of each of 21 nodes") == 1
    found = await read_records(bus, Subjects(prefix))
    assert {(r.node_id, r.state, r.last_seq) for r in found} == {
        (f"sim-{i:05d}", "active", 10) for i in range(21)
    }


def _exited(process: psutil.Process) -> bool:
    """Whether ``process`` ended: gone, or a zombie not reaped yet."""
    try:
        return bool(process.status() == psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return True


def _workers_of(parent: psutil.Process) -> list[psutil.Process]:
    try:
        return [p for p in parent.children() if "actors.cli.simulate.worker" in p.cmdline()]
    except psutil.Error:
        return []


@pytest.mark.slow
async def test_workers_stop_when_the_parent_is_killed(fleet: Fleet, prefix: str) -> None:
    """SIGKILL of fleetctl simulate mid-run: both of its workers are gone within 10 s."""
    await fleet.start_aggregator()
    process = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "actors.cli.fleetctl", "simulate"),
        *("--server", fleet.url, "--prefix", prefix, "--processes", "2"),
        *("--nodes", "10", "--rate", "20", "--duration", "120", "--gpus", "1"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        parent = psutil.Process(process.pid)

        def both_workers() -> list[psutil.Process]:
            workers = _workers_of(parent)
            return workers if len(workers) >= 2 else []

        workers = await wait_for(both_workers)
        assert len(workers) == 2
        process.send_signal(signal.SIGKILL)
        await asyncio.wait_for(process.wait(), 10)
        _, alive = await asyncio.to_thread(psutil.wait_procs, workers, 10)
        # A worker that exited but whose new parent (the machine's init, here a process
        # that may not reap) has not waited for it yet is a zombie: it runs nothing.
        assert [worker for worker in alive if not _exited(worker)] == []
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_a_failing_worker_is_one_error_line(bus: NatsBus, prefix: str) -> None:
    """Workers that cannot reach NATS: WorkerFailed, one line naming the worker and its
    own error, and no worker left running."""
    options = SimOptions(nodes=4, rate=4.0, duration=1.0, prefix=prefix, processes=2)
    progress = Progress([f"sim-{i:05d}" for i in range(4)], "b00t")
    before = {p.pid for p in psutil.Process().children()}
    with pytest.raises(WorkerFailed) as failed:
        await _in_workers(options, ClientConfig(server="nats://127.0.0.1:1"), "b00t", progress)
    message = str(failed.value)
    assert len(message.splitlines()) == 1
    # The exit status is asyncio's to report (255 when its child watcher loses the race
    # with a worker that exits at once); the worker's own line is what matters.
    assert re.match(r"simulate worker [01] failed \(exit \d+\): cannot reach NATS", message)
    assert {p.pid for p in psutil.Process().children()} <= before
