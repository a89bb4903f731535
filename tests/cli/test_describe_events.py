"""``fleetctl describe``, ``events`` and ``watch --since`` as an operator runs them: real
processes against a real fleet (aggregator and agent) whose node was cordoned by a signed
command and then went stale, so its streams hold a command result and a stale alert."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from actors.cli.render import describe
from actors.fleet.aggregator.record_rules import pending_record
from actors.fleet.record_state import with_state
from actors.fleet.views.history import Entry
from schemas import signing
from schemas.base import Schedulability
from schemas.messages import CommandResult, CommandStatus, Cordon
from schemas.subjects import STREAM_ALERTS, STREAM_EVENTS, Subjects
from tests.support.commanding import Results, send
from tests.support.fleet import Fleet, heartbeat, wait_for, wait_record

FLEETCTL = str(Path(sys.executable).parent / "fleetctl")


@dataclass
class History:
    """The fleet after the story: n1 cordoned by ``command_id``, then stale."""

    fleet: Fleet
    command_id: str


@pytest.fixture
async def stale_cordoned(fleet: Fleet, tmp_path: Path) -> History:
    operator = signing.create_key_file(tmp_path / "operator.nk")
    await fleet.start_aggregator()
    agent = await fleet.start_agent(fleet.config(trust_operators=[operator.public_key]))
    await wait_record(
        fleet.bus,
        fleet.prefix,
        "n1",
        lambda r: (
            r.state == "active" and r.heartbeat is not None and r.heartbeat.health is not None
        ),
    )
    results = await Results().start(fleet.bus, fleet.prefix)
    command = await send(fleet.bus, fleet.prefix, operator, Cordon(), reason="disk swap")
    assert (await results.final(command.id)).status == "done"
    await wait_record(fleet.bus, fleet.prefix, "n1", lambda r: r.state == "cordoned")
    await agent.stop(goodbye=False)  # a crash: stale
    await wait_for(lambda: any(a.kind == "stale" for a in results.alerts))
    return History(fleet, command.id)


async def fleetctl(fleet: Fleet, *args: str) -> tuple[int, list[str], str]:
    process = await asyncio.create_subprocess_exec(
        FLEETCTL,
        *args,
        "--server",
        fleet.url,
        "--prefix",
        fleet.prefix,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode is not None
    return process.returncode, out.decode().splitlines(), err.decode()


async def consumers(fleet: Fleet) -> int:
    """Consumers left on the streams the commands read."""
    subjects = Subjects(fleet.prefix)
    total = 0
    for stream in (STREAM_ALERTS, STREAM_EVENTS):
        info = await fleet.bus.js.stream_info(subjects.stream_name(stream))
        total += info.state.consumer_count
    return total


async def test_describe_explains_state_and_history(stale_cordoned: History) -> None:
    """describe shows the state, schedulability with its reason, who and the command that
    set it, health checks, a GPU table, and the recent alert and result; no consumer is left."""
    fleet, command_id = stale_cordoned.fleet, stale_cordoned.command_id
    code, lines, err = await fleetctl(fleet, "describe", "n1")
    assert code == 0, err
    assert "Node:            n1" in lines
    [state] = [line for line in lines if line.startswith("State:")]
    assert state.startswith("State:           stale (no heartbeat since 20")
    [sched] = [line for line in lines if line.startswith("Schedulability:")]
    # Stale: what the node reported is not known to hold now, and is said as the last:
    # who cordoned (the operator's key) and the command that did.
    assert sched.startswith(
        "Schedulability:  - (unknown while stale; last reported cordoned (reason: disk swap), by U"
    )
    assert ", set by command " in sched and command_id in sched
    assert lines[lines.index("Checks:") + 1].split() == ["CHECK", "STATUS", "REASON", "ACTION"]
    gpus = lines.index("GPUs:            2 (fake)")
    assert lines[gpus + 1].split()[:3] == ["GPU", "NAME", "MEMORY"]
    assert lines[gpus + 2].split()[0] == "0" and lines[gpus + 3].split()[0] == "1"
    assert any(line.startswith("Host uptime:     ") for line in lines)
    assert any(line.startswith("Agent uptime:    ") for line in lines)
    assert "Engines:         none" in lines
    assert "Spot:            not watched" in lines
    alerts = lines.index("Recent alerts (1):")
    assert lines[alerts + 1].split()[1:4] == ["warning", "n1", "stale:"]
    assert any(f"result: command {command_id} done" in line for line in lines[alerts:])
    assert await consumers(fleet) == 0


async def test_describe_unknown_node_is_one_error_line(fleet: Fleet) -> None:
    await fleet.start_aggregator()
    code, lines, err = await fleetctl(fleet, "describe", "nx")
    assert (code, lines, err) == (1, [], "error: node nx not found\n")


async def test_describe_a_range_describes_each_node_or_names_the_unknown(fleet: Fleet) -> None:
    """describe n[1-2] prints both nodes, in order, a blank line between; a range with a
    node the fleet does not know is one error line and nothing on stdout."""
    await fleet.start_aggregator()
    for node in ("n1", "n2"):
        await fleet.start_agent(fleet.config(node))
        await wait_record(fleet.bus, fleet.prefix, node, lambda r: r.state == "active")
    code, lines, err = await fleetctl(fleet, "describe", "n[1-2]")
    assert code == 0, err
    assert [line for line in lines if line.startswith("Node:")] == [
        "Node:            n1",
        "Node:            n2",
    ]
    assert lines[lines.index("Node:            n2") - 1] == ""
    code, lines, err = await fleetctl(fleet, "describe", "n1,n3")
    assert (code, lines, err) == (1, [], "error: no such node: n3\n")


async def test_events_oldest_first_in_text_and_json(stale_cordoned: History) -> None:
    """events lists command results then the stale alert, oldest first, one line each
    (time, severity, node, kind, message); --json gives the same as JSON objects."""
    fleet, command_id = stale_cordoned.fleet, stale_cordoned.command_id
    code, lines, err = await fleetctl(fleet, "events", "n1", "--since", "1h")
    assert code == 0, err
    kinds = [line.split()[3] for line in lines]
    assert kinds[-1] == "stale:" and set(kinds[:-1]) == {"result:"}
    assert lines[0].split()[1:3] == ["info", "n1"]
    assert lines[-2].endswith(f"command {command_id} done: cordoned")
    code, json_lines, err = await fleetctl(fleet, "events", "n1", "--json")
    assert code == 0, err
    records = [json.loads(line) for line in json_lines]
    assert len(records) == len(lines)
    assert records[-1]["message"]["kind"] == "stale"
    assert records[0]["message"]["command_id"] == command_id
    assert await consumers(fleet) == 0


async def test_events_fleet_wide_filters_by_kind_severity_cluster_labels(
    stale_cordoned: History,
) -> None:
    """events without a node reads the fleet's alerts and results; --kind, --severity,
    --cluster and -l narrow them; a node list with an unknown name is one error line."""
    fleet = stale_cordoned.fleet
    code, everything, err = await fleetctl(fleet, "events")
    assert code == 0, err
    kinds = {line.split()[3] for line in everything}
    assert {"stale:", "result:"} <= kinds
    code, stale, err = await fleetctl(fleet, "events", "--kind", "stale")
    assert code == 0 and stale, err
    assert all(line.split()[1:4] == ["warning", "n1", "stale:"] for line in stale)
    code, info, err = await fleetctl(fleet, "events", "--severity", "info", "--kind", "result")
    assert code == 0 and info, err
    assert all(line.split()[1] == "info" and line.split()[3] == "result:" for line in info)
    code, both, err = await fleetctl(fleet, "events", "--kind", "stale", "--kind", "result")
    assert code == 0 and len(both) == len(stale) + len(info), err
    code, listed, err = await fleetctl(fleet, "events", "n[1-1]", "--cluster", "c1")
    # Every line of n1's; not every line: a loaded machine adds the fleet's bus_outage.
    assert (code, listed) == (0, [line for line in everything if line.split()[2] == "n1"]), err
    for narrowing in (["--cluster", "c2"], ["-l", "rack=r9"], ["--kind", "offline"]):
        code, lines, err = await fleetctl(fleet, "events", *narrowing)
        assert (code, lines) == (0, []), (narrowing, err)
    code, lines, err = await fleetctl(fleet, "events", "n[1-2]")
    assert (code, lines, err) == (1, [], "error: no such node: n2\n")
    assert await consumers(fleet) == 0


@pytest.mark.parametrize("since", ["-5m", "soon", "0s"])
async def test_events_refuses_a_bad_duration(fleet: Fleet, since: str) -> None:
    code, _, err = await fleetctl(fleet, "events", "n1", f"--since={since}")
    assert code == 2 and "duration" in err


async def test_watch_since_replays_then_follows(stale_cordoned: History) -> None:
    """watch --alerts --since 10m prints the stored stale alert first, then a new alert,
    and exits 0 on Ctrl-C leaving no consumer behind."""
    fleet = stale_cordoned.fleet
    process = await asyncio.create_subprocess_exec(
        FLEETCTL,
        *("watch", "--alerts", "--since", "10m", "--server", fleet.url, "--prefix", fleet.prefix),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )

    def kill_if_running() -> None:
        if process.returncode is None:
            process.kill()

    fleet.stack.callback(kill_if_running)
    stdout = process.stdout
    assert stdout is not None
    replayed = (await asyncio.wait_for(stdout.readline(), 15)).decode()
    assert replayed.split()[1:4] == ["warning", "n1", "stale:"]
    await fleet.start_agent(fleet.config())

    async def followed() -> list[str]:
        while True:
            line = (await stdout.readline()).decode()
            if "recovered:" in line:
                return line.split()

    assert (await asyncio.wait_for(followed(), 15))[1:4] == ["info", "n1", "recovered:"]
    process.send_signal(signal.SIGINT)
    assert await asyncio.wait_for(process.wait(), 10) == 0
    assert await consumers(fleet) == 0


def result(
    second: int, command_id: str, status: CommandStatus, schedulability: Schedulability
) -> Entry:
    """A result of node n1 stored ``second`` seconds into the test's history."""
    message = CommandResult(
        command_id=command_id,
        node_id="n1",
        cluster="c1",
        status=status,
        ts=1_700_000_000.0 + second,
        schedulability=schedulability,
    )
    return Entry(ts=message.ts, subject="x.result.c1.n1", message=message, body=b"")


