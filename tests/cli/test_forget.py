"""``fleetctl forget`` (issue 9): a dead node removed from the provider side, and
``fleetctl approve`` admitting it again."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import nats.js.errors
import pytest

from actors.cli.fleetctl.main import main
from actors.fleet.operator.commands import new_command, publish_command
from actors.fleet.storage.records import read_record
from actors.fleet.storage.registry import NotFound, trust_entry
from actors.fleet.views import history
from actors.node.agent import NodeAgent
from actors.runtime.bus import NatsBus
from schemas import signing
from schemas.messages import Alert, Cordon
from schemas.subjects import STREAM_COMMANDS, Subjects
from tests.support.fleet import Fleet, wait_for, wait_record


async def fleetctl(
    capsys: pytest.CaptureFixture[str], fleet: Fleet, *args: str
) -> tuple[int, str, str]:
    code = await asyncio.to_thread(main, [*args, "--server", fleet.url, "--prefix", fleet.prefix])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


async def test_forget_deregisters_revokes_purges_hides_and_approve_readmits(
    fleet: Fleet,
    bus: NatsBus,
    prefix: str,
    node: NodeAgent,
    operator_file: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """forget of an offline node: record deregistered naming the operator key and the
    reason, key revoked, its queued command purged, hidden from 'nodes' but shown with
    --all; forgetting again changes nothing; approve admits it again."""
    subjects = Subjects(prefix)
    operator = signing.load_key_file(operator_file)
    node_key = signing.load_key_file(node.config.key_path)
    await node.stop()
    await publish_command(bus, subjects, operator, new_command("n1", "c1", Cordon()))
    stream = subjects.stream_name(STREAM_COMMANDS)
    assert await bus.js.get_last_msg(stream, subjects.command("c1", "n1"))

    key = ["--key-file", str(operator_file)]
    code, out, err = await fleetctl(capsys, fleet, "forget", "n1", "--reason", "dead", *key)
    assert (code, err) == (0, "")
    assert "forgotten" in out and "key revoked" in out
    record = await read_record(bus, subjects, "n1")
    assert record.state == "deregistered" and record.deregistered
    assert record.deregistered_by == operator.public_key
    assert record.deregistered_reason == "dead" and record.deregistered_at is not None
    entry = await trust_entry(bus, subjects, "n1")
    assert entry is not None and entry.revoked
    with pytest.raises(nats.js.errors.NotFoundError):
        await bus.js.get_last_msg(stream, subjects.command("c1", "n1"))

    code, out, err = await fleetctl(capsys, fleet, "forget", "n1", "--reason", "dead", *key)
    assert code == 0 and "already forgotten" in out
    assert (await read_record(bus, subjects, "n1")).deregistered_at == record.deregistered_at

    code, out, _ = await fleetctl(capsys, fleet, "nodes")
    assert code == 0 and "n1" not in out
    code, out, _ = await fleetctl(capsys, fleet, "nodes", "--all", "-o", "wide")
    assert code == 0 and "n1" in out and "deregistered" in out and "forgotten by" in out

    code, out, _ = await fleetctl(capsys, fleet, "describe", "n1")
    assert code == 0 and f"Deregistered:    by {operator.public_key}" in out and "dead" in out

    code, out, err = await fleetctl(capsys, fleet, "approve", "n1", node_key.public_key)
    assert code == 0 and "re-admitted" in out, err
    readmitted = await read_record(bus, subjects, "n1")
    assert not readmitted.deregistered and readmitted.state != "deregistered"
    last = readmitted.last_seq
    again = await fleet.start_agent(node.config)
    await wait_record(bus, prefix, "n1", lambda r: r.state == "active" and r.last_seq > last)
    assert again.supervisor is not None and await again.supervisor.wait_ready(10)


async def test_forget_of_an_unknown_node_is_one_error_line(
    fleet: Fleet, operator_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A node with neither record nor key: exit 1 and one line, nothing created."""
    operator = signing.load_key_file(operator_file)
    await fleet.start_aggregator(trust_operators=[operator.public_key])
    code, out, err = await fleetctl(
        capsys, fleet, "forget", "ghost", "--key-file", str(operator_file)
    )
    assert code == 1 and out == ""
    assert err.strip() == "error: forget ghost refused: node ghost has no record and no key"
    with pytest.raises(NotFound):
        await read_record(fleet.bus, Subjects(fleet.prefix), "ghost")


