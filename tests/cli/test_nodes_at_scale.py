"""fleetctl nodes at fleet size: a summary above a screenful, rows on request, streamed
JSON identical to one array."""

from __future__ import annotations

import json
import time

import msgspec
import pytest

from actors.cli.render import tables
from actors.fleet import record_state
from actors.fleet.aggregator import record_rules
from actors.runtime.bus import NatsBus
from schemas import codec
from schemas.subjects import BUCKET_NODES, Subjects
from tests.cli.test_fleetctl_listing import fleetctl
from tests.support.fleet import Fleet

COUNT = tables.SUMMARY_ABOVE + 10


async def many_records(fleet: Fleet, bus: NatsBus, prefix: str) -> None:
    """COUNT records in two clusters, every third one stale."""
    # Provisions the bucket; no sweep in the test's time, whose first (a full one, after
    # sweep_interval) would take the ancient stale records offline under load.
    await fleet.start_aggregator(sweep_interval=3600.0)
    bucket = await bus.kv(Subjects(prefix).bucket_name(BUCKET_NODES))
    for i in range(COUNT):
        record = record_rules.pending_record(f"n{i:03d}", "c1" if i % 2 else "c2")
        record = record_state.with_state(
            # Stale since now: one stale since 1970 is offline at the aggregator's next sweep.
            record,
            last_seq=1,
            stale_since=time.time() if i % 3 == 0 else None,
        )
        await bucket.put(record.node_id, codec.encode(record))


@pytest.mark.slow
async def test_summary_above_a_screenful_and_rows_on_request(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """Above SUMMARY_ABOVE nodes the default is a cluster-by-state summary; --limit and
    --all list rows; --json streams exactly the array -o json always printed."""
    await many_records(fleet, bus, prefix)
    where = ("--server", fleet.url, "--prefix", prefix)
    code, out, _ = await fleetctl("nodes", *where)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["CLUSTER", "ACTIVE", "STALE", "TOTAL"]
    assert lines[-2].split() == ["all", str(COUNT - 20), "20", str(COUNT)]
    assert "summarised" in lines[-1] and len(lines) == 5

    code, out, _ = await fleetctl("nodes", *where, "--limit", "5")
    assert code == 0 and "n004" in out and "n005" not in out and "summarised" not in out
    code, out, _ = await fleetctl("nodes", *where, "--all", "--state", "stale")
    assert code == 0 and out.count("\n") >= 20 and "n003" in out and "n001" not in out

    code, out, _ = await fleetctl("nodes", *where, "--json")
    records = json.loads(out)
    assert len(records) == COUNT
    assert out == msgspec.json.encode(records).decode() + "\n"
