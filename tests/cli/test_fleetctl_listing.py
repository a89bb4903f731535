"""fleetctl nodes: a consistent listing under heartbeat load, and its output options."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import pty
import signal
import subprocess
import sys
import time
import tracemalloc

import msgspec
import pytest
from nats.js.api import KeyValueConfig

from actors.cli.fleetctl.views import sorts_live, write_nodes
from actors.cli.render import tables
from actors.cli.simulate.publisher import SimOptions
from actors.cli.simulate.run import simulate
from actors.fleet.aggregator import record_rules
from actors.fleet.storage.records import read_records, read_records_shelved
from actors.runtime import spans
from actors.runtime.bus import NatsBus
from schemas import codec
from schemas.events import Health, HealthCheck
from schemas.messages import Heartbeat, NodeRecord
from schemas.subjects import BUCKET_NODES, Subjects
from tests.support.fleet import Fleet, wait_for

NODES = 30
LISTINGS = 40


async def fleetctl(*args: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "actors.cli.fleetctl", *args),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    stdout, stderr = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode is not None
    return process.returncode, stdout.decode(), stderr.decode()


async def test_listing_under_heartbeat_load_shows_every_node_once(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """30 signed simulated nodes beating 300 times a second through a real aggregator: 40
    listings taken while it runs each show every node exactly once (the key-then-get
    listing showed [] or a node twice), and so does `fleetctl nodes -o json`."""
    await fleet.start_aggregator()
    # Long enough to outlast the listings on a loaded machine; cancelled after them.
    options = SimOptions(nodes=NODES, rate=300.0, duration=60.0, gpus=2, prefix=prefix)
    load = asyncio.create_task(simulate(bus, options, io.StringIO()))
    wanted = [f"sim-{i:05d}" for i in range(NODES)]
    listings = []
    try:

        async def all_listed() -> bool:
            assert not load.done(), "the load ended before every node had a record"
            return [r.node_id for r in await read_records(bus, Subjects(prefix))] == wanted

        await wait_for(all_listed)
        for _ in range(LISTINGS):
            listings.append([r.node_id for r in await read_records(bus, Subjects(prefix))])
            await asyncio.sleep(0.05)  # listings spread over the load, not back to back
        code, out, err = await fleetctl(
            "nodes", "--server", fleet.url, "--prefix", prefix, "-o", "json"
        )
        assert not load.done(), "the load ended before the listings did"
    finally:
        load.cancel()
        await asyncio.gather(load, return_exceptions=True)
    assert listings == [wanted] * LISTINGS
    assert (code, err) == (0, "")
    assert [record["node_id"] for record in json.loads(out)] == wanted


def record(node: str, state: str = "active", check: HealthCheck | None = None) -> NodeRecord:
    now = time.time()
    health = Health(
        ts=now,
        status="degraded" if check else "healthy",
        score=100,
        checks=[check] if check else [],
    )
    beat = Heartbeat(
        node_id=node,
        cluster="c1",
        seq=7,
        boot_id="b",
        ts=now,
        agent_version="1.2.3",
        interval=5.0,
        stale_after=15.0,
        health=health,
    )
    return NodeRecord(
        node_id=node,
        cluster="c1",
        state=state,
        last_seq=7,
        last_seen=now,
        agent_version="1.2.3",
        health_status=health.status,
        health_score=100,
        gpus_total=8,
        heartbeat=beat,
        created=now - 300,
    )


async def put(bus: NatsBus, prefix: str, *records: NodeRecord) -> None:
    bucket = await bus.kv(Subjects(prefix).bucket_name(BUCKET_NODES))
    for one in records:
        await bucket.put(one.node_id, codec.encode(one))


async def test_records_read_page_by_page_keep_each_nodes_newest_readable_value(
    fleet: Fleet, bus: NatsBus, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """1,500 records (two pages of the scan, each decoded as it comes): a record
    rewritten after the first page's keys counts with its newest value, one deleted is
    left out, one whose newest value is unreadable is skipped and logged once, and one
    unreadable value followed by a readable one counts with the readable one."""
    bucket = await bus.kv(Subjects(prefix).bucket_name(BUCKET_NODES))
    names = [f"n{i:05d}" for i in range(1500)]
    for first in range(0, len(names), 250):
        await asyncio.gather(
            *(bucket.put(n, codec.encode(record(n))) for n in names[first : first + 250])
        )
    await bucket.put("n00000", codec.encode(record("n00000", "cordoned")))
    await bucket.delete("n00001")
    await bucket.put("n00002", b"{not a record")
    await bucket.put("n00003", b"[]")
    await bucket.put("n00003", codec.encode(record("n00003", "draining")))
    with caplog.at_level(logging.WARNING, logger="actors.fleet.storage.records"):
        found = await read_records(bus, Subjects(prefix))
    assert [r.node_id for r in found] == [n for n in names if n not in ("n00001", "n00002")]
    states = {r.node_id: r.state for r in found}
    assert (states["n00000"], states["n00003"], states["n01499"]) == (
        "cordoned",
        "draining",
        "active",
    )
    skipped = [r for r in caplog.records if r.getMessage() == "unreadable record skipped"]
    assert [vars(r)["node"] for r in skipped] == ["n00002"]


async def test_records_read_shelved_are_the_records_with_their_newest_heartbeat_aside(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """1,500 records read shelved (two pages): each is the record :func:`read_records`
    reads, with no heartbeat, and its heartbeat is on the shelf, taken once. A record
    rewritten after the first page with a newer heartbeat has that one on the shelf; one
    rewritten with none has none there (not the heartbeat of its earlier value); an
    unreadable one is left out as the whole read leaves it out."""
    bucket = await bus.kv(Subjects(prefix).bucket_name(BUCKET_NODES))
    names = [f"n{i:05d}" for i in range(1500)]
    for first in range(0, len(names), 250):
        await asyncio.gather(
            *(bucket.put(n, codec.encode(record(n))) for n in names[first : first + 250])
        )
    newer = record("n00000")
    assert newer.heartbeat is not None
    newer = msgspec.structs.replace(
        newer, heartbeat=msgspec.structs.replace(newer.heartbeat, seq=9)
    )
    await bucket.put("n00000", codec.encode(newer))
    await bucket.put(
        "n00001", codec.encode(msgspec.structs.replace(record("n00001"), heartbeat=None))
    )
    await bucket.put("n00002", b"{not a record")
    whole = await read_records(bus, Subjects(prefix))
    shelved = await read_records_shelved(bus, Subjects(prefix))
    assert shelved.records == [msgspec.structs.replace(r, heartbeat=None) for r in whole]
    assert len(whole) == 1499

    def seq_on_shelf(node: str) -> int | None:
        body = shelved.heartbeats.take(node)
        return None if body is None else codec.decode(body, Heartbeat).seq

    assert (seq_on_shelf("n00000"), seq_on_shelf("n00001"), seq_on_shelf("n01499")) == (9, None, 7)
    assert seq_on_shelf("n00000") is None  # taken once
    shelved.heartbeats.take("n00003", keep=True)
    assert seq_on_shelf("n00003") == 7  # kept, then taken


async def test_records_read_never_hold_the_buckets_bytes_beside_the_records(
    bus: NatsBus, prefix: str
) -> None:
    """4,000 records of about 2 KB (four pages of the scan): the read's peak of traced
    memory above what its records hold is well under the bucket's bytes, since each page
    is decoded and let go as the next comes (holding every value until the end, as
    before, peaked at the records plus all of their bytes)."""
    # A bucket of its own (a prefix no fleet uses), larger than a test fleet's.
    subjects = Subjects(f"{prefix}big")
    name = subjects.bucket_name(BUCKET_NODES)
    bucket = await bus.js.create_key_value(KeyValueConfig(bucket=name, direct=True))
    names = [f"n{i:05d}" for i in range(4000)]
    labels = {f"label-{i:02d}": "v" * 60 for i in range(24)}
    values = [codec.encode(msgspec.structs.replace(record(n), labels=labels)) for n in names]
    for first in range(0, len(names), 500):
        chunk = range(first, first + 500)
        await asyncio.gather(*(bucket.put(names[i], values[i]) for i in chunk))
    stored = sum(len(value) for value in values)
    del values
    tracemalloc.start()
    try:
        found = await read_records(bus, subjects)
        held, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(found) == len(names) and stored > 8_000_000
    assert peak - held < stored / 2


XID = HealthCheck(name="xid", status="degraded", reason="XID 48 on GPU 2", action="reset")


async def test_output_options(fleet: Fleet, bus: NatsBus, prefix: str) -> None:
    """-o wide adds SEQ and REASON (the failing check), VERSION shows by default, json and
    --json agree, yaml lists the records; no colour codes when stdout is not a terminal."""
    await put(bus, prefix, record("n1"), record("n2", "degraded", XID))
    server = ("--server", fleet.url, "--prefix", prefix)
    code, table, err = await fleetctl("nodes", *server)
    assert (code, err) == (0, "")
    header = table.splitlines()[0].split()
    assert header[-2:] == ["AGE", "VERSION"] and "REASON" not in header
    assert table.splitlines()[1].split()[-2:] == ["5m", "1.2.3"]
    assert "\x1b" not in table and "\n2 nodes: 1 active, 1 degraded\n" in table
    # Records put by hand have no heartbeat in FLEET_HB: their rows say they are not live.
    assert table.splitlines()[1].split()[-3] == "ago*"
    assert table.splitlines()[-1].startswith("* 2 node(s) show their last checkpoint")
    code, wide, _ = await fleetctl("nodes", *server, "-o", "wide")
    assert code == 0 and wide.splitlines()[0].split()[-2:] == ["SEQ", "REASON"]
    assert wide.splitlines()[1].endswith("1.2.3    7    -")
    assert wide.splitlines()[2].endswith("xid: XID 48 on GPU 2")
    _, as_json, _ = await fleetctl("nodes", *server, "-o", "json")
    _, flag_json, _ = await fleetctl("nodes", *server, "--json", "--state", "degraded")
    assert [r["node_id"] for r in json.loads(as_json)] == ["n1", "n2"]
    assert [r["node_id"] for r in json.loads(flag_json)] == ["n2"]
    _, as_yaml, _ = await fleetctl("nodes", *server, "-o", "yaml")
    assert as_yaml.startswith('- node_id: "n1"\n  cluster: "c1"\n')
    assert '        - name: "xid"\n          status: "degraded"\n' in as_yaml
    code, _, err = await fleetctl("nodes", *server, "-o", "tsv")
    assert code == 2 and "custom-columns=NAME:.path" in err


async def test_kubectl_listing_habits(fleet: Fleet, bus: NatsBus, prefix: str) -> None:
    """--sort-by a column or a JSON path, -L label columns, --show-labels and -o
    custom-columns, as kubectl's; a sort key or column spec naming nothing is one line."""
    await put(
        bus,
        prefix,
        msgspec.structs.replace(record("b1"), labels={"rack": "r2", "tier": "hi"}, gpus_total=4),
        msgspec.structs.replace(record("a1"), labels={"rack": "r1"}, gpus_total=8),
        msgspec.structs.replace(record("c1", "degraded", XID), gpus_total=2),
    )
    server = ("--server", fleet.url, "--prefix", prefix)

    async def first_column(*args: str) -> list[str]:
        code, out, err = await fleetctl("nodes", *server, *args)
        assert (code, err) == (0, ""), err
        return [line.split()[0] for line in out.splitlines()[1:] if line.split()][:3]

    assert await first_column("--sort-by", "gpus") == ["c1", "b1", "a1"]
    assert await first_column("--sort-by", ".labels.rack") == ["a1", "b1", "c1"]
    assert await first_column("--sort-by", "{.node_id}") == ["a1", "b1", "c1"]
    _, out, _ = await fleetctl("nodes", *server, "--sort-by", "node", "-L", "rack,tier")
    lines = out.splitlines()
    assert lines[0].split()[-2:] == ["RACK", "TIER"]
    assert lines[1].split()[-2:] == ["1.2.3", "r1"] and lines[2].split()[-2:] == ["r2", "hi"]
    _, out, _ = await fleetctl("nodes", *server, "--sort-by", "node", "--show-labels")
    assert out.splitlines()[0].split()[-1] == "LABELS"
    assert out.splitlines()[2].split()[-1] == "rack=r2,tier=hi"
    assert out.splitlines()[3].split()[-1] == "<none>"
    columns = "custom-columns=NAME:.node_id,RACK:.labels.rack,SCORE:.health_score"
    _, out, _ = await fleetctl("nodes", *server, "--sort-by", "node", "-o", columns)
    assert [line.split() for line in out.splitlines()] == [
        ["NAME", "RACK", "SCORE"],
        ["a1", "r1", "100"],
        ["b1", "r2", "100"],
        ["c1", "<none>", "100"],
    ]
    code, _, err = await fleetctl("nodes", *server, "--sort-by", "colour")
    assert code == 1 and err.startswith("error: --sort-by 'colour': use a column (node,")
    code, _, err = await fleetctl("nodes", *server, "-o", "custom-columns=NAME")
    assert (code, err) == (1, "error: -o custom-columns: 'NAME': use NAME:.path\n")


