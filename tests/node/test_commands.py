"""The command executor against a real nats-server: actions, refusals, persistence, hooks."""

from __future__ import annotations

import asyncio
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

import nats.errors
import pytest
from nats.aio.msg import Msg

from actors.fleet.storage.registry import approve
from actors.node.agent import NodeAgent
from actors.node.commands.actor import CommandsActor
from actors.runtime.bus import NatsBus
from schemas import codec, signing
from schemas.events import Interruption
from schemas.messages import (
    Command,
    Cordon,
    Deregister,
    Drain,
    Heartbeat,
    Uncordon,
    command_digest,
)
from schemas.subjects import EVENT_INTERRUPTION, Subjects
from tests.support.commanding import Results, send, send_raw, set_in_flight
from tests.support.fleet import Fleet, node_events, wait_for, wait_record


@pytest.fixture
def operator() -> signing.KeyPair:
    return signing.KeyPair.generate()


@pytest.fixture
async def results(bus: NatsBus, prefix: str) -> Results:
    return await Results().start(bus, prefix)


async def trusting_agent(fleet: Fleet, operator: signing.KeyPair, **settings: Any) -> NodeAgent:
    """Agent n1 trusting ``operator``, once all its actors are ready."""
    agent = await fleet.start_agent(fleet.config(trust_operators=[operator.public_key], **settings))
    assert agent.supervisor is not None and await agent.supervisor.wait_ready(10)
    return agent


async def test_cordon_drain_uncordon(
    fleet: Fleet,
    bus: NatsBus,
    prefix: str,
    operator: signing.KeyPair,
    results: Results,
) -> None:
    """Cordon, drain (waiting on in-flight work, with progress) and uncordon each show in
    the node's record and answer accepted ... done."""
    await fleet.start_aggregator()
    await trusting_agent(fleet, operator)
    cordon = await send(bus, prefix, operator, Cordon(), reason="maintenance")
    assert (await results.final(cordon.id)).status == "done"
    assert results.statuses(cordon.id)[0] == "accepted"
    record = await wait_record(bus, prefix, "n1", lambda r: r.state == "cordoned")
    # The record says who cordoned: the operator whose key signed the command.
    assert record.heartbeat is not None
    assert record.heartbeat.schedulability_by == operator.public_key

    await set_in_flight(fleet, 3)
    drain = await send(bus, prefix, operator, Drain(deadline=30))
    await wait_record(bus, prefix, "n1", lambda r: r.state == "draining")
    await wait_for(lambda: any(r.in_flight == 3 for r in results.of(drain.id)))
    await set_in_flight(fleet, 1)
    await wait_for(lambda: any(r.in_flight == 1 for r in results.of(drain.id)))
    await set_in_flight(fleet, 0)
    final = await results.final(drain.id)
    assert final.status == "done" and final.schedulability == "drained"
    assert "in_progress" in results.statuses(drain.id)
    await wait_record(bus, prefix, "n1", lambda r: r.state == "drained")

    uncordon = await send(bus, prefix, operator, Uncordon())
    assert (await results.final(uncordon.id)).schedulability == "schedulable"
    record = await wait_record(bus, prefix, "n1", lambda r: r.state == "active")
    assert record.heartbeat is not None and record.heartbeat.schedulability_by == ""


async def test_drain_deadline_passes(
    fleet: Fleet,
    bus: NatsBus,
    prefix: str,
    operator: signing.KeyPair,
    results: Results,
) -> None:
    """A drain whose work never finishes ends drained at its deadline and says so."""
    await trusting_agent(fleet, operator)
    await set_in_flight(fleet, 5)
    drain = await send(bus, prefix, operator, Drain(deadline=0.5))
    final = await results.final(drain.id)
    assert final.status == "done" and final.schedulability == "drained"
    assert "deadline passed with 5 in flight" in final.detail


async def test_a_deregistered_agent_stops_without_draining_again(
    fleet: Fleet,
    bus: NatsBus,
    prefix: str,
    operator: signing.KeyPair,
    results: Results,
) -> None:
    """A deregistration whose drain ran to its deadline with work in flight: the agent,
    finished, stops without the shutdown drain of up to shutdown_timeout (30 s) that would
    wait for the same work again (a --deadline 20 took 50 s)."""
    agent = await trusting_agent(fleet, operator, shutdown_timeout=30.0)
    await set_in_flight(fleet, 5)
    leave = await send(bus, prefix, operator, Deregister(deadline=0.5))
    final = await results.final(leave.id)
    assert (final.status, final.detail) == ("done", "deregistered")
    assert agent.supervisor is not None
    await asyncio.wait_for(agent.supervisor.finished.wait(), 5)
    stopping = time.monotonic()
    await agent.stop()
    assert time.monotonic() - stopping < 10.0  # a loaded machine's stop, a third of a drain


