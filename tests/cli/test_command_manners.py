"""How ``fleetctl cordon | drain | uncordon | deregister`` and ``fleetctl command`` behave
for an operator: labelled output, re-attaching, warnings before sending, usage errors
before publishing, exit statuses and Ctrl-C. Real processes against a real nats-server."""

from __future__ import annotations

import asyncio
import re
import signal
import sys
import time
from asyncio.subprocess import DEVNULL, PIPE
from pathlib import Path

import pytest

from actors.node.agent import NodeAgent
from actors.node.commands.actor import CommandsActor
from actors.runtime import spans
from actors.runtime.bus import NatsBus
from schemas import codec, signing
from schemas.messages import NodeRecord
from schemas.subjects import BUCKET_NODES, STREAM_COMMANDS, Subjects
from tests.support.commanding import Results, set_in_flight
from tests.support.fleet import Fleet, wait_for, wait_record

FLEETCTL = str(Path(sys.executable).parent / "fleetctl")


async def start(fleet: Fleet, key: Path, *args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        FLEETCTL,
        *args,
        *("--server", fleet.url, "--prefix", fleet.prefix),
        *(("--key-file", str(key)) if args[0] != "command" else ()),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )


async def run(fleet: Fleet, key: Path, *args: str) -> tuple[int, str, str]:
    process = await start(fleet, key, *args)
    out, err = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def queued(bus: NatsBus, prefix: str) -> int:
    """Commands waiting in this test's FLEET_CMD."""
    info = await bus.js.stream_info(Subjects(prefix).stream_name(STREAM_COMMANDS))
    return info.state.messages


def sent_id(out: str, action: str, node: str = "n1") -> str:
    first = out.splitlines()[0]
    assert first.startswith(f"{action} sent: id=") and first.endswith(f" node={node}"), out
    return first.split("id=")[1].split()[0]


@pytest.mark.slow
async def test_without_wait_a_labelled_line_then_command_reattaches(
    fleet: Fleet, operator_file: Path, node: NodeAgent
) -> None:
    """cordon prints `cordon sent: id=… node=…` and how to follow it; `fleetctl command ID
    --node n1` replays the stored results to the final one, exit 0, and so does `fleetctl
    command ID` alone, finding the node from the result subject."""
    code, out, err = await run(fleet, operator_file, "cordon", "n1", "--reason", "fw")
    assert code == 0, err
    command_id = sent_id(out, "cordon")
    assert f"fleetctl command {command_id} --node n1 --prefix {fleet.prefix}" in err
    await wait_record(fleet.bus, fleet.prefix, "n1", lambda r: r.state == "cordoned")

    code, out, err = await run(fleet, operator_file, "command", command_id, "--node", "n1")
    assert code == 0, err
    assert out.splitlines()[0].startswith("accepted")
    assert out.splitlines()[-1].startswith("done: cordoned")
    code, out, err = await run(fleet, operator_file, "command", command_id, "--timeout", "10")
    assert code == 0, err
    assert out.splitlines()[-1].startswith("done: cordoned")

    code, _, err = await run(fleet, operator_file, "command", "0" * 32, "--timeout", "1")
    assert code == 2 and err.splitlines()[-1] == "error: no final result within 1s"


async def test_warns_before_sending_to_unknown_stale_or_other_cluster(
    fleet: Fleet, bus: NatsBus, prefix: str, operator_file: Path
) -> None:
    """A node with no record (given --cluster), one whose record is stale, and a --cluster
    other than the record's each get a warning on stderr before the command is queued."""
    nodes = await bus.kv(Subjects(prefix).bucket_name(BUCKET_NODES))
    last_seen = time.time() - 30
    record = NodeRecord(node_id="n5", cluster="c1", state="stale", last_seq=3, last_seen=last_seen)
    await nodes.put("n5", codec.encode(record))

    code, out, err = await run(fleet, operator_file, "cordon", "nx", "--cluster", "c1")
    assert code == 0 and sent_id(out, "cordon", "nx")
    assert err.startswith("warning: node nx is unknown (no record in fleet_nodes)")

    asked = time.time()
    code, out, err = await run(fleet, operator_file, "drain", "n5")
    answered = time.time()
    assert code == 0 and sent_id(out, "drain", "n5")
    # The age the warning states is the record's at some moment of the command's run.
    ages = {spans.age(s) for s in range(int(asked - last_seen), int(answered - last_seen) + 1)}
    stated = re.match(r"warning: node n5 is stale \(last seen (.+?)\)", err)
    assert stated and stated.group(1) in ages, (err, sorted(ages))

    code, _, err = await run(fleet, operator_file, "uncordon", "n5", "--cluster", "c9")
    assert code == 0
    assert err.startswith("warning: node n5 is in cluster c1, not c9")
    assert await queued(bus, prefix) == 3


