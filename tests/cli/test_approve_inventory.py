"""Approving with eyes open: ``node-agent register`` sends the machine's inventory (host,
GPU model and count, cloud, instance type, from NVML or the stand-in and the cloud's
metadata service), ``fleetctl nodes --state pending`` and ``fleetctl approve`` show it,
and the approval records it as the node's enrolled identity."""

from __future__ import annotations

import asyncio
import socket

import pytest

from actors.cli.fleetctl.main import main
from actors.cli.node_commands import register
from actors.fleet.storage.registry import trust_entry
from schemas import signing
from schemas.subjects import Subjects
from tests.support.fleet import Fleet
from tests.support.metadata_fakes import FakeAws


async def fleetctl(
    capsys: pytest.CaptureFixture[str], fleet: Fleet, *args: str
) -> tuple[int, str, str]:
    code = await asyncio.to_thread(main, [*args, "--server", fleet.url, "--prefix", fleet.prefix])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


async def test_pending_listing_and_approval_show_the_machine(
    fleet: Fleet, capsys: pytest.CaptureFixture[str]
) -> None:
    """An 8-GPU node on (fake) AWS registers: the pending listing shows its host, GPUs,
    provider, instance type and region beside its key's fingerprint; approve shows the
    same identity and records it; the enrolled identity holds every fact."""
    aws = await fleet.start_fake(FakeAws())
    await fleet.start_aggregator()
    config = fleet.config(
        "gpu-17", fake_gpus=8, spot_provider="aws", metadata_url=aws.url, labels={"rack": "r7"}
    )
    signing.create_key_file(config.key_path)
    reply = await register(config)
    assert reply is not None and reply.status == "pending"
    host = socket.gethostname()

    code, out, err = await fleetctl(capsys, fleet, "nodes", "--state", "pending")
    assert code == 0, err
    header, row, *rest = out.splitlines()
    assert header.split()[:4] == ["NODE", "CLUSTER", "REGISTERED", "KEY"]
    assert row.startswith("gpu-17") and "SHA256:" in row and host in row
    assert "8 x NVIDIA H100 80GB HBM3" in row
    assert row.split()[-3:] == ["aws", "p5.48xlarge", "us-east-1"]
    assert rest[-1].startswith("1 node: 1 pending; what each says of its machine is its claim")

    code, out, err = await fleetctl(capsys, fleet, "approve", "gpu-17", "--yes")
    assert (code, out) == (0, "approved gpu-17\n"), err
    assert (
        f"identity host {host}, 8 GPUs (NVIDIA H100 80GB HBM3), aws p5.48xlarge us-east-1: GPU-"
        in err
    )
    entry = await trust_entry(fleet.bus, Subjects(fleet.prefix), "gpu-17")
    assert entry is not None and entry.identity is not None
    enrolled = entry.identity
    assert (enrolled.hostname, enrolled.gpu_count, len(enrolled.gpus)) == (host, 8, 8)
    assert (enrolled.provider, enrolled.instance_type, enrolled.region) == (
        "aws",
        "p5.48xlarge",
        "us-east-1",
    )


async def test_an_on_premises_registration_names_no_cloud(
    fleet: Fleet, capsys: pytest.CaptureFixture[str]
) -> None:
    """With spot_provider auto and no metadata service answering, registration does not
    wait on one: the identity names no cloud unless the operator's labels do (they win,
    as in heartbeats), and the listing shows '-' for what is unknown."""
    aws = await fleet.start_fake(FakeAws())
    await aws.stop()  # nothing answers there now
    await fleet.start_aggregator()
    config = fleet.config(
        "rack-3",
        fake_gpus=2,
        spot_provider="auto",
        metadata_url=aws.url,
        labels={"provider": "onprem", "region": "dc1"},
    )
    signing.create_key_file(config.key_path)
    reply = await register(config)
    assert reply is not None and reply.status == "pending"
    code, out, err = await fleetctl(capsys, fleet, "nodes", "--state", "pending")
    assert code == 0, err
    row = out.splitlines()[1]
    assert "2 x NVIDIA H100 80GB HBM3" in row
    assert row.split()[-3:] == ["onprem", "-", "dc1"]