def test_colour_keeps_columns_aligned() -> None:
    """The STATE cell is coloured, padded outside the escape codes."""
    text = tables.table([record("n1"), record("n2", "degraded", XID)], colour=True)
    lines = text.splitlines()
    assert "\x1b[32mactive\x1b[0m" in lines[1] and "\x1b[33mdegraded\x1b[0m" in lines[2]
    plain = [
        line.replace("\x1b[32m", "").replace("\x1b[33m", "").replace("\x1b[0m", "")
        for line in lines
    ]
    assert plain == tables.table([record("n1"), record("n2", "degraded", XID)]).splitlines()


def test_age_is_written_as_kubectl_does() -> None:
    assert [spans.span(s) for s in (-1, 42, 119, 120, 7199, 7200, 172799, 172800)] == [
        "0s",
        "42s",
        "119s",
        "2m",
        "119m",
        "2h",
        "47h",
        "2d",
    ]


def test_times_a_node_sends_never_break_a_view() -> None:
    """Times are UTC ISO in every view; a node's time no calendar holds (its timestamps
    are bounded below only) is '-', not a traceback."""
    assert spans.clock(0.0) == "1970-01-01T00:00:00Z"
    assert spans.clock(1e300) == "-" and spans.clock(1e300, "%H:%M") == "-"


