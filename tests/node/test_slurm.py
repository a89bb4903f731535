"""The scheduler actor and drains through Slurm, against a real slurmctld, slurmd and munged
(skipped, with the reason, only where the Slurm binaries are absent)."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from actors.cli.node_agent import main
from actors.node.agent import NodeAgent
from actors.node.scheduler import SchedulerActor
from actors.runtime.bus import NatsBus
from actors.runtime.embedded import NatsServer
from schemas import signing
from schemas.events import Interruption
from schemas.messages import NodeRecord, Uncordon
from schemas.subjects import EVENT_INTERRUPTION
from tests.support.commanding import Results, send
from tests.support.fleet import Fleet, node_events, wait_for, wait_record
from tests.support.slurm import (
    SlurmCluster,
    missing_binaries,
    slurm_cluster,
    start_daemon,
    stop_daemon,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        bool(missing_binaries()),
        reason=f"Slurm not installed (missing {', '.join(missing_binaries())}); .ci/run "
        "installs slurmctld slurmd slurm-client munge",
    ),
]

FLEETCTL = str(Path(sys.executable).parent / "fleetctl")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """One Slurm cluster for the module (Slurm's node is this host), ``SLURM_CONF`` naming
    it while the module runs, as the agent would find it in its environment."""
    before = os.environ.get("SLURM_CONF")
    with slurm_cluster(tmp_path_factory.mktemp("slurm")) as running:
        os.environ["SLURM_CONF"] = str(running.conf)
        try:
            yield running
        finally:
            if before is None:
                os.environ.pop("SLURM_CONF", None)
            else:
                os.environ["SLURM_CONF"] = before


@pytest.fixture
def slurm(cluster: SlurmCluster) -> SlurmCluster:
    """The cluster with no jobs and its node resumed, whatever the previous test left."""
    cluster.reset()
    return cluster


@pytest.fixture
def operator_file(tmp_path: Path) -> Path:
    path = tmp_path / "operator.nk"
    signing.create_key_file(path)
    return path


async def slurm_agent(fleet: Fleet, operator_file: Path) -> NodeAgent:
    """An aggregator and agent n1 with ``--scheduler slurm``, trusting the operator key."""
    await fleet.start_aggregator()
    operator = signing.load_key_file(operator_file)
    config = fleet.config(
        trust_operators=[operator.public_key],
        scheduler="slurm",
        scheduler_interval=0.5,
        scheduler_timeout=3.0,
    )
    agent = await fleet.start_agent(config)
    await wait_record(fleet.bus, fleet.prefix, "n1", lambda r: r.state == "active")
    return agent


def scheduler_of(record: NodeRecord) -> tuple[str, int | None]:
    """(Slurm state, running jobs) in the record's latest heartbeat."""
    scheduler = record.heartbeat.scheduler if record.heartbeat else None
    if scheduler is None:
        return "", None
    return scheduler.slurm_state, scheduler.jobs.running_count


async def fleetctl(
    server: NatsServer, prefix: str, key: Path | None, *args: str
) -> asyncio.subprocess.Process:
    """fleetctl against the test's server; ``key`` signs commands (None: a reading command)."""
    signing_key = ["--key-file", str(key)] if key is not None else []
    return await asyncio.create_subprocess_exec(
        FLEETCTL,
        *args,
        "--server",
        server.url,
        "--prefix",
        prefix,
        *signing_key,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )


async def finish(process: asyncio.subprocess.Process) -> tuple[int, str, str]:
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def test_running_job_and_services_show_in_the_heartbeat(
    fleet: Fleet, slurm: SlurmCluster, operator_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A job sbatch started shows as running in the node's heartbeat (and in ``node-agent
    status``), with Slurm's state, slurmd and munged running and their versions, and the
    cores its job holds taken from cpu_cores_available."""
    agent = await slurm_agent(fleet, operator_file)
    slurm.sbatch(30)

    def allocated(record: NodeRecord) -> bool:
        # The job list and the node's state are separate Slurm reads, and slurmctld
        # updates them separately: a sample may see the job running on a node still
        # "idle". Both are waited for; the state is asserted below all the same.
        state, running = scheduler_of(record)
        return running == 1 and state.split("+")[0] in ("mixed", "allocated")

    record = await wait_record(fleet.bus, fleet.prefix, "n1", allocated)
    assert record.heartbeat is not None and record.heartbeat.scheduler is not None
    scheduler = record.heartbeat.scheduler
    assert scheduler.kind == "slurm" and scheduler.reachable
    assert scheduler.node_name == slurm.node
    assert scheduler.slurm_state.split("+")[0] in ("mixed", "allocated")
    assert scheduler.services.slurmd_running and scheduler.services.munge_running
    assert scheduler.services.slurmd_version.startswith(slurm.tool("slurmd", "-V").split()[-1])
    assert scheduler.services.munge_version
    assert scheduler.cpus_total and scheduler.cpus_allocated
    assert record.heartbeat.sample is not None
    free = record.heartbeat.sample.capacity.cpu_cores_available
    assert free == scheduler.cpus_total - scheduler.cpus_allocated
    assert record.state == "active"
    state_dir = agent.config.state_dir
    assert await asyncio.to_thread(main, ["status", "--state-dir", state_dir]) == 0
    assert f"slurm     {slurm.node} " in capsys.readouterr().out


async def test_accounting_absent_reports_unknown_with_a_reason(
    fleet: Fleet, slurm: SlurmCluster
) -> None:
    """Without job accounting, completed_24h and failed_24h are null with the reason, not 0."""
    config = fleet.config(scheduler="slurm")
    scheduler = await SchedulerActor(config, fleet.bus, node_events(config)).observe()
    assert scheduler.reachable and scheduler.jobs.running_count == 0
    assert scheduler.jobs.completed_24h is None and scheduler.jobs.failed_24h is None
    assert "accounting" in scheduler.jobs.history_reason


async def test_drain_wait_goes_through_slurm_and_uncordon_resumes(
    nats_server: NatsServer,
    fleet: Fleet,
    bus: NatsBus,
    prefix: str,
    slurm: SlurmCluster,
    operator_file: Path,
) -> None:
    """fleetctl drain --wait drains the node in Slurm with our reason, reports the running
    job count while the job runs, finishes drained when it ends; uncordon resumes Slurm."""
    await slurm_agent(fleet, operator_file)
    results = await Results().start(bus, prefix)
    job = slurm.sbatch(120)
    await wait_for(lambda: slurm.running())
    process = await fleetctl(
        nats_server, prefix, operator_file, "drain", "n1", "--deadline", "90", "--wait"
    )
    await wait_for(lambda: any(r.jobs_running == 1 for r in results.results))
    command_id = results.results[0].command_id
    assert set(slurm.state().split("+")) >= {"drain"}  # draining: the job still runs
    assert slurm.running()
    assert "Reason=fleet: " in slurm.node_line() and f"({command_id})" in slurm.node_line()
    slurm.cancel(job)  # the job ends: the drain finishes
    code, out, err = await finish(process)
    assert code == 0, err
    lines = out.splitlines()
    assert any("1 Slurm jobs running" in line for line in lines), out
    assert lines[-1].startswith("done: drained"), out
    await slurm.until_state("idle+drain")
    await wait_record(bus, prefix, "n1", lambda r: r.state == "drained")

    process = await fleetctl(nats_server, prefix, operator_file, "uncordon", "n1", "--wait")
    code, out, err = await finish(process)
    assert code == 0, err
    assert "Slurm node" in out and "resumed" in out
    assert "drain" not in slurm.state().split("+")
    await wait_record(bus, prefix, "n1", lambda r: r.state == "active")


async def test_drain_deadline_with_slurm_jobs_running_exits_3(
    nats_server: NatsServer,
    fleet: Fleet,
    prefix: str,
    slurm: SlurmCluster,
    operator_file: Path,
) -> None:
    """A drain whose deadline passes with a Slurm job still running ends drained, says so
    with the job count, and fleetctl drain --wait exits 3 (work was cut off)."""
    await slurm_agent(fleet, operator_file)
    slurm.sbatch(60)
    await wait_for(lambda: slurm.running())
    process = await fleetctl(
        nats_server, prefix, operator_file, "drain", "n1", "--deadline", "2", "--wait"
    )
    code, out, err = await finish(process)
    assert code == 3, out + err
    assert "done: deadline passed with 1 Slurm jobs running" in out.splitlines()[-1]
    assert slurm.running() and slurm.has_state("drain")


async def test_admin_drain_shows_in_record_and_uncordon_leaves_it(
    nats_server: NatsServer,
    fleet: Fleet,
    bus: NatsBus,
    prefix: str,
    slurm: SlurmCluster,
    operator_file: Path,
) -> None:
    """An admin's Slurm drain shows in our record (cordoned while a job runs, drained once
    none does) with Slurm's reason, and our uncordon does not lift it."""
    await slurm_agent(fleet, operator_file)
    results = await Results().start(bus, prefix)
    job = slurm.sbatch(120)
    await wait_for(lambda: slurm.running())
    slurm.tool("scontrol", "update", f"nodename={slurm.node}", "state=drain", "reason=bad DIMM")
    record = await wait_record(bus, prefix, "n1", lambda r: r.state == "cordoned")
    assert record.heartbeat is not None
    assert record.heartbeat.schedulability_reason == "slurm: bad DIMM"
    # The record says a Slurm admin did it (the remediation policy never undoes that).
    assert record.heartbeat.schedulability_by == "slurm"
    slurm.cancel(job)  # no job left: the admin's drain is complete
    record = await wait_record(bus, prefix, "n1", lambda r: r.state == "drained")
    assert record.heartbeat is not None
    assert record.heartbeat.schedulability_reason == "slurm: bad DIMM"
    # Where an operator looks (issue 33): REASON of -o wide and describe, marked Slurm's.
    code, out, err = await finish(await fleetctl(nats_server, prefix, None, "nodes", "-o", "wide"))
    assert code == 0, err
    assert out.splitlines()[1].split()[2] == "drained"
    header, row = out.splitlines()[:2]
    # The REASON column leads with Slurm's reason; a health reason may follow it (slurmd
    # slow to answer on a loaded machine makes the node degraded: "...; scheduler: ...").
    assert row[header.index("REASON") :].startswith("slurm: bad DIMM"), out
    code, out, err = await finish(await fleetctl(nats_server, prefix, None, "describe", "n1"))
    assert code == 0 and "Schedulability:  drained (reason: slurm: bad DIMM)" in out, err

    operator = signing.load_key_file(operator_file)
    uncordon = await send(bus, prefix, operator, Uncordon())
    final = await results.final(uncordon.id)
    assert final.status == "done" and "left alone: bad DIMM" in final.detail
    assert "drain" in slurm.state().split("+") and "Reason=bad DIMM" in slurm.node_line()
    # Two more heartbeats later our record still shows the admin's drain.
    seen = time.time()
    record = await wait_record(
        bus, prefix, "n1", lambda r: r.heartbeat is not None and r.heartbeat.ts > seen + 1
    )
    assert record.state == "drained"
    # What the operator reads is what the Slurm admin reads.
    code, out, err = await finish(await fleetctl(nats_server, prefix, None, "describe", "n1"))
    assert code == 0, err
    assert f"Slurm:           {slurm.node} {slurm.state()} (reason: bad DIMM)" in out
    assert "0 running" in out and "State:           drained" in out


