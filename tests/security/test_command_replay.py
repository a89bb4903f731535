"""Issue 8, items 13-15, from the attacker's side: captured signed commands replayed,
commands with absurd times, spoofed refusals, duplicate publishes, and a command that must
survive a failed save. The attacker is a plain nats-py client that publishes exact bytes."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.aio.client import Client

from actors.cli.fleetctl.send import ResultFollower
from actors.fleet.operator.commands import new_command, publish_command
from actors.node.agent import NodeAgent
from actors.node.commands import store
from actors.runtime.atomic_file import write_atomically
from actors.runtime.bus import NatsBus
from actors.runtime.embedded import NatsServer
from schemas import codec, signing
from schemas.errors import FleetError
from schemas.messages import Command, CommandResult, Cordon, Uncordon, command_digest
from schemas.subjects import Subjects
from tests.support.commanding import Results, send
from tests.support.fleet import Fleet, wait_for

FLEETCTL = str(Path(sys.executable).parent / "fleetctl")


@pytest.fixture
def operator() -> signing.KeyPair:
    return signing.KeyPair.generate()


@pytest.fixture
async def results(bus: NatsBus, prefix: str) -> Results:
    return await Results().start(bus, prefix)


@pytest.fixture
async def attacker(nats_server: NatsServer) -> AsyncIterator[Client]:
    nc = await nats.connect(nats_server.url, name="attacker")
    yield nc
    await nc.close()


async def replay(attacker: Client, prefix: str, body: bytes, headers: dict[str, str]) -> None:
    """Publish exactly these bytes and headers on n1's command subject, no Nats-Msg-Id."""
    await attacker.jetstream().publish(f"{prefix}.cmd.c1.n1", body, headers=headers, timeout=5)


async def refusal(results: Results, body: bytes) -> CommandResult:
    """The node's refusal of ``body`` (a replayed body also has its earlier results)."""

    def check() -> CommandResult | None:
        refused = [r for r in results.of(command_digest(body)) if r.status == "rejected"]
        return refused[-1] if refused else None

    found: CommandResult = await wait_for(check)
    return found


async def trusting_agent(fleet: Fleet, operator: signing.KeyPair) -> NodeAgent:
    agent = await fleet.start_agent(fleet.config(trust_operators=[operator.public_key]))
    assert agent.supervisor is not None and await agent.supervisor.wait_ready(10)
    return agent


def signed(operator: signing.KeyPair, **changes: Any) -> tuple[bytes, dict[str, str]]:
    """A cordon for n1 signed by ``operator``, with ``changes`` to its fields."""
    now = time.time()
    fields: dict[str, Any] = dict(
        id=f"c{time.monotonic_ns()}",
        node_id="n1",
        cluster="c1",
        action=Cordon(),
        issued_at=now,
        expires_at=now + 600,
    )
    fields.update(changes)
    body = codec.encode(Command(**fields))
    return body, operator.headers(body)


async def cordon_and_uncordon(
    bus: NatsBus, prefix: str, operator: signing.KeyPair, results: Results
) -> tuple[bytes, dict[str, str]]:
    """Run a cordon, then an uncordon; return the cordon as a wiretapper captured it."""
    cordon = await send(bus, prefix, operator, Cordon())
    assert (await results.final(cordon.id)).status == "done"
    uncordon = await send(bus, prefix, operator, Uncordon())
    assert (await results.final(uncordon.id)).schedulability == "schedulable"
    body = codec.encode(cordon)
    return body, operator.headers(body)


async def test_replay_after_many_newer_commands_is_refused(
    fleet: Fleet,
    bus: NatsBus,
    prefix: str,
    operator: signing.KeyPair,
    results: Results,
    attacker: Client,
) -> None:
    """A captured, unexpired cordon replayed after 5,000 newer commands is still a
    duplicate: ids are kept until their command expires, not up to a count. The newer ids
    are written into the state file, as an agent that ran them would have (fast)."""
    agent = await trusting_agent(fleet, operator)
    body, headers = await cordon_and_uncordon(bus, prefix, operator, results)
    await agent.stop()
    state_file = fleet.state_dir / "n1" / "commands.json"
    saved = json.loads(state_file.read_bytes())
    saved["seen"] = [*saved.get("seen", []), *(f"newer{i}" for i in range(5000))]
    state_file.write_text(json.dumps(saved))
    await trusting_agent(fleet, operator)

    await replay(attacker, prefix, body, headers)
    final = await refusal(results, body)
    assert "duplicate" in final.detail
    assert final.schedulability == "schedulable"


