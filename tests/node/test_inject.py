"""Fault injection end to end: node-agent inject -> fake GPUs -> health -> heartbeat record."""

from __future__ import annotations

import asyncio
import time
from collections import namedtuple
from pathlib import Path

import psutil
import pytest
from nats.aio.msg import Msg

from actors.cli import node_agent as node_cli
from actors.cli import node_commands
from actors.node.agent import NodeAgent
from actors.node.inventory.actor import CpuMeter, InventoryActor
from actors.node.inventory.fake_gpus import FakeGpus
from actors.node.inventory.nvml_gpus import NvmlGpus
from actors.runtime.bus import NatsBus
from schemas import codec, signing
from schemas.events import Inject
from schemas.messages import Heartbeat, NodeRecord
from schemas.subjects import Subjects
from tests.node.test_nvml import two_gpus
from tests.support.fleet import Fleet, agent_config, node_events, wait_for, wait_record


def check(record: NodeRecord, name: str) -> str:
    """The status of one health check in the record's latest heartbeat ('' if none)."""
    health = record.heartbeat.health if record.heartbeat else None
    found = [c.status for c in (health.checks if health else []) if c.name == name]
    return found[0] if found else ""


def points(record: NodeRecord, name: str) -> int | None:
    health = record.heartbeat.health if record.heartbeat else None
    found = [c.points for c in (health.components if health else []) if c.name == name]
    return found[0] if found else None


def hot_beat(beat: Heartbeat) -> bool:
    components = beat.health.components if beat.health else []
    return any(c.name == "gpu_temperature" and c.points == 0 for c in components)


def operator_file(fleet: Fleet) -> Path:
    """The key file of the operator whose faults the test's agent takes (made if missing)."""
    path = fleet.state_dir / "operator.nk"
    signing.load_or_create_key_file(path)
    return path


async def faulty_agent(fleet: Fleet) -> NodeAgent:
    """Agent n1, trusting the test's operator with faults."""
    operator = signing.load_key_file(operator_file(fleet))
    return await fleet.start_agent(fleet.config(trust_operators=[operator.public_key]))


async def inject_cli(fleet: Fleet, *args: str, key_file: Path | None = None) -> int:
    """``node-agent inject`` for node n1, signed with the test's operator key (or
    ``key_file``)."""
    key = str(key_file or operator_file(fleet))
    argv = ["inject", *args, "--server", fleet.url, "--node-id", "n1", "--prefix", fleet.prefix]
    argv += ["--key-file", key]
    # main() runs its own event loop, so it runs in a thread like a separate process would.
    return await asyncio.to_thread(node_cli.main, argv)


async def test_temperature_fault_shows_and_clears(fleet: Fleet, bus: NatsBus, prefix: str) -> None:
    """inject temp 95 zeroes the temperature component and degrades nvml within two
    heartbeat intervals (counted in heartbeats, not seconds); clear heals."""
    beats: list[Heartbeat] = []

    async def collect(msg: Msg) -> None:
        beats.append(codec.decode(msg.data, Heartbeat))

    await bus.subscribe(Subjects(prefix).heartbeats(), collect)
    await bus.flush()
    await fleet.start_aggregator()
    await faulty_agent(fleet)
    await wait_record(bus, prefix, "n1", lambda r: r.health_status == "healthy")
    assert await inject_cli(fleet, "temp", "95", "--gpu", "1") == 0
    injected_after = len(beats)
    await wait_for(lambda: any(hot_beat(beat) for beat in beats[injected_after:]))
    first_hot = next(i for i, beat in enumerate(beats) if hot_beat(beat))
    # The beat in flight at injection, then one per interval: the third at the latest.
    assert first_hot - injected_after <= 2, (injected_after, first_hot)
    # The state is the owner's verdict, written a moment after the heartbeat it judged
    # can be read live: wait for both.
    hot = await wait_record(
        bus,
        prefix,
        "n1",
        lambda r: points(r, "gpu_temperature") == 0 and r.state == "degraded",
    )
    assert check(hot, "nvml") == "degraded"
    assert hot.state == "degraded"
    assert hot.heartbeat and hot.heartbeat.health
    assert "hottest GPU 95 C (GPU 1)" in [c.reason for c in hot.heartbeat.health.components]
    assert await inject_cli(fleet, "clear") == 0
    healed = await wait_record(bus, prefix, "n1", lambda r: r.health_status == "healthy")
    assert check(healed, "nvml") == "ok"