def schedulability_line(results: list[Entry]) -> str:
    """describe's Schedulability line for a node that reports itself cordoned."""
    beat = heartbeat(schedulability="cordoned", schedulability_reason="aws rebalance notice")
    record = with_state(
        pending_record("n1", "c1"), last_seq=1, last_seen=1.0, schedulability="cordoned",
        heartbeat=beat,
    )  # fmt: skip
    text = describe.describe(record, [], results, 1_700_000_100.0)
    [line] = [line for line in text.splitlines() if line.startswith("Schedulability:")]
    return line


@pytest.mark.parametrize(
    ("history", "credit"),
    [
        ([], ""),
        ([("c1", "done", "cordoned"), ("u1", "done", "schedulable")], ""),
        ([("c1", "done", "cordoned"), ("d1", "rejected", "cordoned")], ", set by command c1"),
        ([("c1", "done", "cordoned"), ("s1", "done", "cordoned")], ", set by command c1"),
        ([("u1", "done", "schedulable"), ("d1", "rejected", "cordoned")], ""),
        ([("u1", "done", "schedulable"), ("c2", "accepted", "cordoned")], ""),
        (
            [("c1", "done", "cordoned"), ("u1", "done", "schedulable"),
             ("spot:x", "done", "cordoned")],
            ", set by the node itself (spot:x)",
        ),
    ],
    ids=["none", "self-cordoned-after-uncordon", "refusal-after", "stop-after", "refusal-only",
         "accepted-only", "spot"],
)  # fmt: skip
def test_describe_credits_a_cordon_only_to_what_set_it(
    history: list[tuple[str, CommandStatus, Schedulability]], credit: str
) -> None:
    """A cordon is credited to the command whose completed result set it, to the node for
    what it did by itself, and to nobody when the last completed result reports another
    state or none completed: a refused or merely accepted command found the state."""
    line = schedulability_line([result(i, *entry) for i, entry in enumerate(history)])
    base = "Schedulability:  cordoned (reason: aws rebalance notice)"
    if credit:
        assert line.startswith(f"{base}{credit} at ")
    else:
        assert line == base


def test_describe_credits_no_workload_command_on_a_node_schedulable_all_along() -> None:
    """A workload's stop on a node that was never cordoned reports `schedulable` in its
    result; describe credits it with nothing, since it set nothing."""
    record = with_state(
        pending_record("n1", "c1"), last_seq=1, last_seen=1.0, schedulability="schedulable",
        heartbeat=heartbeat(),
    )  # fmt: skip
    results = [result(0, "chat-0-start-1", "done", "schedulable"),
               result(1, "chat-0-stop-1", "done", "schedulable")]  # fmt: skip
    text = describe.describe(record, [], results, 1_700_000_100.0)
    [line] = [line for line in text.splitlines() if line.startswith("Schedulability:")]
    assert line == "Schedulability:  schedulable"
