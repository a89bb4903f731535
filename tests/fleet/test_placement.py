"""Placement and reconciliation decisions as pure functions of records: which GPUs are
free, which node is chosen and why, when a replica moves; and what a reconciler does
with hostile records in ``fleet_workloads`` (unreadable, unsigned, signed by a stranger,
changed after signing): nothing."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
from nats.aio.msg import Msg

from actors.fleet.placement import reconcile
from actors.fleet.placement.actor import ReconcilerActor
from actors.fleet.placement.choose import FAILURE_BACKOFF, Choice, Taken, choose, free_gpus
from actors.fleet.placement.reconcile import Timing, decide
from actors.fleet.storage.placed import read_all
from actors.runtime.bus import NatsBus
from schemas import codec, signing
from schemas.events import Capacity, Gpu, Sample, WorkloadState
from schemas.messages import Command, NodeRecord, WorkloadSummary
from schemas.placement import Failure, PlacedWorkload, Replica, spec_body
from schemas.subjects import BUCKET_NODES, BUCKET_WORKLOADS, Subjects
from schemas.workloads import Deploy, Stop
from tests.support.fleet import Fleet, Flickering, fed, heartbeat, wait_for

GIB = 1024**3


def gpu(index: int, used: int = 10 * GIB, **changes: Any) -> Gpu:
    values: dict[str, Any] = {
        "index": index,
        "uuid": f"GPU-{index}",
        "name": "H100",
        "pci_bus_id": f"0:{index}",
        "memory_total": 80 * GIB,
        "memory_used": used,
        "utilization_pct": 10.0,
        **changes,
    }
    return Gpu(**values)


def node(
    name: str,
    gpus: list[Gpu] | None = None,
    state: str = "active",
    workloads: list[WorkloadSummary] | None = None,
    capabilities: list[str] | None = None,
    **changes: Any,
) -> NodeRecord:
    """An active node of cluster c1 with ``gpus`` (two idle H100s by default), saying it
    can run ``capabilities`` (None: says nothing, as an older agent)."""
    gpus = gpus if gpus is not None else [gpu(0), gpu(1)]
    capacity = Capacity(
        cpu_cores=8, cpu_percent=1.0, load_avg_1m=0.1, memory_total=1, memory_available=1,
        gpus_total=len(gpus), gpus_available=len(gpus), storage_total=1, storage_available=1,
    )  # fmt: skip
    sample = Sample(ts=time.time(), capacity=capacity, gpus=gpus)
    beat = heartbeat(name, sample=sample, workloads=workloads or [], capabilities=capabilities)
    record = NodeRecord(
        node_id=name,
        cluster="c1",
        state=state,
        last_seq=1,
        last_seen=time.time(),
        heartbeat=beat,
        health_score=100,
    )
    return msgspec.structs.replace(record, **changes)


def workload(gpus: int = 1, **changes: Any) -> PlacedWorkload:
    deploy = Deploy(name="chat", engine="llamacpp", model="/m.gguf", placed=True)
    return PlacedWorkload(name="chat", deploy=deploy, gpus=gpus, created_at=1.0, **changes)


def running(name: str, gpus: list[int], state: WorkloadState = "ready") -> WorkloadSummary:
    return WorkloadSummary(
        name=name, engine="llamacpp", state=state, since=1.0, port=1, gpus=gpus, placed=True
    )


def test_free_gpus_leave_out_lost_busy_held_and_placed_ones() -> None:
    """Of four GPUs: a lost one, a 95 % busy one, one a running workload holds and one a
    placed (not yet reported) replica holds are not free; a failed workload holds none."""
    record = node(
        "n1",
        [gpu(0, lost=True), gpu(1, utilization_pct=95.0), gpu(2), gpu(3), gpu(4)],
        workloads=[running("other", [2]), running("dead", [4], "crashloop")],
    )
    taken = Taken()
    taken.add("n1", [3])
    assert free_gpus(record, workload(), taken) == [4]
    assert free_gpus(record, workload(gpus=2), taken) == "1 of 5 GPUs free, 2 needed"


def test_gpu_memory_is_checked_where_asked() -> None:
    """With gpu_memory, a GPU with less free memory does not count, and the reason says so."""
    record = node("n1", [gpu(0, used=60 * GIB), gpu(1, used=10 * GIB)])
    assert free_gpus(record, workload(gpu_memory=40 * GIB), Taken()) == [1]
    reason = free_gpus(record, workload(gpus=2, gpu_memory=40 * GIB), Taken())
    assert reason == "1 of 2 GPUs free, 1 more with less than 40.0 GiB free, 2 needed"


def test_choose_skips_unfit_nodes_and_spreads() -> None:
    """Cordoned, unhealthy, stale, other-cluster, unlabelled and GPU-less nodes are passed
    over with their reasons; among fitting nodes the one with fewer placed replicas wins."""
    records = {
        "a": node("a", state="cordoned"),
        "b": node("b", state="unhealthy"),
        "c": node("c", state="stale"),
        "d": node("d", cluster="c2"),
        "e": node("e", gpus=[], labels={"pool": "x"}),
        "f": node("f", labels={"pool": "x"}),
        "g": node("g", labels={"pool": "x"}),
    }
    taken = Taken()
    taken.add("f", [])
    found = choose(workload(cluster="c1", selector={"pool": "x"}), records, taken)
    assert isinstance(found, Choice) and found.node == "g" and found.gpus == [0]
    for reason in ("a: cordoned", "b: unhealthy", "c: stale", "d: cluster c2", "e: 0 of 0"):
        assert reason in found.why
    only_labelled = choose(workload(selector={"pool": "y"}), {"f": records["f"]}, Taken())
    assert only_labelled == "no node fits: f: labels do not match"


def test_replicas_never_share_a_node() -> None:
    """A node running a replica already is passed over for the next one."""
    placed = workload(replicas=[Replica(index=0, node="n1", cluster="c1", gpus=[0])])
    found = choose(placed, {"n1": node("n1")}, Taken())
    assert found == "no node fits: n1: runs a replica already"


def test_placement_needs_the_engine_and_ranks_healthy_first() -> None:
    """A node that says it cannot run the engine is passed over, naming what it can; a
    healthy 4-GPU node wins over a degraded 8-GPU one (health before free GPUs); a node
    that says nothing (an older agent) still fits; a deploy with an image needs
    container:<engine>; --why names the capability and the health."""
    eight = [gpu(i) for i in range(8)]
    records = {
        "big": node("big", eight, capabilities=["llamacpp"], health_status="degraded"),
        "small": node("small", eight[:4], capabilities=["llamacpp"], health_status="healthy"),
        "other": node("other", eight, capabilities=["vllm"], health_status="healthy"),
    }
    found = choose(workload(), records, Taken())
    assert isinstance(found, Choice) and found.node == "small", found
    assert "healthy (score 100), can run llamacpp" in found.why
    assert "other: cannot run llamacpp (it can run: vllm)" in found.why
    assert "big (8 free)" in found.why  # fits, ranked after
    older = {"old": node("old", capabilities=None, health_status="healthy")}
    chosen = choose(workload(), older, Taken())
    assert isinstance(chosen, Choice) and "capabilities not said" in chosen.why
    plain = workload()
    image = msgspec.structs.replace(
        plain, deploy=msgspec.structs.replace(plain.deploy, image="r/x")
    )
    refused = choose(image, {"small": records["small"]}, Taken())
    assert refused == ("no node fits: small: cannot run container:llamacpp (it can run: llamacpp)")


def test_maintenance_and_a_recent_failure_keep_a_node_out() -> None:
    """A node in a maintenance window is never chosen; one where a replica failed within
    the backoff is passed over with when it failed, why and for how long, and fits again
    once the backoff is over."""
    now = time.time()
    records = {"n1": node("n1", capabilities=["llamacpp"])}
    kept = choose(workload(), records, Taken(), now=now, maintenance={"n1": "swap"})
    assert kept == "no node fits: n1: in maintenance (window swap)"
    failure = Failure(node="n1", index=1, at=now - 120, reason="failed there: no llama-server")
    failed = workload(failures=[failure])
    why = choose(failed, records, Taken(), now=now)
    assert why == (
        "no node fits: n1: replica 1 failed there 2m ago (failed there: no llama-server); "
        "not tried again for 8m (backoff 10m)"
    )
    later = choose(failed, records, Taken(), now=now + FAILURE_BACKOFF)
    assert isinstance(later, Choice) and later.node == "n1"


def test_a_failed_replica_moves_and_no_replica_goes_back_there_within_the_backoff() -> None:
    """Replica 0 failed on n1: it moves to n2 and the failure is kept; replica 1, drained
    off n3 a moment later, is not sent to n1 (it waits: nothing else fits), though n1 is
    free and replica 1 never failed there."""
    now = time.time()
    failed = WorkloadSummary(
        name="chat", engine="llamacpp", state="failed", since=now, port=1, reason="no binary"
    )
    placed = workload(
        replicas=[
            Replica(index=0, node="n1", cluster="c1", gpus=[0], deployed_at=now - 5),
            Replica(index=1, node="n3", cluster="c1", gpus=[0], deployed_at=now - 5),
        ]
    )
    records = {
        "n1": node("n1", workloads=[failed]),
        "n2": node("n2"),
        "n3": node("n3", workloads=[running("chat", [0])]),
    }
    moved = decide(placed, records, Taken(), now, Timing(), "me").workload
    assert [r.node for r in moved.replicas] == ["n2", "n3"]
    [failure] = moved.failures
    assert (failure.node, failure.index) == ("n1", 0) and "no binary" in failure.reason
    busy = records["n3"].heartbeat
    assert busy is not None
    draining = msgspec.structs.replace(
        records["n3"], heartbeat=msgspec.structs.replace(busy, schedulability="draining")
    )
    idle = node("n1")  # the failed copy stopped: n1 is free again
    again = decide(moved, {**records, "n1": idle, "n3": draining}, Taken(), now + 1, Timing(), "me")
    stuck = again.workload.replicas[1]
    assert stuck.node == "n3" and "n1: replica 0 failed there" in stuck.why


def test_a_maintenance_window_with_drain_moves_the_replicas_like_a_drain() -> None:
    """A window started with --drain moves the replica off its node at once, its copy
    kept until the new one is ready (handoff); a window without it leaves the replica
    where it runs (placement only chooses no node in it)."""
    now = time.time()
    placed = workload(
        replicas=[Replica(index=0, node="n1", cluster="c1", gpus=[0], deployed_at=now - 100)]
    )
    records = {"n1": node("n1", workloads=[running("chat", [0])]), "n2": node("n2")}
    kept = decide(placed, records, Taken(), now, Timing(), "me", {"n1": "w1"})
    assert kept.workload == placed and kept.orders == []
    moved = decide(placed, records, Taken(), now, Timing(), "me", {"n1": "w1"}, {"n1": "w1"})
    [replica] = moved.workload.replicas
    assert replica.node == "n2" and "in maintenance (window w1, --drain)" in replica.why
    [leftover] = moved.workload.leftovers
    assert leftover.node == "n1" and leftover.stop_by == now + Timing().handoff
    assert [type(order.action) for order in moved.orders] == [Deploy]


def test_a_stale_node_s_replica_waits_for_the_grace_then_moves() -> None:
    """Stale for less than the grace: nothing changes; past it: the replica is deployed on
    the other node (placed, with its GPUs) and the old node kept as a leftover to stop."""
    now = time.time()
    placed = workload(
        replicas=[Replica(index=0, node="n1", cluster="c1", gpus=[0], deployed_at=now - 100)]
    )
    early = {"n1": node("n1", state="stale", stale_since=now - 5), "n2": node("n2")}
    assert decide(placed, early, Taken(), now, Timing(grace=10), "me").workload == placed
    late = {"n1": node("n1", state="stale", stale_since=now - 11), "n2": node("n2")}
    decision = decide(placed, late, Taken(), now, Timing(grace=10), "me")
    [replica] = decision.workload.replicas
    assert (replica.node, replica.moves) == ("n2", 1)
    [order] = decision.orders
    assert order.node == "n2" and isinstance(order.action, Deploy) and order.action.placed
    assert order.action.gpus == replica.gpus == [0]
    [leftover] = decision.workload.leftovers
    assert leftover.node == "n1" and decision.workload.updated_by == "me"


def test_a_node_that_said_goodbye_loses_its_replica_after_the_grace() -> None:
    """A stopped node (its agent's goodbye) counts from stopped_since like a stale one."""
    now = time.time()
    placed = workload(replicas=[Replica(index=0, node="n1", cluster="c1", gpus=[0])])
    for stopped_since, moved in ((now - 5, False), (now - 11, True)):
        records = {"n1": node("n1", state="stopped", stopped_since=stopped_since), "n2": node("n2")}
        decision = decide(placed, records, Taken(), now, Timing(grace=10), "me")
        assert (decision.workload.replicas[0].node == "n2") is moved


def test_a_copy_left_on_a_node_that_returns_is_stopped() -> None:
    """The old node reports again, still running the replica's copy: it gets a Stop once,
    and once more only after ``restop``; when it no longer lists it, it is forgotten."""
    now = time.time()
    placed = workload(replicas=[Replica(index=0, node="n2", cluster="c1", gpus=[0])])
    moved = decide(
        workload(replicas=[Replica(index=0, node="n1", cluster="c1", gpus=[0])]),
        {"n1": node("n1", state="offline", stale_since=now - 100), "n2": node("n2")},
        Taken(),
        now - 10,
        Timing(grace=10),
        "me",
    ).workload
    placed = msgspec.structs.replace(placed, leftovers=moved.leftovers)
    back = {"n1": node("n1", workloads=[running("chat", [0])]), "n2": node("n2")}
    first = decide(placed, back, Taken(), now, Timing(restop=60), "me")
    assert [(o.node, type(o.action)) for o in first.orders] == [("n1", Stop)]
    again = decide(first.workload, back, Taken(), now + 1, Timing(restop=60), "me")
    assert again.orders == []
    gone = {"n1": node("n1"), "n2": node("n2")}
    assert decide(first.workload, gone, Taken(), now + 2, Timing(), "me").workload.leftovers == []


def test_a_copy_on_a_forgotten_node_is_stopped_when_it_is_readmitted() -> None:
    """A replica moved off a node that was forgotten keeps its copy there watched (record
    deregistered, then gone); re-admitted and reporting the copy, the node gets a Stop
    saying it still ran there; a workload of that name the fleet did not place is not
    stopped."""
    now = time.time()
    forgotten = node("n1", deregistered=True, deregistered_at=now - 100, deregistered_by="op")
    moved = decide(
        workload(replicas=[Replica(index=0, node="n1", cluster="c1", gpus=[0])]),
        {"n1": forgotten, "n2": node("n2")},
        Taken(),
        now,
        Timing(grace=10),
        "me",
    ).workload
    [leftover] = moved.leftovers
    assert leftover.node == "n1" and leftover.node_lost
    for away in ({"n1": forgotten, "n2": node("n2")}, {"n2": node("n2")}):
        assert decide(moved, away, Taken(), now + 1, Timing(), "me").workload == moved
    back = {"n1": node("n1", workloads=[running("chat", [0])]), "n2": node("n2")}
    [stop] = decide(moved, back, Taken(), now + 2, Timing(), "me").orders
    assert stop.node == "n1" and isinstance(stop.action, Stop)
    assert "its copy still ran when the node came back" in stop.reason
    by_hand = msgspec.structs.replace(running("chat", [0]), placed=False)
    mine = {"n1": node("n1", workloads=[by_hand]), "n2": node("n2")}
    kept = decide(moved, mine, Taken(), now + 2, Timing(), "me")
    assert kept.orders == [] and kept.workload.leftovers == []


async def test_an_unreadable_record_is_left_out(bus: NatsBus, prefix: str) -> None:
    """A value in fleet_workloads that is not a PlacedWorkload is skipped (and stays as
    it is); the readable one is read."""
    bucket = await bus.kv(Subjects(prefix).bucket_name(BUCKET_WORKLOADS))
    await bucket.put("bad", b'{"name": 5}')
    await bucket.put("chat", codec.encode(workload()))
    found = await read_all(bus, Subjects(prefix))
    assert list(found) == ["chat"] and found["chat"][0] == workload()
    entry = await bucket.get("bad")
    assert entry.value == b'{"name": 5}'


async def test_the_reconciler_acts_only_on_workloads_a_trusted_operator_signed(
    fleet: Fleet, bus: NatsBus, prefix: str, tmp_path: Path
) -> None:
    """Written straight into fleet_workloads with a plain client: an unsigned workload, one
    signed by a stranger, and trusted ones with a replica added or the deploy rewritten
    after signing are left as they are and get no command; the trusted operator's signed
    one is placed."""
    subjects = Subjects(prefix)
    operator, stranger = signing.KeyPair.generate(), signing.KeyPair.generate()
    signing.create_key_file(tmp_path / "reconciler.nk")
    nodes = await bus.kv(subjects.bucket_name(BUCKET_NODES))
    await nodes.put("n1", codec.encode(node("n1")))
    sent: list[str] = []

    async def on_command(msg: Msg) -> None:
        sent.append(codec.decode(msg.data, Command, msg.subject).action.name)  # type: ignore[union-attr]

    await bus.subscribe(subjects.commands(), on_command)
    await bus.flush()

    def signed(name: str, key: signing.KeyPair, replicas: int = 1) -> PlacedWorkload:
        deploy = Deploy(name=name, engine="llamacpp", placed=True)
        spec = PlacedWorkload(
            name=name, deploy=deploy, gpus=1, created_at=1.0, created_by=key.public_key,
            replicas=[Replica(index=i) for i in range(replicas)],
        )  # fmt: skip
        body = spec_body(spec)
        signature = key.headers(body)[signing.HEADER_SIG]
        return msgspec.structs.replace(spec, spec=body.decode(), spec_sig=signature)

    grown, rewritten = signed("grown", operator), signed("rewritten", operator)
    evil = msgspec.structs.replace(rewritten.deploy, args=["--evil"])
    hostile = {
        "rewritten": msgspec.structs.replace(rewritten, deploy=evil),
        "unsigned": msgspec.structs.replace(signed("unsigned", operator), spec_sig=""),
        "stranger": signed("stranger", stranger),
        "grown": msgspec.structs.replace(grown, replicas=[*grown.replicas, Replica(index=1)]),
    }
    bucket = await bus.kv(subjects.bucket_name(BUCKET_WORKLOADS))
    for name, value in {**hostile, "good": signed("good", operator)}.items():
        await bucket.put(name, codec.encode(value))
    actor = ReconcilerActor(
        bus, prefix, str(tmp_path / "reconciler.nk"), operators=[operator.public_key]
    )
    await fleet.follow(actor.feed)
    await actor.round()
    found = await read_all(bus, subjects)
    assert found["good"][0].replicas[0].node == "n1"
    for name, value in hostile.items():
        assert found[name][0] == value
    await wait_for(lambda: sent == ["good"])


async def test_a_round_whose_feed_loses_nodes_midway_moves_no_replica(
    fleet: Fleet, bus: NatsBus, prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The feed turns incomplete while a round reads the maintenance windows (partitions
    let go mid-round): the round decides nothing, and the replica on n1, whose record is
    missing for that moment, is not moved as if its node were gone (it was, under lease
    churn on a loaded machine, and placed on a dead node)."""
    subjects = Subjects(prefix)
    key = signing.create_key_file(tmp_path / "reconciler.nk")
    home = node("n1", workloads=[running("chat", [0])])
    nodes = await bus.kv(subjects.bucket_name(BUCKET_NODES))
    for record in (home, node("n2")):
        await nodes.put(record.node_id, codec.encode(record))
    spec = workload(
        created_by=key.public_key,
        replicas=[Replica(index=0, node="n1", cluster="c1", gpus=[0], deployed_at=1.0)],
    )
    body = spec_body(spec)
    signed = msgspec.structs.replace(
        spec, spec=body.decode(), spec_sig=key.headers(body)[signing.HEADER_SIG]
    )
    bucket = await bus.kv(subjects.bucket_name(BUCKET_WORKLOADS))
    await bucket.put("chat", codec.encode(signed))
    feed = Flickering(bus, subjects)
    await fleet.follow(feed)
    await fed(feed, [home])
    actor = ReconcilerActor(bus, prefix, str(tmp_path / "reconciler.nk"), feed=feed)
    real = actor.windows.refresh

    async def losing() -> None:
        await real()
        feed.lost = True

    monkeypatch.setattr(actor.windows, "refresh", losing)
    assert await actor.round() is False
    assert (await read_all(bus, subjects))["chat"][0] == signed


def test_replicas_that_fit_nowhere_weigh_the_fleet_once_a_round(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A workload of 64 replicas that fits no node weighs every node once in a round, not
    once a replica (0.25 s a time at 100,000 nodes, the event loop held); each replica
    still says why. A replica that avoids fewer nodes than one that found none is weighed
    anew: here the node the first avoids takes the second."""
    weighed: list[frozenset[str]] = []

    def counted(*args: Any, **kwargs: Any) -> Choice | str:
        weighed.append(frozenset(args[3]))
        return choose(*args, **kwargs)

    monkeypatch.setattr(reconcile, "choose", counted)
    records = {name: node(name) for name in ("n1", "n2", "n3")}
    pending = [Replica(index=i) for i in range(64)]
    stuck = decide(workload(gpus=4, replicas=pending), records, Taken(), 10.0, Timing(), "me")
    assert weighed == [frozenset()]
    whys = {replica.why for replica in stuck.workload.replicas}
    assert len(whys) == 1 and "n1: 2 of 2 GPUs free, 4 needed" in whys.pop()
    weighed.clear()
    only_n1 = {"n1": node("n1"), "n2": node("n2", state="cordoned")}
    picky = [Replica(index=0, avoid=["n1"]), Replica(index=1), Replica(index=2, avoid=["n1"])]
    placed = decide(workload(replicas=picky), only_n1, Taken(), 10.0, Timing(), "me")
    assert [r.node for r in placed.workload.replicas] == ["", "n1", ""]
    assert weighed == [frozenset({"n1"}), frozenset()]