async def test_refused_commands_change_nothing(
    fleet: Fleet,
    bus: NatsBus,
    prefix: str,
    operator: signing.KeyPair,
    results: Results,
) -> None:
    """Unsigned, wrongly signed, untrusted, malformed, misaddressed, expired and duplicate
    commands are each answered rejected and leave the node schedulable. Messages the node
    could not verify or read are answered under their digest only."""
    await trusting_agent(fleet, operator)
    state_file = fleet.state_dir / "n1" / "commands.json"
    now = time.time()

    def command(id: str, **changes: Any) -> bytes:
        fields: dict[str, Any] = dict(
            id=id, node_id="n1", cluster="c1", action=Cordon(), issued_at=now
        )
        fields["expires_at"] = now + 60
        fields.update(changes)
        return codec.encode(Command(**fields))

    body = command("unsigned")
    badsig = body.replace(b"unsigned", b"badsig01")
    untrusted = command("untrusted")
    malformed = b'{"id": "malformed", "node_id": "n1", "action": {"kind": "explode"}}'
    stranger = signing.KeyPair.generate()
    await send_raw(bus, prefix, body, {})
    await send_raw(bus, prefix, badsig, operator.headers(body))
    await send_raw(bus, prefix, untrusted, stranger.headers(untrusted))
    await send_raw(bus, prefix, malformed, operator.headers(malformed))
    other = command("misaddressed", node_id="n2")
    await send_raw(bus, prefix, other, operator.headers(other))
    expired = command("expired", expires_at=now - 1)
    await send_raw(bus, prefix, expired, operator.headers(expired))
    keys = {
        "unsigned": command_digest(body),
        "badsig01": command_digest(badsig),
        "untrusted": command_digest(untrusted),
        "malformed": command_digest(malformed),
        "misaddressed": "misaddressed",
        "expired": "expired",
    }
    reasons = {}
    for name, key in keys.items():
        final = await results.final(key)
        assert final.status == "rejected", name
        assert results.statuses(key) == ["rejected"], name
        reasons[name] = final.detail
    assert "missing Fleet-Key" in reasons["unsigned"]
    assert "does not match" in reasons["badsig01"]
    assert "untrusted" in reasons["untrusted"]
    assert "malformed" in reasons["malformed"]
    assert "another node" in reasons["misaddressed"]
    assert "expired" in reasons["expired"]
    assert not state_file.exists() or b"cordoned" not in state_file.read_bytes()

    # The same id again (a replay past JetStream's duplicate window) is refused too.
    first = await send(bus, prefix, operator, Uncordon())
    assert (await results.final(first.id)).status == "done"
    replay = codec.encode(Command(**{**_fields(first), "action": Cordon()}))
    await send_raw(bus, prefix, replay, operator.headers(replay))
    await wait_for(lambda: "rejected" in results.statuses(first.id))
    assert "duplicate" in results.of(first.id)[-1].detail
    assert results.of(first.id)[-1].schedulability == "schedulable"


def _fields(command: Command) -> dict[str, Any]:
    return {name: getattr(command, name) for name in command.__struct_fields__}


async def test_command_sent_while_stopped_runs_after_restart(
    fleet: Fleet,
    bus: NatsBus,
    prefix: str,
    operator: signing.KeyPair,
    results: Results,
) -> None:
    """A cordon published while the agent is down runs when it starts, and the cordon
    survives another restart."""
    await fleet.start_aggregator()
    agent = await trusting_agent(fleet, operator)
    await agent.stop()
    cordon = await send(bus, prefix, operator, Cordon(), reason="while down")
    agent = await trusting_agent(fleet, operator)
    assert (await results.final(cordon.id)).status == "done"
    await wait_record(bus, prefix, "n1", lambda r: r.state == "cordoned")
    await agent.stop()
    await trusting_agent(fleet, operator)
    seq = (await wait_record(bus, prefix, "n1", lambda r: True)).last_seq
    record = await wait_record(bus, prefix, "n1", lambda r: r.last_seq > seq + 1)
    assert record.state == "cordoned"
    assert results.statuses(cordon.id).count("done") == 1