async def test_spot_notice_drains_through_slurm(
    fleet: Fleet, bus: NatsBus, prefix: str, slurm: SlurmCluster, operator_file: Path
) -> None:
    """A cloud maintenance notice cordons the node in Slurm too, with the notice as reason."""
    await slurm_agent(fleet, operator_file)
    notice = Interruption(ts=time.time(), provider="gcp", kind="maintenance", event_id="m1")
    await fleet.publish_event(EVENT_INTERRUPTION, notice)
    await slurm.until_state("drain")
    line = slurm.node_line()
    assert "Reason=fleet: gcp maintenance notice (spot:gcp:maintenance:m1)" in line
    await wait_record(bus, prefix, "n1", lambda r: r.state == "cordoned")


async def test_terminate_notice_drains_slurm_jobs_before_its_deadline(
    fleet: Fleet, bus: NatsBus, prefix: str, slurm: SlurmCluster, operator_file: Path
) -> None:
    """A spot termination notice drains through Slurm with the notice's deadline: progress
    carries the running job count, and the node deregisters once the job has ended."""
    agent = await slurm_agent(fleet, operator_file)
    results = await Results().start(bus, prefix)
    job = slurm.sbatch(120)
    await wait_for(lambda: slurm.running())
    deadline = time.time() + 90
    notice = Interruption(ts=time.time(), provider="aws", kind="terminate", deadline=deadline)
    await fleet.publish_event(EVENT_INTERRUPTION, notice)
    command_id = "spot:aws:terminate:" + f"{deadline:.0f}"
    await wait_for(lambda: any(r.jobs_running == 1 for r in results.of(command_id)))
    assert f"Reason=fleet: aws terminate notice ({command_id})" in slurm.node_line()
    slurm.cancel(job)
    final = await results.final(command_id)
    assert final.status == "done" and final.detail.startswith("deregistered")
    assert any(r.detail.startswith("drained; deregistering") for r in results.of(command_id))
    assert not slurm.running() and slurm.has_state("idle+drain")
    commands = agent.commands
    assert commands is not None
    await wait_for(commands.actions.finished.is_set)  # the agent's work is over