@pytest.mark.parametrize(
    "args",
    [
        ("cordon", "n1", "--ttl", "-5"),
        ("cordon", "n1", "--ttl", "nan"),
        ("drain", "n1", "--deadline", "1e9"),
        ("drain", "n1", "--dead", "5"),
        ("cordon", "n.1"),
        ("uncordon", "n1", "--expires", "0"),
    ],
)
async def test_bad_arguments_are_usage_errors_before_publishing(
    fleet: Fleet, bus: NatsBus, prefix: str, operator_file: Path, args: tuple[str, ...]
) -> None:
    """Negative, non-finite or absurd durations, an abbreviated flag and a bad node id are
    argparse errors (exit 2, usage and one error line), and nothing reaches FLEET_CMD."""
    code, out, err = await run(fleet, operator_file, *args)
    assert code == 2 and out == ""
    assert err.splitlines()[-1].startswith(f"fleetctl {args[0]}: error: ") or (
        err.splitlines()[-1].startswith("fleetctl: error: unrecognized arguments")
    )
    assert "Traceback" not in err
    assert await queued(bus, prefix) == 0


async def test_drain_deadline_passed_with_work_in_flight_exits_3(
    fleet: Fleet, bus: NatsBus, prefix: str, operator_file: Path, node: NodeAgent
) -> None:
    """A drain whose deadline passes with requests still in flight is `done` on the node,
    but fleetctl exits 3, not 0; `fleetctl command` says the same later."""
    await set_in_flight(fleet, 2)
    # The node's commands actor has heard of the two before the drain reaches it.
    assert node.supervisor is not None
    [commands] = [a for a in node.supervisor.actors if isinstance(a, CommandsActor)]
    await wait_for(lambda: commands.actions.in_flight == 2)
    code, out, err = await run(
        fleet, operator_file, "drain", "n1", "--deadline", "1", "--wait", "--timeout", "20"
    )
    assert code == 3, (out, err)
    assert out.splitlines()[-1].startswith("done: deadline passed with 2 in flight")
    command_id = sent_id(out, "drain")
    code, out, _ = await run(fleet, operator_file, "command", command_id, "--node", "n1")
    assert code == 3 and out.splitlines()[-1].startswith("done: deadline passed")


async def test_ctrl_c_during_wait_says_the_command_continues(
    fleet: Fleet, operator_file: Path, node: NodeAgent
) -> None:
    """SIGINT while --wait follows a command whose node is down: exit 130 and a line saying
    the command continues and the exact command line that follows it again."""
    await node.stop()
    process = await start(fleet, operator_file, "drain", "n1", "--wait")
    assert process.stdout is not None and process.stderr is not None
    first = (await asyncio.wait_for(process.stdout.readline(), 15)).decode()
    command_id = sent_id(first, "drain")
    process.send_signal(signal.SIGINT)
    await asyncio.wait_for(process.wait(), 10)
    err = (await process.stderr.read()).decode()
    assert process.returncode == 130
    assert err.splitlines()[-1] == (
        f"interrupted: stopped following drain {command_id}, which continues on n1; "
        f"follow it again with: fleetctl command {command_id} --node n1 --prefix {fleet.prefix}"
    )