async def test_cordon_ttl_expires_into_uncordon(
    fleet: Fleet,
    bus: NatsBus,
    prefix: str,
    operator: signing.KeyPair,
    results: Results,
) -> None:
    """A cordon with a TTL lifts by itself, answered as '<id>:ttl'."""
    await trusting_agent(fleet, operator)
    cordon = await send(bus, prefix, operator, Cordon(ttl=0.5))
    done = await results.final(cordon.id)
    assert done.schedulability == "cordoned"
    expiry = await results.final(f"{cordon.id}:ttl")
    assert expiry.status == "done" and expiry.schedulability == "schedulable"


async def test_hanging_hook_is_killed_and_reported(
    fleet: Fleet,
    bus: NatsBus,
    prefix: str,
    operator: signing.KeyPair,
    results: Results,
    tmp_path: Path,
) -> None:
    """A hook that hangs is killed at hooks_timeout and reported; hooks get the FLEET_*
    environment."""
    seen = tmp_path / "hook.env"
    await trusting_agent(
        fleet,
        operator,
        on_cordon="sleep 30",
        on_uncordon=f'echo "$FLEET_ACTION $FLEET_NODE_ID $FLEET_CLUSTER $FLEET_COMMAND_ID">{seen}',
        hooks_timeout=0.5,
    )
    cordon = await send(bus, prefix, operator, Cordon())
    final = await results.final(cordon.id)
    assert final.status == "done" and final.schedulability == "cordoned"
    assert "hook on_cordon killed after 0.5s" in final.detail
    assert any("killed" in r.detail for r in results.of(cordon.id) if r.status == "in_progress")
    uncordon = await send(bus, prefix, operator, Uncordon())
    assert (await results.final(uncordon.id)).status == "done"
    assert seen.read_text().split() == ["uncordon", "n1", "c1", uncordon.id]


async def test_deregister_ends_agent_and_record(
    fleet: Fleet,
    bus: NatsBus,
    prefix: str,
    operator: signing.KeyPair,
    results: Results,
) -> None:
    """Deregister drains, marks the record deregistered with an alert, and ends the agent."""
    await fleet.start_aggregator()
    agent = await trusting_agent(fleet, operator)
    command = await send(bus, prefix, operator, Deregister(deadline=5))
    assert (await results.final(command.id)).status == "done"
    assert agent.supervisor is not None
    await wait_for(agent.supervisor.finished.is_set)
    await wait_record(bus, prefix, "n1", lambda r: r.state == "deregistered")
    await wait_for(lambda: [a for a in results.alerts if a.kind == "deregistered"])


async def test_shutdown_deregisters_when_configured(
    fleet: Fleet,
    bus: NatsBus,
    prefix: str,
    operator: signing.KeyPair,
) -> None:
    """With deregister_on_shutdown, stopping the agent leaves its record deregistered."""
    await fleet.start_aggregator()
    agent = await trusting_agent(fleet, operator, deregister_on_shutdown=True)
    await wait_record(bus, prefix, "n1", lambda r: r.state == "active")
    await agent.stop()
    await wait_record(bus, prefix, "n1", lambda r: r.state == "deregistered")


async def test_rebalance_notice_cordons_with_ttl(
    fleet: Fleet,
    bus: NatsBus,
    prefix: str,
    operator: signing.KeyPair,
    results: Results,
) -> None:
    """A rebalance recommendation cordons the node with a TTL, once per notice; the
    record says the spot notice did."""
    await fleet.start_aggregator()
    await trusting_agent(fleet, operator)
    notice = Interruption(ts=time.time(), provider="aws", kind="rebalance", event_id="r1")
    await fleet.publish_event(EVENT_INTERRUPTION, notice)
    await fleet.publish_event(EVENT_INTERRUPTION, notice)
    final = await results.final("spot:aws:rebalance:r1")
    assert final.schedulability == "cordoned" and "uncordons at" in final.detail
    # A time with its zone, as every time fleetctl prints: 2026-11-26T14:03:22Z.
    assert re.search(r"uncordons at \d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", final.detail)
    assert results.statuses("spot:aws:rebalance:r1").count("accepted") == 1
    record = await wait_record(bus, prefix, "n1", lambda r: r.state == "cordoned")
    assert record.heartbeat is not None and record.heartbeat.schedulability_by == "spot"