def test_a_record_is_created_once() -> None:
    """``created``: the registration's time, else the first accepted heartbeat's; kept."""
    registered = record_rules.pending_record("n1", "c1", since=10.0)
    beat = record("n1").heartbeat
    assert beat is not None
    assert record_rules.accept(registered, beat, "U", 20.0).created == 10.0
    first = record_rules.accept(record_rules.pending_record("n1", "c1"), beat, "U", 20.0)
    assert record_rules.accept(first, beat, "U", 30.0).created == 20.0


def test_yaml_quotes_and_escapes() -> None:
    """Odd keys are quoted, empty containers inline, control characters escaped."""
    text = tables.yaml([{"a": {"b c": [1, None]}, "d": [], "e": "x\x1by"}])
    assert text == '- a:\n    "b c":\n      - 1\n      - null\n  d: []\n  e: "x\\u001by"\n'


async def test_watch_prints_changed_rows_with_time_and_exits_0_on_ctrl_c(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """--watch prints the table under a TIME column, then only the rows that changed (a
    new node, a state change; nothing for an unchanged node) and (gone) for a node that
    left the listing; SIGINT ends it 0."""
    await put(bus, prefix, record("n1"))
    process = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "actors.cli.fleetctl", "nodes", "--watch"),
        *("--server", fleet.url, "--prefix", prefix),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert process.stdout is not None

    async def line() -> list[str]:
        assert process.stdout is not None
        return (await asyncio.wait_for(process.stdout.readline(), 20)).decode().split()

    try:
        header, first = await line(), await line()
        await put(bus, prefix, record("n2"))
        added = await line()
        await put(bus, prefix, record("n1", "degraded", XID))
        changed = await line()
        await put(bus, prefix, record("n2", "deregistered"))
        gone = await line()
        process.send_signal(signal.SIGINT)
        rest, err = await asyncio.wait_for(process.communicate(), 20)
    finally:
        if process.returncode is None:
            process.kill()
    assert header[:3] == ["TIME", "NODE", "CLUSTER"]
    assert first[0].endswith("Z") and first[1:4] == ["n1", "c1", "active"]
    assert added[1:4] == ["n2", "c1", "active"]
    assert changed[1:4] == ["n1", "c1", "degraded"]
    assert gone[1:] == ["n2", "(gone)"]
    assert (process.returncode, err, rest) == (0, b"", b"")