async def test_xid_and_lost_gpu_make_node_unhealthy(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """An injected XID 79 makes the xid check unhealthy; a lost GPU the nvml check."""
    await fleet.start_aggregator()
    await faulty_agent(fleet)
    await wait_record(bus, prefix, "n1", lambda r: r.health_status == "healthy")
    operator = signing.load_key_file(operator_file(fleet))
    fault = Inject(ts=time.time(), node_id="n1", fault="xid", gpu=0, value=79)
    await node_commands.publish_inject(bus, prefix, fault, operator)
    broken = await wait_record(bus, prefix, "n1", lambda r: check(r, "xid") == "unhealthy")
    assert broken.health_status == "unhealthy"
    lost = Inject(ts=time.time(), node_id="n1", fault="gpu-lost", gpu=1)
    await node_commands.publish_inject(bus, prefix, lost, operator)
    gone = await wait_record(bus, prefix, "n1", lambda r: check(r, "nvml") == "unhealthy")
    assert gone.heartbeat and gone.heartbeat.sample
    assert [gpu.lost for gpu in gone.heartbeat.sample.gpus] == [False, True]


async def test_inject_signed_with_the_nodes_own_key_is_refused(
    fleet: Fleet, bus: NatsBus, prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``inject --key-file`` naming the node's own key is one error line and exit 1: the
    agent takes faults only from its operators, so it would be dropped unseen."""
    await fleet.start_aggregator()
    await faulty_agent(fleet)
    await wait_record(bus, prefix, "n1", lambda r: r.public_key != "")
    assert await inject_cli(fleet, "clear", key_file=fleet.config().key_path) == 1
    assert "--key-file is node n1's own key" in capsys.readouterr().err


def dropped(agent: NodeAgent, reason: str) -> float:
    """Events the agent dropped for ``reason``, whichever actor counted them."""
    return sum(
        sample.value
        for family in agent.metrics.registry.collect()
        for sample in family.samples
        if sample.name == "node_agent_events_dropped_total" and sample.labels["reason"] == reason
    )


async def test_a_rehearsed_spot_notice_drains_and_deregisters(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """inject spot --in 20s on a node watching no cloud: its heartbeat carries an aws
    terminate notice marked rehearsal, due 20 s after the inject was signed, and the node
    drains and deregisters before then, as for a cloud's notice. The same inject signed
    with the node's own key is dropped (no_session: not an operator's) and changes nothing."""
    await fleet.start_aggregator()
    agent = await faulty_agent(fleet)
    await wait_record(bus, prefix, "n1", lambda r: r.state == "active")
    forged = Inject(ts=time.time(), node_id="n1", fault="spot", value=5.0)
    await node_commands.publish_inject(bus, prefix, forged, fleet.node_key())
    await wait_for(lambda: dropped(agent, "no_session") == 1)
    signed = time.time()
    assert await inject_cli(fleet, "spot", "--in", "20s") == 0
    noticed = await wait_record(
        bus,
        prefix,
        "n1",
        lambda r: bool(r.heartbeat and r.heartbeat.spot and r.heartbeat.spot.notice),
    )
    assert noticed.heartbeat is not None and noticed.heartbeat.spot is not None
    notice = noticed.heartbeat.spot.notice
    assert notice is not None and notice.rehearsal
    assert (notice.provider, notice.kind) == ("aws", "terminate")
    assert notice.deadline is not None and 0 <= notice.deadline - (signed + 20) < 5
    gone = await wait_record(bus, prefix, "n1", lambda r: r.deregistered, timeout=20)
    assert gone.last_seen < notice.deadline


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["temp"], "inject temp needs a value"),
        (["clear", "3"], "inject clear takes no value"),
        (["spot", "120"], "inject spot takes no value (give --in)"),
        (["spot", "--gpu", "1"], "inject spot takes no --gpu"),
        (["temp", "90", "--in", "5s"], "--in is for inject spot only"),
        (["gpu-lost", "--gpu", "-1"], "--gpu must be a GPU index"),
        (["clear"], "inject needs --key-file: an operator key the agent trusts"),
    ],
)
def test_inject_cli_refuses_bad_input(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Bad inject arguments are one clear error line and exit 1, before any connection."""
    assert node_cli.main(["inject", *args, "--server", "nats://127.0.0.1:1"]) == 1
    assert message in capsys.readouterr().err


def test_fake_gpu_faults_per_gpu_and_all() -> None:
    """Faults hit one GPU or all; clear restores readings and forgets XIDs."""
    gpus = FakeGpus(3, "n1")
    gpus.apply(Inject(ts=1.0, node_id="n1", fault="temp", value=91.0))
    gpus.apply(Inject(ts=1.0, node_id="n1", fault="util", gpu=2, value=150.0))
    gpus.apply(Inject(ts=1.0, node_id="n1", fault="xid", gpu=1, value=48))
    gpus.apply(Inject(ts=1.0, node_id="n1", fault="xid", gpu=1, value=48))
    read = gpus.read()
    assert [gpu.temperature_c for gpu in read] == [91.0, 91.0, 91.0]
    assert read[2].utilization_pct == 100.0
    assert [(xid.code, xid.count) for xid in read[1].xids] == [(48, 2)]
    gpus.apply(Inject(ts=1.0, node_id="n1", fault="clear"))
    cleared = gpus.read()
    assert all(gpu.temperature_c != 91.0 and gpu.xids == [] for gpu in cleared)
    with pytest.raises(ValueError, match="no GPU 7"):
        gpus.apply(Inject(ts=1.0, node_id="n1", fault="gpu-lost", gpu=7))


async def test_real_gpus_ignore_injection(tmp_path: Path, bus: NatsBus) -> None:
    """In NVML mode an inject is logged and ignored; the GPU source is untouched."""
    config = agent_config("nats://127.0.0.1:1", "t", tmp_path, fake_gpus=None)
    nvml = NvmlGpus(nvml=two_gpus())
    actor = InventoryActor(config, bus, node_events(config), gpus=nvml)
    await actor._on_inject(Inject(ts=1.0, node_id="n1", fault="gpu-lost"))
    assert not any(gpu.lost for gpu in nvml.read())
    assert not actor._sample_now.is_set()


def test_cpu_percent_is_a_delta_between_samples(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU% is busy time over elapsed time since the previous sample, never since boot,
    and two meters (two agents in one process) do not disturb each other."""
    Times = namedtuple("Times", "user nice system idle iowait guest guest_nice")
    # Since boot the machine was idle 90 % of the time; the next period is 50 % busy.
    readings = iter(
        [
            Times(10, 0, 0, 90, 0, 0, 0),
            Times(10, 0, 0, 90, 0, 0, 0),
            Times(15, 0, 0, 95, 0, 0, 0),
            Times(16, 0, 1, 103, 0, 0, 0),
        ]
    )
    monkeypatch.setattr(psutil, "cpu_times", lambda: next(readings))
    first, second = CpuMeter(), CpuMeter()
    assert first.read() == 50.0
    assert second.read() == 35.0  # 7 s busy of 20 s since its own start, not first's


def test_inject_help_renders(capsys: pytest.CaptureFixture[str]) -> None:
    """node-agent inject --help prints its usage and exits 0."""
    with pytest.raises(SystemExit) as exit_info:
        node_cli.main(["inject", "--help"])
    assert exit_info.value.code == 0
    assert "gpu-lost" in capsys.readouterr().out
