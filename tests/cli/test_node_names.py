"""Node names as operators type them: lists and ranges, and a did-you-mean for a node the
fleet does not know (actors/cli/node_names.py)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from actors.cli.node_names import did_you_mean, expand_nodes
from actors.runtime.bus import NatsBus
from actors.runtime.embedded import NatsServer
from schemas import codec
from schemas.errors import InvalidToken
from schemas.messages import NodeRecord
from schemas.subjects import BUCKET_NODES, Subjects

FLEETCTL = str(Path(sys.executable).parent / "fleetctl")


def test_lists_and_ranges_expand_as_slurm_hostlists() -> None:
    """Commas separate names, a [first-last] range keeps its zero padding, repeats go,
    and a name that is no node id, a reversed or huge range, is refused."""
    assert expand_nodes("node[1-3],gpu-a") == ["node1", "node2", "node3", "gpu-a"]
    assert expand_nodes("n[08-10]-x,n09-x") == ["n08-x", "n09-x", "n10-x"]
    assert expand_nodes("node-1") == ["node-1"]
    for wrong in ("n[3-1]", "n[1-99999999]", "a b", "n[1-2"):
        with pytest.raises(InvalidToken):
            expand_nodes(wrong)


def test_did_you_mean_names_the_closest() -> None:
    """The closest known names, or nothing when none is close."""
    assert did_you_mean("nod-1", ["node-1", "gpu-a"]) == " (did you mean node-1?)"
    assert did_you_mean("nod-1", ["node-1", "node-2"]) == " (did you mean node-1 or node-2?)"
    assert did_you_mean("zzz", ["node-1"]) == ""


async def test_describe_an_unknown_node_suggests_a_known_one(
    nats_server: NatsServer, bus: NatsBus, prefix: str
) -> None:
    """`fleetctl describe nod-1` in a fleet with node-1: one line, exit 1, naming node-1."""
    bucket = await bus.kv(Subjects(prefix).bucket_name(BUCKET_NODES))
    record = NodeRecord(node_id="node-1", cluster="c1", state="active", last_seq=1, last_seen=1.0)
    await bucket.put("node-1", codec.encode(record))
    process = await asyncio.create_subprocess_exec(
        *(FLEETCTL, "describe", "nod-1", "--server", nats_server.url, "--prefix", prefix),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    _, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 1
    assert err.decode() == "error: node nod-1 not found (did you mean node-1?)\n"