def test_seen_ids_expire_with_their_command(tmp_path: Path) -> None:
    """The store forgets an id once its command has expired (the expiry check refuses it
    from then on), and keeps every unexpired one across a reload."""
    commands = store.CommandStore(tmp_path, legacy_for=60)
    commands.remember("old", time.time() + 0.05)
    commands.remember("young", time.time() + 60)
    time.sleep(0.1)
    commands.remember("new", time.time() + 60)
    reloaded = store.CommandStore(tmp_path, legacy_for=60)
    assert [reloaded.seen(i) for i in ("old", "young", "new")] == [False, True, True]


async def test_lifetime_beyond_the_cap_is_refused(
    fleet: Fleet, prefix: str, operator: signing.KeyPair, results: Results, attacker: Client
) -> None:
    """A command issued in 1970 that expires in the year 5138 is refused: its lifetime is
    beyond max_command_lifetime (so its id would have to be kept forever)."""
    await trusting_agent(fleet, operator)
    body, headers = signed(operator, issued_at=0.0, expires_at=99_999_999_999.0)
    await replay(attacker, prefix, body, headers)
    final = await results.final(command_digest(body))
    assert final.status == "rejected" and "max_command_lifetime" in final.detail
    assert final.schedulability == "schedulable"


async def test_issued_in_the_future_is_refused(
    fleet: Fleet, prefix: str, operator: signing.KeyPair, results: Results, attacker: Client
) -> None:
    """A command issued an hour ahead of the node's clock (beyond max_skew) is refused."""
    await trusting_agent(fleet, operator)
    later = time.time() + 3600
    body, headers = signed(operator, issued_at=later, expires_at=later + 60)
    await replay(attacker, prefix, body, headers)
    final = await results.final(command_digest(body))
    assert final.status == "rejected" and "future" in final.detail
    assert final.schedulability == "schedulable"


async def test_replay_after_state_loss_is_refused(
    fleet: Fleet,
    bus: NatsBus,
    prefix: str,
    operator: signing.KeyPair,
    results: Results,
    attacker: Client,
) -> None:
    """With commands.json lost, a captured cordon issued before the store was re-created
    is refused, and the result says why; a new command still runs."""
    agent = await trusting_agent(fleet, operator)
    body, headers = await cordon_and_uncordon(bus, prefix, operator, results)
    await agent.stop()
    (fleet.state_dir / "n1" / "commands.json").unlink()
    await trusting_agent(fleet, operator)

    await replay(attacker, prefix, body, headers)
    final = await refusal(results, body)
    assert final.schedulability == "schedulable"
    assert "issued before this node's command state was created" in final.detail
    fresh = await send(bus, prefix, operator, Uncordon())
    assert (await results.final(fresh.id)).status == "done"