async def test_a_rejected_command_is_shown_with_its_signer_and_exits_1_at_once(
    fleet: Fleet,
    operator_file: Path,
    node: NodeAgent,
    tmp_path: Path,
) -> None:
    """A cordon signed by a key n1 does not trust is rejected by the node under no id;
    `fleetctl command ID` finds that rejection by the id the message claimed, shows the
    reason and the signer, and exits 1 at once: within a quarter of its --timeout (60 s),
    which it would wait out for a final result (measured in the process, without the
    interpreter's start-up; 0.3 s on an idle machine)."""
    results = await Results().start(fleet.bus, fleet.prefix)
    stranger_file = tmp_path / "stranger.nk"
    stranger = signing.create_key_file(stranger_file)
    code, out, err = await run(fleet, stranger_file, "cordon", "n1")
    assert code == 0, err
    command_id = sent_id(out, "cordon")
    await wait_for(lambda: [r for r in results.results if r.claimed_id == command_id])
    argv = ["command", command_id, "--node", "n1", "--timeout", "60"]
    argv += ["--server", fleet.url, "--prefix", fleet.prefix]
    timed = (
        "import sys, time\n"
        "from actors.cli.fleetctl.main import main\n"
        "started = time.monotonic()\n"
        "code = main(sys.argv[1:])\n"
        "sys.stderr.write(f'took {time.monotonic() - started:.3f}\\n')\n"
        "sys.exit(code)\n"
    )
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", timed, *argv, stdout=PIPE, stderr=PIPE, stdin=DEVNULL
    )
    raw_out, raw_err = await asyncio.wait_for(process.communicate(), 60)
    out, err = raw_out.decode(), raw_err.decode()
    assert process.returncode == 1, (out, err)
    took = float(err.splitlines()[-1].removeprefix("took "))
    assert took < 15.0, f"fleetctl command took {took:.2f}s (after start-up) to exit: {out}"
    last = out.splitlines()[-1]
    assert last.startswith(f"rejected: signed by an untrusted key {stranger.public_key}"), out
    assert f"signed by {signing.fingerprint(stranger.public_key)}" in last
    assert f"a message claiming id {command_id}" in last


async def test_signing_with_a_nodes_own_key_needs_its_own_flag(
    fleet: Fleet, operator_file: Path, node: NodeAgent
) -> None:
    """cordon signed with n1's own key (its approved key in fleet_trust) is refused before
    anything is sent, in one line saying whose key it is and what to do; with
    --sign-with-node-key (once --yes: the name docs/security.md cites) it is sent after a
    warning (and n1, not trusting its own key, rejects it)."""
    node_key = fleet.config("n1").key_path
    code, out, err = await run(fleet, node_key, "cordon", "n1")
    assert code == 1 and out == "", (out, err)
    assert err.startswith("error: the signing key SHA256:") and "node n1's own key" in err
    assert "--sign-with-node-key" in err and err.count("\n") == 1
    assert await queued(fleet.bus, fleet.prefix) == 0
    code, out, err = await run(fleet, node_key, "cordon", "n1", "--sign-with-node-key", "--wait")
    assert code == 1, (out, err)
    assert err.startswith("warning: the signing key SHA256:")
    assert out.splitlines()[-1].startswith("rejected: signed by an untrusted key")


async def test_a_node_key_on_the_operator_trust_list_is_signed_with_silently(
    fleet: Fleet, tmp_path: Path, node: NodeAgent
) -> None:
    """n1's own key listed in fleetctl's trust_operators_file (read as the agents read
    theirs: comments skipped) is signed with, no warning and no flag (n1, not trusting it,
    rejects the cordon); another key on the list changes nothing; forget --yes only
    skips the question: signing with a node's key still needs --sign-with-node-key."""
    node_key = fleet.config("n1").key_path
    public = signing.load_key_file(node_key).public_key
    listed = tmp_path / "operators"
    listed.write_text(f"# the fleet's operators\n{public}\n")
    listed.chmod(0o600)
    trusting = ("--trust-operators-file", str(listed))
    code, out, err = await run(fleet, node_key, "cordon", "n1", *trusting, "--wait")
    assert code == 1 and err == "", (out, err)
    assert out.splitlines()[-1].startswith("rejected: signed by an untrusted key"), out
    other = signing.KeyPair.generate().public_key
    code, out, err = await run(fleet, node_key, "cordon", "n1", "--trust-operator", other)
    assert code == 1 and "node n1's own key" in err and "--trust-operator" in err, err
    code, out, err = await run(fleet, node_key, "forget", "n1", "--yes")
    assert code == 1 and "node n1's own key" in err, (out, err)
    assert (await wait_record(fleet.bus, fleet.prefix, "n1", lambda r: True)).deregistered is False