async def on_a_terminal(env: dict[str, str], *args: str) -> bytes:
    """`fleetctl nodes` output when its stdout is a terminal (a pseudo-terminal here)."""
    controller, terminal = pty.openpty()
    process = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "actors.cli.fleetctl", "nodes", *args),
        stdout=terminal,
        stderr=subprocess.DEVNULL,
        env={**os.environ, **env},
    )
    os.close(terminal)
    try:
        assert await asyncio.wait_for(process.wait(), 30) == 0
        return os.read(controller, 65536)
    finally:
        os.close(controller)


async def test_colour_on_a_terminal_unless_no_color(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """On a terminal the STATE cell is coloured; NO_COLOR=1 turns that off."""
    await put(bus, prefix, record("n1"))
    server = ("--server", fleet.url, "--prefix", prefix)
    assert b"\x1b[32mactive\x1b[0m" in await on_a_terminal({"NO_COLOR": ""}, *server)
    assert b"\x1b" not in await on_a_terminal({"NO_COLOR": "1"}, *server)


def test_a_json_listing_writes_bytes_after_the_text_before_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`nodes -o json` writes each record's encoding to stdout's byte stream: text
    written before it to a buffered stdout (`--watch`'s separator, a pipe's) comes
    first, and the array holds every record, in order, as its encoding."""
    raw = io.BytesIO()
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(raw, encoding="utf-8"))
    records = [
        NodeRecord(node_id=f"n{i}", cluster="c1", state="active", last_seq=i, last_seen=1.0)
        for i in range(3)
    ]
    sys.stdout.write("before\n")
    write_nodes(records, "json", colour=False, rows=True)
    first, listing = raw.getvalue().decode().split("\n", 1)
    assert first == "before"
    assert [r["node_id"] for r in json.loads(listing)] == ["n0", "n1", "n2"]
    assert listing == "[" + ",".join(codec.encode(r).decode() for r in records) + "]\n"


def test_a_sort_by_what_the_live_read_sets_comes_after_it() -> None:
    """`fleetctl nodes --sort-by` sorts after the live read by a part of the record it
    sets (every node matching is read live first), before it by any other (with
    `--limit`, only the nodes kept are read live)."""
    for key in ("seq", "last-seen", "health", "gpus", "version", ".heartbeat.sample.hostname"):
        assert sorts_live(key), key
    for key in ("node", "cluster", "state", "sched", "age", ".labels.rack", "{.node_id}"):
        assert not sorts_live(key), key
