"""``fleetctl deploy`` without a node, ``undeploy`` and ``workloads`` as a careless
operator runs them: usage errors before anything is sent, one-line errors, and a server
whose aggregators predate placement (no ``fleet_workloads``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from actors.runtime.bus import NatsBus
from actors.runtime.embedded import NatsServer
from schemas.subjects import BUCKET_WORKLOADS, Subjects
from tests.cli.test_fleetctl_commands import finish, fleetctl
from tests.cli.test_workloads_cli import workloads


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["chat", "--gpus", "0,1"], 1, "without a node, --gpus is how many GPUs"),
        (["n1", "chat", "--replicas", "2"], 2, "--replicas and --gpu-memory place the workload"),
        (["chat", "--replicas", "0"], 2, "must be 1 or more"),
        (["chat", "--replicas", "65"], 2, "at most 64 replicas"),
        (["chat", "--gpu-memory", "lots"], 2, "is not a size like 40G"),
    ],
)
async def test_placed_deploy_usage_errors(
    nats_server: NatsServer,
    prefix: str,
    operator_file: Path,
    args: list[str],
    code: int,
    message: str,
) -> None:
    """Each mistake exits with its code and one line naming it, no traceback."""
    process = await fleetctl(
        nats_server, prefix, operator_file, "deploy", *args, "--engine", "llamacpp"
    )
    got, out, err = await finish(process)
    assert got == code and message in err, out + err
    assert "Traceback" not in err


async def test_undeploy_of_an_unknown_workload_fails(
    nats_server: NatsServer, bus: NatsBus, prefix: str, operator_file: Path
) -> None:
    """undeploy of a name nothing placed exits 1 saying so."""
    got, _, err = await finish(
        await fleetctl(nats_server, prefix, operator_file, "undeploy", "ghost")
    )
    assert got == 1 and "no placed workload named ghost" in err


async def test_workloads_lists_without_a_placement_bucket(
    nats_server: NatsServer, bus: NatsBus, prefix: str
) -> None:
    """Where aggregators predate placement (no fleet_workloads), workloads still lists
    (nothing here) instead of failing."""
    await bus.js.delete_key_value(Subjects(prefix).bucket_name(BUCKET_WORKLOADS))
    got, out, err = await workloads(nats_server, prefix)
    assert got == 0 and out == "no workloads\n", err
