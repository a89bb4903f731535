"""Live views (issue 33): fleetctl and the fleet API show each node's latest accepted
heartbeat from FLEET_HB, never a refused one, whatever the checkpoint schedule."""

from __future__ import annotations

import asyncio
import gc
import io
import json
import time
from typing import cast

import aiohttp
import msgspec
import nats
import nats.js.errors
import pytest

from actors.cli.simulate.publisher import SimOptions
from actors.cli.simulate.run import simulate
from actors.fleet.live import reader as live
from actors.fleet.live import stored_heartbeats
from actors.fleet.metrics import AggregatorMetrics
from actors.fleet.storage import records as stored
from actors.fleet.storage.records import read_record, read_records
from actors.fleet.storage.registry import approve
from actors.runtime import direct_get, signature_helpers
from actors.runtime.bus import NatsBus
from schemas import codec, signing
from schemas.events import Inject
from schemas.messages import Heartbeat, NodeRecord
from schemas.subjects import EVENT_INJECT, Subjects
from tests.cli.test_fleetctl_listing import fleetctl
from tests.support.fleet import Fleet, heartbeat, new_fleet_api, wait_for, wait_record

INTERVAL = 1.0
CHECKPOINT = 60.0


def temperatures(record: NodeRecord | dict[str, object]) -> list[float | None]:
    """The GPU temperatures of the heartbeat a record (or its JSON) shows."""
    if isinstance(record, dict):
        record = msgspec.convert(record, live.LiveRecord)
    beat = record.heartbeat
    assert beat is not None and beat.sample is not None
    return [gpu.temperature_c for gpu in beat.sample.gpus]


async def stored_seq(bus: NatsBus, prefix: str, node: str = "n1") -> int:
    """The seq of the heartbeat FLEET_HB holds for ``node`` now (read as a plain get)."""
    subject = Subjects(prefix).stored_heartbeat("c1", node, 8)
    msg = await bus.js.get_last_msg(Subjects(prefix).stream_name("FLEET_HB"), subject)
    assert msg.data is not None
    return codec.decode(msg.data, Heartbeat, subject).seq


