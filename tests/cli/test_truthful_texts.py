"""What fleetctl says is exact: unknown is shown as unknown, counts, units, zones and
names are right, and a mistake on the command line is answered by the command used."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import msgspec
import pytest

from actors.cli.render import describe, tables
from actors.fleet import record_state
from actors.fleet.aggregator import record_rules, sweeps
from actors.fleet.views.history import Entry
from actors.runtime import spans
from actors.runtime.spans import clock
from schemas import codec
from schemas.events import Health, Latency
from schemas.messages import CommandResult, NodeRecord
from tests.cli.test_command_manners import FLEETCTL
from tests.cli.test_fleetctl_listing import fleetctl as listing
from tests.support.fleet import Fleet, heartbeat, wait_record

NOW = 1_800_000_000.0


def record(state_fact: dict[str, Any] | None = None, **beat: Any) -> NodeRecord:
    """An active, healthy, cordoned-by-command node; then ``state_fact`` applied."""
    health = Health(status="healthy", score=95, ts=NOW)
    sent = heartbeat(ts=NOW - 5, health=health, **beat)
    accepted = record_rules.accept(record_rules.pending_record("n1", "c1"), sent, "U", NOW - 5)
    return record_state.with_state(accepted, **(state_fact or {}))


UNKNOWN: dict[str, dict[str, Any]] = {
    "stale": {"stale_since": NOW - 1},
    "offline": {"stale_since": NOW - 400, "offline_since": NOW - 1},
    "stopped": {"stopped_since": NOW - 1},
    "deregistered": {"deregistered": True},
}


@pytest.mark.parametrize("state", sorted(UNKNOWN))
def test_a_node_not_beating_shows_schedulability_and_health_as_unknown(state: str) -> None:
    """Stale, offline, stopped and forgotten nodes: SCHED and HEALTH are `-`, not what
    the last heartbeat said; describe says unknown and what was last reported."""
    node = record(UNKNOWN[state], schedulability="cordoned", schedulability_reason="disk")
    assert node.state == state and node.health_status == "healthy"
    cells = tables.row(node, NOW)
    assert (cells[2], cells[3], cells[4]) == (state, "-", "-")
    text = describe.describe(node, [], [], NOW)
    assert f"Schedulability:  - (unknown while {state}; last reported cordoned" in text
    assert f"Health:          - (unknown while {state}; last reported healthy, score 95" in text


def test_a_beating_node_shows_what_it_reports() -> None:
    """An active node's SCHED and HEALTH are its heartbeat's."""
    cells = tables.row(record(), NOW)
    assert (cells[2], cells[3], cells[4]) == ("active", "schedulable", "healthy 95")


def test_pending_records_say_whether_they_wait_for_approval() -> None:
    """A registration awaiting approval says so; an approved (enrolled) node that has not
    beaten yet is not 'awaiting approval'."""
    waiting = record_rules.pending_record("n1", "c1", "U", since=NOW)
    enrolled = record_rules.pending_record("n1", "c1", "U", since=NOW, approved=True)
    assert tables.reason(waiting, NOW) == "registered, awaiting approval"
    assert tables.reason(enrolled, NOW) == "approved, no heartbeat yet"
    assert "awaiting approval" not in describe.describe(enrolled, [], [], NOW)
    assert enrolled.created == NOW and not sweeps.pending_expired(enrolled, NOW + 1e6, 1)


def test_counts_and_ages_read_right() -> None:
    """`1 node`, `3 of 299 nodes`; ages in the largest sensible unit (never `72.0h`)."""
    one = [record()]
    assert tables.summary(one) == "1 node: 1 active"
    assert tables.summary(one * 3, of=299) == "3 of 299 nodes: 3 active"
    assert tables.summary(one * 3, of=3) == "3 nodes: 3 active"
    assert [spans.age(s) for s in (45, 600, 7200, 3 * 86400)] == [
        "45s ago",
        "10m ago",
        "2h ago",
        "3d ago",
    ]
    assert spans.age(3 * 86400) == f"{spans.span(3 * 86400)} ago"


def test_wide_reason_shows_nothing_stale() -> None:
    """A schedulable node whose cordon TTL ran out: REASON `-`, not 'cordon TTL expired'."""
    node = record(schedulability="schedulable", schedulability_reason="cordon TTL expired")
    assert tables.reason(node, NOW) == "-"
    cordoned = record(schedulability="cordoned", schedulability_reason="disk swap")
    assert tables.reason(cordoned, NOW) == "disk swap"


def stored(result: CommandResult) -> Entry:
    return Entry(
        ts=result.ts, subject="fleet.result.c1.n1", message=result, body=codec.encode(result)
    )


def test_describe_names_the_command_that_set_schedulability() -> None:
    """The cordon that set it is named, not the later result (a workload stop) that
    found the node cordoned and reports the same schedulability."""
    node = record(schedulability="cordoned", schedulability_reason="disk")
    cordon = CommandResult(
        command_id="cmd-1",
        node_id="n1",
        cluster="c1",
        status="done",
        ts=NOW - 60,
        schedulability="cordoned",
    )
    stop = msgspec.structs.replace(cordon, command_id="wl-stop-9", ts=NOW - 10)
    text = describe.describe(node, [], [stored(cordon), stored(stop)], NOW)
    assert f"set by command cmd-1 at {clock(NOW - 60)}" in text
    assert "wl-stop-9" not in text.split("Recent command results")[0]


def test_describe_texts() -> None:
    """The NATS round trip is `nats` in ms; a stale node's 'no heartbeat since' is its
    last heartbeat's time; every time carries its zone."""
    latency = Latency(gateway_rtt_us=4230, avg_peer_rtt_us=6350, ts=NOW)
    node = record({"stale_since": NOW - 1, "last_seen": NOW - 7}, latency=latency)
    text = describe.describe(node, [], [], NOW)
    assert "Latency:         nats 4.23ms, peers avg 6.35ms, loss 0%" in text
    assert f"(no heartbeat since {clock(NOW - 7)}; stale since {clock(NOW - 1)})" in text
    for stamp in re.findall(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d[^\s;)]*", text):
        assert stamp.endswith("Z"), stamp


def fleetctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [FLEETCTL, *args], capture_output=True, text=True, timeout=30, cwd=Path.home()
    )


def test_command_line_mistakes_are_answered_by_the_command_used() -> None:
    """An unknown flag prints the subcommand's usage; `fleetctl` alone prints help (exit
    0); an http:// server is named as not a NATS URL."""
    bogus = fleetctl("nodes", "--bogus")
    assert bogus.returncode == 2
    assert bogus.stderr.startswith("usage: fleetctl nodes ")
    assert bogus.stderr.splitlines()[-1] == "fleetctl nodes: error: unrecognized arguments: --bogus"
    alone = fleetctl()
    assert alone.returncode == 0 and alone.stdout.startswith("usage: fleetctl ")
    assert "operate a nats-node-agent fleet" in alone.stdout
    http = fleetctl("nodes", "--server", "http://127.0.0.1:4222")
    assert http.returncode == 1
    assert "http:// is not a NATS URL; NATS URLs are nats://HOST:PORT or tls://HOST:PORT" in (
        http.stderr
    )


async def test_events_of_an_unknown_node_and_states_combined(fleet: Fleet) -> None:
    """`events` for a node the fleet does not know is an error (exit 1), for a known one
    without events quiet (exit 0); repeated `--state` flags list the nodes of any of them,
    with how many of the fleet that is."""
    await fleet.start_aggregator()
    for node in ("n1", "n2"):
        await fleet.start_agent(fleet.config(node))
    for node in ("n1", "n2"):
        await wait_record(fleet.bus, fleet.prefix, node, lambda r: r.state == "active")
    where = ("--server", fleet.url, "--prefix", fleet.prefix)
    code, out, err = await listing("events", "nx", *where)
    assert (code, out, err) == (1, "", "error: node nx not found\n")
    code, out, err = await listing("events", "n1", *where)
    assert (code, err) == (0, "")
    code, out, err = await listing("nodes", "--state", "active", "--state", "stale", *where)
    assert code == 0, err
    assert out.splitlines()[-1] == "2 nodes: 2 active"
    code, out, err = await listing("nodes", "--state", "stale", "--state", "offline", *where)
    assert (code, out.splitlines()[-1]) == (0, "0 of 2 nodes")