async def test_sigterm_deregisters_and_exits_zero(fleet: Fleet, bus: NatsBus, prefix: str) -> None:
    """SIGTERM to 'node-agent start --deregister-on-shutdown' deregisters the node and the
    process exits 0."""
    await fleet.start_aggregator()
    config = fleet.config()
    key = signing.load_or_create_key_file(config.key_path)
    await approve(bus, Subjects(prefix), "n1", key.public_key)
    process = await asyncio.create_subprocess_exec(
        str(Path(sys.executable).parent / "node-agent"),
        "start",
        *("--server", fleet.url, "--prefix", prefix, "--node-id", "n1"),
        *("--cluster", "c1", "--state-dir", config.state_dir, "--fake-gpus", "1"),
        *("--heartbeat-interval", "0.5", "--stale-after", "2", "--deregister-on-shutdown"),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        await wait_record(bus, prefix, "n1", lambda r: r.state == "active")
        process.send_signal(signal.SIGTERM)
        _, stderr = await asyncio.wait_for(process.communicate(), 20)
        assert process.returncode == 0, stderr.decode()
        await wait_record(bus, prefix, "n1", lambda r: r.state == "deregistered")
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_trust_operators_file(
    fleet: Fleet,
    bus: NatsBus,
    prefix: str,
    operator: signing.KeyPair,
    results: Results,
    tmp_path: Path,
) -> None:
    """Keys listed one per line in trust_operators_file (comments allowed) are trusted."""
    trust_file = tmp_path / "operators"
    trust_file.write_text(f"# fleet operators\n{operator.public_key}\n")
    await fleet.start_agent(fleet.config(trust_operators_file=str(trust_file)))
    cordon = await send(bus, prefix, operator, Cordon())
    assert (await results.final(cordon.id)).status == "done"


async def test_drain_resumes_after_restart(
    fleet: Fleet,
    bus: NatsBus,
    prefix: str,
    operator: signing.KeyPair,
    results: Results,
) -> None:
    """A drain interrupted by a restart resumes under the same command id and finishes."""
    agent = await trusting_agent(fleet, operator, shutdown_timeout=0.5)
    await set_in_flight(fleet, 4)
    drain = await send(bus, prefix, operator, Drain(deadline=60))
    await wait_for(lambda: any(r.in_flight == 4 for r in results.of(drain.id)))
    await agent.stop()
    assert "done" not in results.statuses(drain.id)
    await trusting_agent(fleet, operator)
    final = await results.final(drain.id)
    assert final.status == "done" and final.schedulability == "drained"


async def test_failed_command_fetch_ends_run(fleet: Fleet) -> None:
    """A command fetch that fails for good (connection closed) ends run() with the error,
    so the supervisor restarts the actor instead of it silently taking no commands."""
    own = await fleet.connect("commands-test")
    config = fleet.config()
    executor = CommandsActor(config, own, node_events(config))
    running = asyncio.Event()
    task = asyncio.create_task(executor.run(running.set))
    try:
        await asyncio.wait_for(running.wait(), 10)
        await own.nc.close()
        with pytest.raises(nats.errors.ConnectionClosedError):
            await asyncio.wait_for(task, 20)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_restarted_cordoned_node_never_beats_schedulable(
    fleet: Fleet, bus: NatsBus, prefix: str, operator: signing.KeyPair, results: Results
) -> None:
    """A cordoned agent restarted from its state dir says ``cordoned`` in its very first
    heartbeat: the fleet view never shows it schedulable in between."""
    agent = await trusting_agent(fleet, operator)
    cordon = await send(bus, prefix, operator, Cordon(), reason="maintenance")
    assert (await results.final(cordon.id)).status == "done"
    await agent.stop()
    beats: list[Heartbeat] = []

    async def collect(msg: Msg) -> None:
        beats.append(codec.decode(msg.data, Heartbeat))

    subscription = await bus.nc.subscribe(Subjects(prefix).heartbeat("c1", "n1"), cb=collect)
    await bus.flush()
    try:
        await trusting_agent(fleet, operator)
        await wait_for(lambda: len(beats) >= 2)
    finally:
        await subscription.unsubscribe()
    assert [beat.schedulability for beat in beats[:2]] == ["cordoned", "cordoned"]