async def test_views_show_the_latest_heartbeat_not_the_checkpoint(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """With a 1 s heartbeat and a 60 s checkpoint, an injected temperature shows long
    before a checkpoint could carry it (the design's bound is interval + 1 s; waited for
    here up to 15 s, for a loaded machine) in `fleetctl nodes -o json`, `node`,
    `describe`, `workloads --json` and GET /nodes/<id> of an API beside no aggregator (it
    holds no partition), with a seq past the stored record's and at least the one
    FLEET_HB held when each was asked."""
    await fleet.start_aggregator(checkpoint_interval=CHECKPOINT)
    await fleet.start_agent(fleet.config(heartbeat_interval=INTERVAL, sample_interval=0.5))
    api = new_fleet_api(bus, prefix, AggregatorMetrics())
    await fleet.start_supervisor(api)
    first = await wait_record(bus, prefix, "n1", lambda r: r.health_status == "healthy")
    await wait_for(lambda: _past(bus, prefix, first))
    fault = Inject(ts=time.time(), node_id="n1", fault="temp", value=95.0)
    await fleet.publish_event(EVENT_INJECT, fault)

    async def injected() -> bool:
        beat = (await live.read_node(bus, Subjects(prefix), "n1")).heartbeat
        gpus = beat.sample.gpus if beat is not None and beat.sample is not None else []
        return {gpu.temperature_c for gpu in gpus} == {95.0}

    await wait_for(injected)
    # The fault turns n1 degraded, and a state change is written at once: the views must
    # show beats past that write too (on a fast machine the whole test ran within one).
    written = await wait_record(bus, prefix, "n1", lambda r: r.state == "degraded", stored=True)
    await wait_for(lambda: _past(bus, prefix, written))
    base = ("--server", fleet.url, "--prefix", prefix)

    floor = await stored_seq(bus, prefix)
    code, out, err = await fleetctl("nodes", *base, "-o", "json")
    assert (code, err) == (0, "")
    (shown,) = json.loads(out)
    assert shown["live"] is True and shown["last_seq"] >= floor, shown["live_note"]
    assert set(temperatures(shown)) == {95.0}

    floor = await stored_seq(bus, prefix)
    code, out, err = await fleetctl("node", "n1", *base, "--json")
    assert code == 0 and json.loads(out)["last_seq"] >= floor
    assert set(temperatures(json.loads(out))) == {95.0}

    floor = await stored_seq(bus, prefix)
    code, out, err = await fleetctl("describe", "n1", *base)
    assert code == 0, err
    seq = int(out.split("(seq ", 1)[1].split(",", 1)[0])
    assert seq >= floor and "read live from FLEET_HB" in out and " 95C " in out

    code, out, err = await fleetctl("workloads", *base, "--json")
    assert (code, out) == (0, "[]\n")

    floor = await stored_seq(bus, prefix)
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{api.port}/nodes/n1") as response:
            answer = await response.json()
    assert answer["live"] is True and answer["last_seq"] >= floor
    assert set(temperatures(answer)) == {95.0}
    stored = await read_record(bus, Subjects(prefix), "n1")
    assert stored.last_seq < floor, "the checkpoint moved: the test proves nothing"


async def _past(bus: NatsBus, prefix: str, record: NodeRecord) -> bool:
    return await stored_seq(bus, prefix) > record.last_seq + 2


async def beat(
    bus: NatsBus, key: signing.KeyPair, prefix: str, seq: int, **changes: object
) -> bytes:
    """Publish one signed heartbeat of n1 (its bytes returned) and wait for its ack."""
    body = codec.encode(heartbeat("n1", seq, **changes))
    await bus.js.publish(Subjects(prefix).heartbeat("c1", "n1"), body, headers=key.headers(body))
    return body


async def test_a_forged_or_replayed_heartbeat_never_shows(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """A heartbeat signed by another key, and a replay (a plain client publishing an
    accepted heartbeat again, newer than the checkpoint), each the latest message on the
    node's subject: the live read never shows them; it shows the record, marked."""
    await fleet.start_aggregator(checkpoint_interval=CHECKPOINT)
    key = fleet.node_key()
    await approve(bus, Subjects(prefix), "n1", key.public_key)
    await beat(bus, key, prefix, 1)
    first = await wait_record(bus, prefix, "n1", lambda r: r.last_seq == 1)
    third = b""
    for seq in (2, 3, 4):
        body = await beat(bus, key, prefix, seq)
        third = body if seq == 3 else third
    shown = await wait_for(lambda: _shown_seq(bus, prefix, 4))
    assert shown.live and shown.last_seq == 4

    client = await nats.connect(fleet.url)
    try:
        attacker = signing.create_key_file(fleet.state_dir / "attacker.nk")
        forged = codec.encode(heartbeat("n1", 99, agent_version="forged"))
        subject = Subjects(prefix).heartbeat("c1", "n1")
        await client.publish(subject, forged, headers=attacker.headers(forged))
        await client.flush()
        for _ in range(5):
            record = await live.read_node(bus, Subjects(prefix), "n1")
            assert record.last_seq != 99 and record.agent_version != "forged"
        # The refusal was noted in the record, written with the latest accepted seq.
        assert not record.live and record.last_seq == 4
        # The replay: seq 3's exact bytes and signature, without its Nats-Msg-Id.
        await client.publish(subject, third, headers=key.headers(third))
        await client.flush()
        for _ in range(5):
            record = await live.read_node(bus, Subjects(prefix), "n1")
            assert record.last_seq == 4, "a refused replay was shown"
        assert not record.live and record.live_note
        # Again, read against the first checkpoint (seq 1, older than the replayed beat):
        # only the owner's judgement, read through its ack floor with the refused message
        # deleted, keeps the replay out; the checks a reader can make alone pass it.
        sixth = b""
        for seq in (5, 6, 7):
            body = await beat(bus, key, prefix, seq)
            sixth = body if seq == 6 else sixth
        await wait_for(lambda: _shown_seq(bus, prefix, 7))
        await client.publish(subject, sixth, headers=key.headers(sixth))
        await client.flush()
        for _ in range(5):
            (record,) = await live.overlay(bus, Subjects(prefix), [first])
            assert record.last_seq != 6, "a refused replay was shown"
        assert not record.live and record.last_seq == 1
        stream = Subjects(prefix).stream_name("FLEET_HB")
        stored_subject = Subjects(prefix).stored_heartbeat("c1", "n1", 8)
        with pytest.raises(nats.js.errors.NotFoundError):
            await bus.js.get_last_msg(stream, stored_subject)
    finally:
        await client.close()


async def _shown_seq(bus: NatsBus, prefix: str, seq: int) -> live.LiveRecord | None:
    record = await live.read_node(bus, Subjects(prefix), "n1")
    return record if record.last_seq == seq else None


@pytest.mark.parametrize("scan_above", [0, stored_heartbeats.SCAN_ABOVE])
async def test_a_listing_reads_every_beating_node_live(
    fleet: Fleet, bus: NatsBus, prefix: str, monkeypatch: pytest.MonkeyPatch, scan_above: int
) -> None:
    """30 simulated nodes beating through a real aggregator with a 60 s checkpoint: the
    listing (as a scan of FLEET_HB, and as multi_last requests) shows every node live,
    each at or past the seq its stored record holds, most of them past it."""
    monkeypatch.setattr(stored_heartbeats, "SCAN_ABOVE", scan_above)
    await fleet.start_aggregator(checkpoint_interval=CHECKPOINT)
    # Long enough to outlast the reads on a loaded machine; cancelled after them.
    options = SimOptions(nodes=30, rate=60.0, duration=60.0, gpus=2, prefix=prefix, wait=0.5)
    load = asyncio.create_task(simulate(bus, options, io.StringIO()))
    subjects = Subjects(prefix)
    reads: list[tuple[list[live.LiveRecord], dict[str, NodeRecord]]] = []

    async def most_past() -> bool:
        # More beats of each node (two a second), none of them checkpointed. The stored
        # records first: a checkpoint written between the two reads is then older than
        # the live read, never newer (seen on a loaded machine).
        stored = {r.node_id: r for r in await read_records(bus, subjects)}
        shown = await live.read_fleet(bus, subjects)
        reads.append((shown, stored))
        return sum(r.last_seq > stored[r.node_id].last_seq for r in shown) > 15

    try:
        await wait_for(lambda: _all_beyond_first(bus, subjects))
        await wait_for(most_past, interval=0.5)
        assert not load.done(), "the load ended before the read"
    finally:
        load.cancel()
        await asyncio.gather(load, return_exceptions=True)
    shown, stored = reads[-1]
    assert len(shown) == 30 and all(record.live for record in shown), [
        record.live_note for record in shown if not record.live
    ]
    assert all(record.last_seq >= stored[record.node_id].last_seq for record in shown)


async def test_a_scan_has_its_signatures_checked_by_helpers_and_refuses_alike(
    fleet: Fleet, bus: NatsBus, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A listing that scans FLEET_HB hands its signatures to helper processes
    (:mod:`actors.runtime.signature_helpers`, here for every message) and refuses what a
    check in its own process refuses. Three nodes beat and are judged; the aggregator
    stops, so the messages published after stay unjudged. n2's latest message then
    carries its own key and signature over a body changed after signing: the helpers
    refuse it for the signature, before anything else is looked at. n3's is a good
    signed beat never judged: it passes the helpers and waits for a judgement."""
    aggregator = await fleet.start_aggregator(checkpoint_interval=CHECKPOINT)
    keys = {node: fleet.node_key(node) for node in ("n1", "n2", "n3")}
    subjects = Subjects(prefix)
    for node, key in keys.items():
        await approve(bus, subjects, node, key.public_key)
        for seq in (1, 2):
            body = codec.encode(heartbeat(node, seq))
            await bus.js.publish(subjects.heartbeat("c1", node), body, headers=key.headers(body))

    async def all_live_at_two() -> bool:
        shown = await live.read_fleet(bus, subjects)
        return len(shown) == 3 and all(r.live and r.last_seq == 2 for r in shown)

    await wait_for(all_live_at_two, interval=0.2)
    await aggregator.stop()
    signed = codec.encode(heartbeat("n2", 3))
    changed = codec.encode(heartbeat("n2", 3, agent_version="changed after signing"))
    headers = keys["n2"].headers(signed)
    await bus.js.publish(subjects.heartbeat("c1", "n2"), changed, headers=headers)
    body = codec.encode(heartbeat("n3", 3))
    await bus.js.publish(subjects.heartbeat("c1", "n3"), body, headers=keys["n3"].headers(body))

    monkeypatch.setattr(stored_heartbeats, "SCAN_ABOVE", 0)
    monkeypatch.setattr(live, "JUDGE_WAIT", 0.5)  # n3's judgement never comes: not the point
    monkeypatch.setattr(signature_helpers, "HELPED_FROM", 1)
    monkeypatch.setattr(live, "default_helpers", lambda: 1)
    sent: list[int] = []
    send = signature_helpers._Helper.send

    def counted(helper: signature_helpers._Helper, batch: signature_helpers._Batch) -> None:
        sent.append(len(batch.items))
        send(helper, batch)

    monkeypatch.setattr(signature_helpers._Helper, "send", counted)
    answer = signature_helpers.SignatureChecks.answer

    async def after_the_start(
        checks: signature_helpers.SignatureChecks, batch: signature_helpers._Batch
    ) -> list[str]:
        # The reader would check a batch itself rather than wait for the helper to start
        # (tests/runtime/test_signature_helpers.py): here each waits, to be the helper's.
        if checks._starting is not None:
            await checks._starting
        return await answer(checks, batch)

    monkeypatch.setattr(signature_helpers.SignatureChecks, "answer", after_the_start)
    shown = {record.node_id: record for record in await live.read_fleet(bus, subjects)}
    # n2's and n3's messages in the scan; n3's again once the wait for its judgement ends.
    assert sent == [2, 1], sent
    assert shown["n1"].live and shown["n1"].last_seq == 2
    assert not shown["n2"].live and shown["n2"].last_seq == 2
    assert shown["n2"].agent_version != "changed after signing"
    assert shown["n2"].live_note == "latest heartbeat refused: signature does not match the body"
    assert not shown["n3"].live and shown["n3"].live_note == live._PENDING


async def test_a_scan_reads_the_ack_floors_once_not_per_page(
    fleet: Fleet, bus: NatsBus, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A listing that scans FLEET_HB in many pages (30 judged nodes, 2 messages a page)
    asks for each partition's consumer info once, before the scan, not before every page
    (a consumer info costs the server a pass over the partition's subjects), and still
    shows every node live. Counted by a plain client listening on the API subjects."""
    await fleet.start_aggregator(checkpoint_interval=CHECKPOINT)
    options = SimOptions(
        nodes=30, rate=60.0, duration=2.0, gpus=2, prefix=prefix, wait=0.5, min_stale_after=300
    )
    await simulate(bus, options, io.StringIO())  # every node beats, then stops
    subjects = Subjects(prefix)
    await wait_for(lambda: _all_beyond_first(bus, subjects))

    async def all_live() -> bool:
        return all(record.live for record in await live.read_fleet(bus, subjects))

    await wait_for(all_live, interval=0.5)  # every beat judged: nothing waits below
    monkeypatch.setattr(stored_heartbeats, "SCAN_ABOVE", 0)
    monkeypatch.setattr(direct_get, "PAGE_KEYS", 2)
    stream = subjects.stream_name("FLEET_HB")
    client = await nats.connect(fleet.url)
    try:
        infos = await client.subscribe(f"$JS.API.CONSUMER.INFO.{stream}.>")
        pages = await client.subscribe(f"$JS.API.DIRECT.GET.{stream}")
        await client.flush()
        shown = await live.read_fleet(bus, subjects)
        await bus.flush(5.0)
        await client.flush()
        asked_pages, asked_infos = pages.pending_msgs, infos.pending_msgs
    finally:
        await client.close()
    assert len(shown) == 30 and all(record.live for record in shown), [
        record.live_note for record in shown if not record.live
    ]
    assert asked_pages >= 15, asked_pages
    assert asked_infos == 8, f"{asked_infos} consumer infos for {asked_pages} pages"


async def test_a_listing_reads_no_key_for_a_heartbeat_its_record_holds(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """Once every record holds its node's latest heartbeat (a 0.5 s checkpoint, the nodes
    stopped), a listing shows every node live without one read of fleet_trust: only a
    heartbeat newer than its record is verified, so only its node's key is read (counted
    by a plain client listening on the bucket's direct-get subject)."""
    await fleet.start_aggregator(checkpoint_interval=0.5)
    options = SimOptions(
        nodes=30, rate=60.0, duration=2.0, gpus=2, prefix=prefix, wait=0.5, min_stale_after=300
    )
    await simulate(bus, options, io.StringIO())  # every node beats, then stops
    subjects = Subjects(prefix)

    async def checkpointed() -> bool:
        stored = {r.node_id: r for r in await read_records(bus, subjects)}
        shown = await live.read_fleet(bus, subjects)
        return len(shown) == 30 and all(
            r.live and r.last_stream_seq == stored[r.node_id].last_stream_seq for r in shown
        )

    await wait_for(checkpointed, interval=0.5)
    trust = f"$JS.API.DIRECT.GET.KV_{subjects.bucket_name('fleet_trust')}"
    client = await nats.connect(fleet.url)
    try:
        asked = await client.subscribe(trust)
        await client.flush()
        shown = await live.read_fleet(bus, subjects)
        await bus.flush(5.0)
        await client.flush()
        keys_read = asked.pending_msgs
    finally:
        await client.close()
    assert len(shown) == 30 and all(record.live for record in shown)
    assert keys_read == 0, f"{keys_read} reads of fleet_trust"


async def _all_beyond_first(bus: NatsBus, subjects: Subjects) -> bool:
    records = await read_records(bus, subjects)
    return len(records) == 30 and all(r.last_seq >= 1 for r in records)


async def test_the_live_reads_of_the_fleet_decode_with_the_collector_paused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What ``fleetctl nodes -o json --all`` reads (every record, then every heartbeat)
    is decoded with the collector paused (16 % of its CPU at 100,000 nodes)."""
    during: list[tuple[str, bool]] = []
    assert gc.isenabled()

    async def records(bus: object, subjects: object) -> stored.Shelved:
        during.append(("records", gc.isenabled()))
        return stored.Shelved([], stored.Shelf())

    async def heartbeats(
        bus: object,
        subjects: object,
        shown: list[NodeRecord],
        durable: str,
        shelf: stored.Shelf | None,
        helpers: int,
    ) -> list[live.LiveRecord]:
        during.append(("heartbeats", gc.isenabled()))
        return []

    async def facts(
        bus: object, subjects: object, shown: list[live.LiveRecord]
    ) -> list[live.LiveRecord]:
        during.append(("facts", gc.isenabled()))
        return shown

    monkeypatch.setattr(stored, "read_records_shelved", records)
    monkeypatch.setattr(live, "_overlay", heartbeats)
    monkeypatch.setattr(live, "fleet_facts", facts)
    await live.read_fleet(cast(NatsBus, object()), Subjects("fleet"))
    assert during == [("records", False), ("heartbeats", False), ("facts", False)]
    assert gc.isenabled()


async def _beaten_past_their_records(fleet: Fleet, bus: NatsBus, prefix: str) -> list[str]:
    """30 simulated nodes that beat four times each and stopped, through a real
    aggregator with a 60 s checkpoint, every beat judged: the nodes whose FLEET_HB
    heartbeat is newer than the one their record holds (most of them)."""
    await fleet.start_aggregator(checkpoint_interval=CHECKPOINT)
    options = SimOptions(
        nodes=30, rate=60.0, duration=2.0, gpus=2, prefix=prefix, wait=0.5, min_stale_after=300
    )
    await simulate(bus, options, io.StringIO())
    subjects = Subjects(prefix)

    async def all_live() -> bool:
        shown = await live.read_fleet(bus, subjects)
        return len(shown) == 30 and all(record.live for record in shown)

    await wait_for(all_live, interval=0.5)
    kept = {r.node_id: r for r in await read_records(bus, subjects)}
    return [
        r.node_id
        for r in await live.read_fleet(bus, subjects)
        if r.last_stream_seq > kept[r.node_id].last_stream_seq
    ]


async def _rewrite(bus: NatsBus, prefix: str, node: str, **changes: object) -> None:
    """Put ``node``'s record back with ``changes`` to its JSON (``heartbeat_seq``: its
    heartbeat's seq), as a damaged or hand-edited store would hold it."""
    bucket = await bus.kv(Subjects(prefix).bucket_name("fleet_nodes"))
    entry = await bucket.get(node)
    assert entry.value is not None
    record = json.loads(entry.value)
    if "heartbeat_seq" in changes:
        record["heartbeat"]["seq"] = changes.pop("heartbeat_seq")
    await bucket.put(node, json.dumps(record | changes).encode())


async def test_a_listing_decodes_a_records_own_heartbeat_only_where_it_shows_it(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """A listing reads the records with their heartbeats undecoded and decodes a record's
    own only where no newer one is shown. Two records are rewritten with a heartbeat that
    does not decode: one whose node has a newer heartbeat in FLEET_HB is listed with that
    one, live (read whole, as before, the record was left out of the listing as
    unreadable); one made to hold its node's latest message is listed from its record,
    without a heartbeat and saying why. `fleetctl nodes -o json --all` lists them alike."""
    behind = await _beaten_past_their_records(fleet, bus, prefix)
    assert len(behind) >= 3, behind
    subjects = Subjects(prefix)
    latest = {r.node_id: r for r in await live.read_fleet(bus, subjects)}
    kept = {r.node_id: r for r in await read_records(bus, subjects)}
    # What the live read changed of a record beaten past: only what it says it sets
    # (`fleetctl nodes --sort-by` sorts by any other before it).
    third = behind[2]
    changed = {
        name
        for name in NodeRecord.__struct_fields__
        if getattr(kept[third], name) != getattr(latest[third], name)
    }
    assert {"heartbeat", "last_seq", "last_stream_seq"} <= changed <= live.SHOWN_LIVE, changed
    newer, own = behind[:2]
    await _rewrite(bus, prefix, newer, heartbeat_seq="not a number")
    await _rewrite(
        bus,
        prefix,
        own,
        heartbeat_seq="not a number",
        last_seq=latest[own].last_seq,
        last_stream_seq=latest[own].last_stream_seq,
    )
    assert {r.node_id for r in await read_records(bus, subjects)} == set(latest) - {newer, own}

    shown = {r.node_id: r for r in await live.read_fleet(bus, subjects)}
    assert set(shown) == set(latest)
    assert shown[newer].live and shown[newer].last_stream_seq == latest[newer].last_stream_seq
    assert shown[newer].heartbeat == latest[newer].heartbeat
    assert not shown[own].live and shown[own].heartbeat is None
    assert shown[own].live_note.startswith("its record's heartbeat is unreadable: "), shown[own]
    assert all(r.live and r.heartbeat is not None for n, r in shown.items() if n != own)

    base = ("--server", fleet.url, "--prefix", prefix)
    code, out, err = await fleetctl("nodes", *base, "-o", "json", "--all")
    assert (code, err) == (0, "")
    listed = {r["node_id"]: r for r in json.loads(out)}
    assert set(listed) == set(latest)
    assert listed[newer]["live"] and not listed[own]["live"]


async def test_nodes_sort_by_the_values_shown_not_the_checkpoints(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """`fleetctl nodes --sort-by last-seen` orders by each node's latest accepted
    heartbeat, as shown, not by its record's checkpoint: the records' `last_seen` are
    rewritten in the reverse of the live order, and the listing (whole, and its first
    five with `--limit 5`) is still in the live order."""
    behind = await _beaten_past_their_records(fleet, bus, prefix)
    subjects = Subjects(prefix)
    latest = sorted(
        (r for r in await live.read_fleet(bus, subjects) if r.node_id in behind),
        key=lambda r: r.last_seen,
    )
    assert len(latest) >= 10, len(latest)
    for index, record in enumerate(latest):
        await _rewrite(bus, prefix, record.node_id, last_seen=2_000_000_000.0 - index)

    base = ("--server", fleet.url, "--prefix", prefix, "-o", "json", "--sort-by", "last-seen")
    code, out, err = await fleetctl("nodes", *base)
    assert (code, err) == (0, "")
    seen = [r["last_seen"] for r in json.loads(out)]
    assert len(seen) == 30 and seen == sorted(seen)
    code, out, err = await fleetctl("nodes", *base, "--limit", "5")
    assert (code, err) == (0, "")
    assert [r["last_seen"] for r in json.loads(out)] == seen[:5]