async def test_absurd_ttl_is_refused_before_acting(
    fleet: Fleet,
    nats_server: NatsServer,
    prefix: str,
    results: Results,
    attacker: Client,
    tmp_path: Path,
) -> None:
    """``fleetctl cordon --ttl 100000d`` is a usage error (exit 2) before sending; the same cordon
    signed and sent anyway is refused by the node, which stays schedulable."""
    key_file = tmp_path / "operator.nk"
    operator = signing.create_key_file(key_file)
    await trusting_agent(fleet, operator)
    process = await asyncio.create_subprocess_exec(
        *(FLEETCTL, "cordon", "n1", "--ttl", "100000d", "--cluster", "c1"),
        *("--server", nats_server.url, "--prefix", prefix, "--key-file", str(key_file)),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode == 2 and out == b""
    assert "argument --ttl: 100000d: must be" in err.decode().splitlines()[-1]

    body, headers = signed(operator, action=Cordon(ttl=1e30))
    await replay(attacker, prefix, body, headers)
    final = await results.final(command_digest(body))
    assert final.status == "rejected" and "out of range" in final.detail
    assert final.schedulability == "schedulable"
    assert [r.status for r in results.results] == ["rejected"]


async def test_follower_takes_only_results_naming_the_digest_sent(
    bus: NatsBus, prefix: str
) -> None:
    """``--wait`` ignores a node-signed result for the right id that names another digest
    (a refusal of some other message claiming the id), one on another node's subject, and
    an unsigned one; it takes the one naming the digest of the body it sent."""
    subjects = Subjects(prefix)
    node_key = signing.KeyPair.generate()
    command = new_command("n1", "c1", Cordon())
    digest = command_digest(codec.encode(command))
    follower = ResultFollower(bus, subjects, command.id, ("c1", "n1"), digest)
    follower.keys["n1"] = node_key.public_key
    await bus.subscribe(subjects.results(), follower.on_result)
    await bus.flush()

    def result(digest: str, detail: str) -> bytes:
        return codec.encode(
            CommandResult(
                command_id=command.id,
                node_id="n1",
                cluster="c1",
                status="rejected" if detail != "genuine" else "done",
                ts=time.time(),
                detail=detail,
                command_digest=digest,
            )
        )

    spoofed = result(command_digest(b"forged"), "spoofed")
    elsewhere = result(digest, "elsewhere")
    unsigned = result(digest, "unsigned")
    genuine = result(digest, "genuine")
    await bus.publish(subjects.result("c1", "n1"), spoofed, node_key.headers(spoofed))
    await bus.publish(subjects.result("c1", "n2"), elsewhere, node_key.headers(elsewhere))
    await bus.publish(subjects.result("c1", "n1"), unsigned)
    await bus.publish(subjects.result("c1", "n1"), genuine, node_key.headers(genuine))
    final = await follower.until_final(5, show=False)
    assert final is not None and final.detail == "genuine"
    assert follower.results.empty()


async def test_refusal_of_an_unverified_message_names_no_id(
    fleet: Fleet, prefix: str, operator: signing.KeyPair, results: Results, attacker: Client
) -> None:
    """An unsigned body claiming a real-looking id, and bytes that are not JSON, are
    refused under their digest only: the node never signs a refusal under a claimed id."""
    await trusting_agent(fleet, operator)
    claimed, _ = signed(operator, id="victim-1")
    garbage = b"\xff not json"
    await replay(attacker, prefix, claimed, {})
    await replay(attacker, prefix, garbage, {})
    for body in (claimed, garbage):
        final = await results.final(command_digest(body))
        assert final.status == "rejected" and final.command_id == ""
    assert all(r.command_id != "victim-1" for r in results.results)


async def test_duplicate_publish_is_reported(bus: NatsBus, prefix: str) -> None:
    """Publishing a command id the stream already holds fails loudly instead of leaving
    ``--wait`` to wait for a result that will never come."""
    operator = signing.KeyPair.generate()
    command = new_command("n1", "c1", Cordon())
    await publish_command(bus, Subjects(prefix), operator, command)
    with pytest.raises(FleetError, match="already published"):
        await publish_command(bus, Subjects(prefix), operator, command)


async def test_failed_save_runs_the_command_on_redelivery(
    fleet: Fleet,
    bus: NatsBus,
    prefix: str,
    operator: signing.KeyPair,
    results: Results,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A disk error while accepting a cordon does not mark it seen: the message is
    redelivered and the cordon runs then, once, without a duplicate refusal."""
    await trusting_agent(fleet, operator)
    failures = [OSError(28, "No space left on device")]

    def flaky(path: Path, data: bytes) -> None:
        if failures:
            raise failures.pop()
        write_atomically(path, data)

    monkeypatch.setattr("actors.node.commands.store.write_atomically", flaky)
    cordon = await send(bus, prefix, operator, Cordon())
    final = await results.final(cordon.id)
    assert final.status == "done" and final.schedulability == "cordoned"
    assert not failures
    assert results.statuses(cordon.id) == ["accepted", "done"]


async def test_a_state_file_that_stays_unwritable_fails_the_command_with_a_result(
    fleet: Fleet,
    bus: NatsBus,
    prefix: str,
    operator: signing.KeyPair,
    results: Results,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A cordon whose acceptance cannot be saved at any of its deliveries is answered
    failed naming the disk error, and the node stays schedulable (it never ran)."""
    agent = await trusting_agent(fleet, operator)

    def broken(path: Path, data: bytes) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("actors.node.commands.store.write_atomically", broken)
    cordon = await send(bus, prefix, operator, Cordon())
    final = await results.final(cordon.id)
    assert final.status == "failed" and final.schedulability == "schedulable"
    assert "No space left on device" in final.detail and "not run" in final.detail
    assert results.statuses(cordon.id) == ["failed"]
    assert agent.supervisor is not None and agent.supervisor.status["commands"].restarts == 0