async def test_slurm_stopped_is_a_finding_not_a_crash(
    fleet: Fleet, bus: NatsBus, prefix: str, slurm: SlurmCluster, operator_file: Path
) -> None:
    """With slurmctld and slurmd stopped the node reports a degraded scheduler check with
    the reason, and every actor keeps running."""
    agent = await slurm_agent(fleet, operator_file)
    # Off the event loop: stopping a daemon waits for it, and the agent and aggregator run here.
    await asyncio.to_thread(stop_daemon, slurm, "slurmd")
    await asyncio.to_thread(stop_daemon, slurm, "slurmctld")
    try:

        def finding(record: NodeRecord) -> bool:
            beat = record.heartbeat
            if beat is None or beat.health is None or beat.scheduler is None:
                return False
            return not beat.scheduler.reachable and any(
                check.name == "scheduler" and check.status == "degraded" and check.reason
                for check in beat.health.checks
            )

        # Each look at a stopped Slurm waits out scheduler_timeout: give a loaded machine time.
        record = await wait_record(bus, prefix, "n1", finding, timeout=60)
        assert record.heartbeat is not None and record.heartbeat.scheduler is not None
        assert not record.heartbeat.scheduler.reachable
        assert record.heartbeat.scheduler.reason
        assert not record.heartbeat.scheduler.services.slurmd_running
        assert agent.supervisor is not None
        assert all(status.restarts == 0 for status in agent.supervisor.check().values())
    finally:
        await asyncio.to_thread(start_daemon, slurm, "slurmctld")
        await asyncio.to_thread(start_daemon, slurm, "slurmd")
        await slurm.until_state("idle")