async def test_forget_without_an_aggregator_is_one_error_line(
    fleet: Fleet, operator_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No aggregator to carry the request out: exit 1 and one line saying so."""
    code, out, err = await fleetctl(
        capsys, fleet, "forget", "n1", "--key-file", str(operator_file), "--timeout", "1"
    )
    assert code == 1 and out == ""
    assert err.strip() in (
        "error: no aggregator is running to take the request",
        "error: no aggregator answered within 1s",
    )


async def alerts_of(bus: NatsBus, prefix: str, node: str = "n1") -> list[Alert]:
    alerts, _ = await history.node_history(bus, Subjects(prefix), node)
    return [entry.message for entry in alerts if isinstance(entry.message, Alert)]


async def test_forget_raises_forgotten_and_its_beats_are_refused_as_forgotten(
    fleet: Fleet,
    bus: NatsBus,
    prefix: str,
    node: NodeAgent,
    operator_file: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """forget of a node that still beats: a `forgotten` alert naming the operator key and
    the reason is among the node's events, and its next heartbeats are refused as
    `forgotten` (not `unknown_node`)."""
    operator = signing.load_key_file(operator_file)
    key = ["--key-file", str(operator_file)]
    code, _, err = await fleetctl(capsys, fleet, "forget", "n1", "--reason", "rma", *key)
    assert (code, err) == (0, "")

    def kinds(alerts: list[Alert]) -> list[tuple[str, str]]:
        return [(a.kind, a.id.rsplit(":", 1)[1][:7]) for a in alerts]

    found = await wait_for(
        lambda: _with(alerts_of(bus, prefix), lambda a: ("forgotten", "forget-") in kinds(a)
                      and any(k == "forgotten" and e.startswith("s") for k, e in kinds(a))),
    )  # fmt: skip
    lifecycle = next(a for a in found if a.id.rsplit(":", 1)[1].startswith("forget-"))
    assert lifecycle.details["by"] == operator.public_key and lifecycle.details["reason"] == "rma"
    assert "rma" in lifecycle.message
    assert "unknown_node" not in [a.kind for a in found]
    code, out, _ = await fleetctl(capsys, fleet, "events", "n1")
    assert code == 0 and "forgotten: forgotten by operator" in out


async def test_a_revoked_node_that_beats_is_refused_as_revoked(
    fleet: Fleet,
    bus: NatsBus,
    prefix: str,
    node: NodeAgent,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`fleetctl revoke` of a beating node: its heartbeats are refused as `revoked`."""
    code, _, err = await fleetctl(capsys, fleet, "revoke", "n1")
    assert (code, err) == (0, "")
    found = await wait_for(
        lambda: _with(alerts_of(bus, prefix), lambda a: "revoked" in [x.kind for x in a]), 15
    )
    assert "unknown_node" not in [a.kind for a in found]


async def test_a_node_unhealthy_from_its_first_heartbeat_raises_health(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """An agent whose boot check fails from the start (4 GPUs expected, 2 present): its
    first health report raises a critical `health` alert (none -> unhealthy)."""
    await fleet.start_aggregator()
    await fleet.start_agent(fleet.config(expected_gpus=4))
    found = await wait_for(
        lambda: _with(alerts_of(bus, prefix), lambda a: "health" in [x.kind for x in a]), 15
    )
    alert = next(a for a in found if a.kind == "health")
    assert alert.details["from"] == "none" and alert.details["to"] == "unhealthy"
    assert alert.severity == "critical"


async def _with(
    read: Awaitable[list[Alert]], check: Callable[[list[Alert]], bool]
) -> list[Alert] | None:
    alerts = await read
    return alerts if check(alerts) else None
