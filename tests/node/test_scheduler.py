"""The scheduler actor's parsing and failure handling without a Slurm cluster (the real
cluster's tests are in test_slurm.py): what ``scontrol`` prints, tools that are missing or
hang, the health finding, and the systemd ordering."""

from __future__ import annotations

import configparser
from pathlib import Path

import msgspec
import pytest

from actors.node import slurm
from actors.node.health.checks import scheduler_check
from actors.node.heartbeat.actor import HeartbeatActor
from actors.node.heartbeat.sequence import SequenceStore
from actors.node.inventory.actor import InventoryActor
from actors.node.scheduler import SchedulerActor
from schemas.events import Scheduler, SchedulerServices
from tests.support.fleet import Fleet, agent_config, node_events

UNIT = Path(__file__).parents[2] / "deploy" / "nats" / "systemd" / "node-agent.service"

ONELINER = (
    "NodeName=gpu7 Arch=x86_64 CoresPerSocket=1  CPUAlloc=1 CPUEfctv=2 CPUTot=2 "
    "OS=Linux 6.1.0 #1 SMP PREEMPT_DYNAMIC Debian  RealMemory=1000 State=MIXED+DRAIN "
    "Partitions=debug  CapWatts=n/a Reason=fleet: gpu 3 XID 79 (c-42) [root@2026-11-21T12:53:13]"
)


def test_scontrol_oneliner_is_parsed() -> None:
    """State (lower case) and the drain reason without Slurm's [user@time] tail; the marker
    tells our drain from an admin's."""
    info = slurm.parse_node(ONELINER)
    assert info.state == "mixed+drain" and info.drain
    assert info.reason == "fleet: gpu 3 XID 79 (c-42)" and info.ours
    admin = slurm.parse_node("NodeName=gpu7 State=IDLE+DRAIN Reason=bad DIMM [admin@2026-01-01]")
    assert admin.drain and not admin.ours and admin.reason == "bad DIMM"
    idle = slurm.parse_node("NodeName=gpu7 State=IDLE Reason=(null)")
    assert not idle.drain and idle.reason == ""
    with pytest.raises(slurm.SlurmError, match="no State"):
        slurm.parse_node("scontrol: error: something")


def test_cpus_slurm_schedules_and_allocates_are_read() -> None:
    """CPUTot and CPUAlloc of the one-liner; None where scontrol prints neither."""
    info = slurm.parse_node(ONELINER)
    assert (info.cpus_total, info.cpus_allocated) == (2, 1)
    bare = slurm.parse_node("NodeName=gpu7 State=IDLE")
    assert (bare.cpus_total, bare.cpus_allocated) == (None, None)


def test_free_cores_in_the_heartbeat_are_slurms_where_it_answers(tmp_path: Path) -> None:
    """cpu_cores_available is CPUTot - CPUAlloc while Slurm answers, the sample's idle
    share otherwise (no Slurm, or Slurm not answering)."""
    config = agent_config("nats://127.0.0.1:1", "t", tmp_path)
    actor = HeartbeatActor(config, None, node_events(config), SequenceStore(tmp_path))  # type: ignore[arg-type]
    actor.sample = InventoryActor(config, None, None).sample()  # type: ignore[arg-type]
    own = actor.sample.capacity.cpu_cores_available
    assert own is not None and 0 <= own <= actor.sample.capacity.cpu_cores
    answering = Scheduler(ts=1.0, kind="slurm", reachable=True, cpus_total=64, cpus_allocated=24)
    actor.scheduler = answering
    beat = actor.sample_now()
    assert beat is not None and beat.capacity.cpu_cores_available == 40
    actor.scheduler = msgspec.structs.replace(answering, reachable=False)
    beat = actor.sample_now()
    assert beat is not None and beat.capacity.cpu_cores_available == own


def test_drain_reason_carries_marker_and_command_id() -> None:
    """Our drains say so: ``fleet: <reason> (<command id>)``, one line."""
    reason = slurm.drain_reason("bad\nfan", "abc-1")
    assert reason == "fleet: bad fan (abc-1)"
    assert slurm.parse_node(f"State=IDLE+DRAIN Reason={reason} [root@t]").ours


def fake_tool(directory: Path, name: str, script: str) -> None:
    path = directory / name
    path.write_text(f"#!/bin/sh\n{script}\n")
    path.chmod(0o755)


async def test_a_hanging_tool_is_killed_at_its_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Slurm tool that hangs is killed at the timeout and answered as a reason."""
    fake_tool(tmp_path, "scontrol", "exec /bin/sleep 30")
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(slurm.SlurmError, match=r"no answer within 0\.3s"):
        await slurm.node_info("gpu7", 0.3)


async def test_a_failing_tool_says_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Slurm tool's failure is its last stderr line."""
    fake_tool(
        tmp_path, "squeue", "echo 'squeue: error: Unable to contact slurm controller' >&2\nexit 1"
    )
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(slurm.SlurmError, match="Unable to contact slurm controller"):
        await slurm.running_jobs("gpu7", 5)


async def test_auto_without_slurm_reports_no_scheduler(
    fleet: Fleet, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``auto`` and no scontrol the node has no scheduler (no finding); with ``slurm``
    the same is an unreachable Slurm, with the reason."""
    monkeypatch.setenv("PATH", str(tmp_path))
    config = fleet.config(scheduler="auto")
    auto = await SchedulerActor(config, fleet.bus, node_events(config)).observe()
    assert auto.kind == "none" and "scontrol not found" in auto.reason
    config = fleet.config(scheduler="slurm", slurm_node_name="gpu7")
    forced = await SchedulerActor(config, fleet.bus, node_events(config)).observe()
    assert forced.kind == "slurm" and not forced.reachable and forced.node_name == "gpu7"
    assert "scontrol not found" in forced.reason
    assert scheduler_check(forced).status == "degraded"


def test_scheduler_check() -> None:
    """Unreachable Slurm, a down node or a stopped slurmd/munged is degraded with the
    reason; a drained but healthy node is ok."""
    services = SchedulerServices(slurmd_running=True, munge_running=True)
    base = Scheduler(ts=1.0, kind="slurm", node_name="gpu7", reachable=True, services=services)
    assert scheduler_check(base).status == "ok"
    drained = Scheduler(
        ts=1.0,
        kind="slurm",
        node_name="gpu7",
        reachable=True,
        slurm_state="idle+drain",
        drain=True,
        services=services,
    )
    assert scheduler_check(drained).status == "ok"
    down = Scheduler(
        ts=1.0,
        kind="slurm",
        node_name="gpu7",
        reachable=True,
        slurm_state="down*",
        state_reason="Not responding",
        services=services,
    )
    check = scheduler_check(down)
    assert (
        check.status == "degraded" and "down*" in check.reason and "Not responding" in check.reason
    )
    no_munge = Scheduler(
        ts=1.0,
        kind="slurm",
        node_name="gpu7",
        reachable=True,
        slurm_state="idle",
        services=SchedulerServices(slurmd_running=True),
    )
    assert scheduler_check(no_munge).reason == "munged not running"


def test_unit_orders_after_slurmd_without_requiring_it() -> None:
    """The agent's unit starts after slurmd where there is one, and does not need it."""
    lines = UNIT.read_text().splitlines()
    assert "After=slurmd.service" in lines
    parsed = configparser.ConfigParser(interpolation=None, strict=False)
    parsed.read_string(UNIT.read_text())
    unit = parsed["Unit"]
    assert "slurmd" not in unit.get("Requires", "") and "slurmd" not in unit.get("BindsTo", "")
