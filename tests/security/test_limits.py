"""Issue 8, items 5, 6 and 9, from the attacker's side: a big, malformed or endless message
must not crash the aggregator, fill the store failure detection needs, or bury the alerts.

Attacker traffic goes through plain nats-py clients, as a node's credentials would allow.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import os
import sys
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path

import msgspec
import nats
import nats.errors
import nats.js.errors
import pytest
from nats.aio.msg import Msg
from nats.js.api import DiscardPolicy, KeyValueConfig

from actors.fleet.config import MIB
from actors.fleet.metrics import AggregatorMetrics
from actors.fleet.storage.records import read_record
from actors.fleet.storage.registry import approve
from actors.fleet.storage.streams import (
    MAX_ALERT_SIZE,
    MAX_HEARTBEAT_SIZE,
    MAX_RECORD_SIZE,
    MAX_RESULT_SIZE,
    StreamLimits,
    provision,
)
from actors.node.config import AgentConfig
from actors.node.gpu.xid import in_code_order
from actors.node.inventory.actor import InventoryActor
from actors.node.inventory.fake_gpus import FakeGpus
from actors.runtime.bus import NatsBus
from actors.runtime.embedded import NatsServer
from schemas import codec, signing
from schemas.base import (
    MAX_CHECKS,
    MAX_COMPONENTS,
    MAX_DEPENDENCIES,
    MAX_DETAILS,
    MAX_ENGINES,
    MAX_GPUS,
    MAX_HOSTNAME,
    MAX_ID,
    MAX_LABEL_KEY,
    MAX_LABEL_VALUE,
    MAX_LABELS,
    MAX_MODELS,
    MAX_NAME,
    MAX_PEERS,
    MAX_TEXT,
    MAX_URL,
    MAX_XIDS,
)
from schemas.errors import DecodeError
from schemas.events import (
    Capacity,
    Dependency,
    Engine,
    EngineStatus,
    Gpu,
    Health,
    HealthCheck,
    HealthComponent,
    HostFacts,
    Interruption,
    Jobs,
    Latency,
    PeerLatency,
    Sample,
    Scheduler,
    SchedulerJobs,
    SchedulerServices,
    SpotStatus,
    XidCount,
)
from schemas.messages import (
    MAX_HEARTBEAT_WORKLOADS,
    Alert,
    Heartbeat,
    NodeRecord,
    WorkloadSummary,
)
from schemas.subjects import (
    BUCKET_NODES,
    STREAM_ALERTS,
    STREAM_COMMANDS,
    STREAM_EVENTS,
    STREAM_HEARTBEATS,
    Subjects,
)
from tests.support.fleet import TEST_LIMITS, Fleet, new_aggregator, wait_for, wait_record

MAX_PAYLOAD = 1024 * 1024
"""nats-server's default max_payload."""
FLEETCTL = str(Path(sys.executable).parent / "fleetctl")

UNREADABLE = "fleet_records_unreadable_total"
REFUSED = "fleet_heartbeats_refused_total"
BIG = 2**64 - 1
LONG_TIME = 1e18 + 0.123456789
LONG_DURATION = 1.2345678901234567e-05
"""A duration (at most a day) whose JSON is as long as a float's gets."""
LONG_FLOAT = -1.2345678901234567e308
LONG_PERCENT = 99.12345678901234


def escaped(length: int) -> str:
    """The longest JSON a string of ``length`` characters can take: a control character is
    written as six bytes (\\u0000)."""
    return "\x00" * length


LABELS = {f"{i:02d}".ljust(MAX_LABEL_KEY, "k"): "v" * MAX_LABEL_VALUE for i in range(MAX_LABELS)}
"""The most label bytes a heartbeat or record can carry (their patterns admit no escapes)."""


def maximal_heartbeat() -> Heartbeat:
    """Every list at its bound, every string at its bound in its costliest characters,
    every number at its longest."""
    xid = XidCount(code=BIG, count=BIG, last_at=LONG_TIME)
    gpu = Gpu(
        index=BIG,
        uuid=escaped(MAX_NAME),
        name=escaped(MAX_NAME),
        pci_bus_id=escaped(MAX_NAME),
        memory_total=BIG,
        memory_used=BIG,
        temperature_c=LONG_FLOAT,
        power_w=LONG_FLOAT,
        power_limit_w=LONG_FLOAT,
        utilization_pct=LONG_PERCENT,
        ecc_corrected=BIG,
        ecc_uncorrected=BIG,
        xids=[xid] * MAX_XIDS,
        lost=True,
    )
    capacity = Capacity(
        cpu_cores=BIG,
        cpu_percent=LONG_PERCENT,
        load_avg_1m=LONG_FLOAT,
        memory_total=BIG,
        memory_available=BIG,
        gpus_total=BIG,
        gpus_available=BIG,
        storage_total=BIG,
        storage_available=BIG,
    )
    component = HealthComponent(
        name=escaped(MAX_NAME), points=BIG, max_points=BIG, reason=escaped(MAX_TEXT)
    )
    check = HealthCheck(
        name=escaped(MAX_NAME),
        status="unhealthy",
        reason=escaped(MAX_TEXT),
        action=escaped(MAX_TEXT),
    )
    peer = PeerLatency(
        target_node_id="p" * 64, rtt_us=BIG, loss_pct=LONG_PERCENT, measured_at=LONG_TIME
    )
    engine = EngineStatus(
        kind="llamacpp",
        url=escaped(MAX_URL),
        healthy=True,
        in_flight=BIG,
        waiting=BIG,
        reason=escaped(MAX_TEXT),
        checked_at=LONG_TIME,
        models=[escaped(MAX_NAME)] * MAX_MODELS,
    )
    notice = Interruption(
        ts=LONG_TIME,
        provider="azure",
        kind="maintenance",
        deadline=LONG_TIME,
        event_id=escaped(MAX_NAME),
        detail=escaped(MAX_TEXT),
    )
    return Heartbeat(
        node_id="n" * 64,
        cluster="c" * 64,
        seq=2**63 - 1,
        boot_id=escaped(MAX_NAME),
        ts=LONG_TIME,
        agent_version=escaped(MAX_NAME),
        interval=LONG_DURATION,
        stale_after=LONG_DURATION,
        schedulability="schedulable",
        sample=Sample(
            ts=LONG_TIME,
            capacity=capacity,
            gpus=[gpu] * MAX_GPUS,
            gpu_source="nvml",
            fingerprint=escaped(MAX_NAME),
            hostname=escaped(MAX_HOSTNAME),
            gpu_error=escaped(MAX_TEXT),
            host=HostFacts(
                uptime_s=LONG_TIME,
                memory_used_pct=LONG_PERCENT,
                cpu_model=escaped(MAX_NAME),
                gpu_utilization_pct=LONG_PERCENT,
                storage_path=escaped(MAX_TEXT),
                storage_used_pct=LONG_PERCENT,
                dependencies=[Dependency(name=escaped(MAX_NAME), version=escaped(MAX_NAME))]
                * MAX_DEPENDENCIES,
            ),
        ),
        health=Health(
            ts=LONG_TIME,
            status="unhealthy",
            score=BIG,
            components=[component] * MAX_COMPONENTS,
            checks=[check] * MAX_CHECKS,
        ),
        latency=Latency(
            ts=LONG_TIME,
            peers=[peer] * MAX_PEERS,
            gateway_rtt_us=BIG,
            avg_peer_rtt_us=BIG,
            loss_pct=LONG_PERCENT,
        ),
        engine=Engine(ts=LONG_TIME, engines=[engine] * MAX_ENGINES, in_flight=BIG),
        jobs=Jobs(running=BIG, waiting=BIG),
        spot=SpotStatus(provider="azure", notice=notice),
        schedulability_reason=escaped(MAX_TEXT),
        deregistering=True,
        workloads=[
            WorkloadSummary(
                name=escaped(MAX_NAME),
                engine="llamacpp",
                state="crashloop",
                since=LONG_TIME,
                port=65535,
                gpus=[MAX_GPUS - 1] * MAX_GPUS,
                model=escaped(MAX_NAME),
                restarts=BIG,
                reason=escaped(MAX_NAME),
            )
        ]
        * MAX_HEARTBEAT_WORKLOADS,
        labels=LABELS,
        scheduler=Scheduler(
            ts=LONG_TIME,
            kind="slurm",
            node_name=escaped(MAX_NAME),
            reachable=True,
            reason=escaped(MAX_TEXT),
            slurm_state=escaped(MAX_NAME),
            state_reason=escaped(MAX_TEXT),
            drain=True,
            ours=True,
            jobs=SchedulerJobs(
                running_count=BIG,
                pending_count=BIG,
                completed_24h=BIG,
                failed_24h=BIG,
                history_reason=escaped(MAX_TEXT),
            ),
            services=SchedulerServices(
                slurmd_running=True,
                slurmd_version=escaped(MAX_NAME),
                munge_running=True,
                munge_version=escaped(MAX_NAME),
                container_runtime=escaped(MAX_NAME),
                container_runtime_version=escaped(MAX_NAME),
            ),
        ),
    )


def maximal_record(heartbeat: Heartbeat) -> NodeRecord:
    return NodeRecord(
        node_id=heartbeat.node_id,
        cluster=heartbeat.cluster,
        state=escaped(32),
        last_seq=BIG,
        last_seen=LONG_TIME,
        boot_id=escaped(MAX_NAME),
        public_key=escaped(MAX_NAME),
        schedulability=escaped(32),
        health_status=escaped(32),
        health_score=BIG,
        gpus_total=BIG,
        stale_since=LONG_TIME,
        deregistered=True,
        agent_version=escaped(MAX_NAME),
        heartbeat=heartbeat,
        offline_since=LONG_TIME,
        last_stream_seq=BIG,
        labels=LABELS,
        deregistered_by=escaped(MAX_NAME),
        deregistered_reason=escaped(MAX_TEXT),
        deregistered_at=LONG_TIME,
        refused=escaped(MAX_NAME),
        refused_at=LONG_TIME,
        gpu_fingerprint=[escaped(MAX_NAME)] * MAX_GPUS,
    )


def test_any_stored_heartbeat_fits_its_record_under_every_limit() -> None:
    """The bounds allow a heartbeat larger than FLEET_HB stores (the server refuses it: see
    the oversized test); any heartbeat the stream does store fits, with the largest fields
    a record adds, in fleet_nodes' max_value_size, itself under the server's max_payload."""
    heartbeat = maximal_heartbeat()
    body = codec.encode(heartbeat)
    record = codec.encode(maximal_record(heartbeat))
    assert codec.decode(body, Heartbeat) == heartbeat  # within every bound
    assert codec.decode(record, NodeRecord).heartbeat == heartbeat
    assert len(body) > MAX_HEARTBEAT_SIZE  # so the byte limit is what binds
    record_fields = len(record) - len(body)  # a record embeds the heartbeat's bytes as they are
    assert record_fields < 80 * 1024
    assert MAX_HEARTBEAT_SIZE + record_fields <= 0.9 * MAX_RECORD_SIZE
    assert MAX_RECORD_SIZE <= 0.8 * MAX_PAYLOAD
    alert = Alert(
        id=escaped(MAX_ID),
        kind="bad_signature",
        node_id="n" * 64,
        cluster="c" * 64,
        severity="critical",
        message=escaped(MAX_TEXT),
        ts=LONG_TIME,
        details={escaped(MAX_NAME - i): escaped(MAX_TEXT) for i in range(MAX_DETAILS)},
    )
    assert len(codec.encode(alert)) <= 0.9 * MAX_ALERT_SIZE


@pytest.mark.parametrize(
    "changes",
    [
        {"gpus": MAX_GPUS + 1},
        {"reason": 2048},
        {"peers": MAX_PEERS + 1},
        {"boot_id": MAX_NAME + 1},
    ],
    ids=["65 GPUs", "2 KB reason", "257 peers", "long boot id"],
)
def test_a_heartbeat_over_a_bound_is_refused_at_decode(changes: dict[str, int]) -> None:
    gpu = Gpu(index=0, uuid="GPU-0", name="H100", pci_bus_id="0:1", memory_total=1, memory_used=0)
    capacity = Capacity(
        cpu_cores=1,
        cpu_percent=0,
        load_avg_1m=0,
        memory_total=1,
        memory_available=1,
        gpus_total=1,
        gpus_available=1,
        storage_total=1,
        storage_available=1,
    )
    peer = PeerLatency(target_node_id="p1", rtt_us=1, loss_pct=0, measured_at=1.0)
    heartbeat = Heartbeat(
        node_id="n1",
        cluster="c1",
        seq=1,
        boot_id="b" * changes.get("boot_id", 1),
        ts=1.0,
        agent_version="test",
        interval=1.0,
        stale_after=3.0,
        sample=Sample(ts=1.0, capacity=capacity, gpus=[gpu] * changes.get("gpus", 1)),
        latency=Latency(ts=1.0, peers=[peer] * changes.get("peers", 1)),
        schedulability_reason="r" * changes.get("reason", 1),
    )
    with pytest.raises(DecodeError):
        codec.decode(codec.encode(heartbeat), Heartbeat)


def test_the_agent_reports_at_most_max_gpus(tmp_path: Path) -> None:
    """A node with more GPUs than a heartbeat may carry reports the first MAX_GPUS, rather
    than sending heartbeats every aggregator refuses."""
    config = AgentConfig(node_id="n1", cluster="c1", state_dir=str(tmp_path))
    # sample() uses neither the bus nor the events
    actor = InventoryActor(config, None, None, FakeGpus(MAX_GPUS + 6, "n1"))  # type: ignore[arg-type]
    sample = actor.sample()
    assert len(sample.gpus) == MAX_GPUS
    codec.decode(codec.encode(sample), Sample)


async def test_every_stream_and_bucket_is_bounded(bus: NatsBus, prefix: str) -> None:
    subjects = Subjects(prefix)
    for stream in (STREAM_HEARTBEATS, STREAM_COMMANDS, STREAM_EVENTS, STREAM_ALERTS):
        config = (await bus.js.stream_info(subjects.stream_name(stream))).config
        assert config.max_bytes and config.max_bytes > 0, stream
        assert config.max_msgs and config.max_msgs > 0, stream
        assert config.max_msg_size and config.max_msg_size > 0, stream
    for stream in (STREAM_EVENTS, STREAM_ALERTS):
        config = (await bus.js.stream_info(subjects.stream_name(stream))).config
        assert config.max_msgs_per_subject and config.max_msgs_per_subject > 1, stream
        assert config.discard == DiscardPolicy.OLD
    heartbeats = (await bus.js.stream_info(subjects.stream_name(STREAM_HEARTBEATS))).config
    assert heartbeats.discard == DiscardPolicy.NEW and heartbeats.max_msgs_per_subject == 1
    records = (await bus.js.stream_info(f"KV_{subjects.bucket_name(BUCKET_NODES)}")).config
    assert records.max_bytes and records.max_bytes > 0
    assert records.max_msg_size == MAX_RECORD_SIZE


async def test_an_oversized_message_is_refused_by_the_server(
    nats_server: NatsServer, bus: NatsBus, prefix: str
) -> None:
    subjects = Subjects(prefix)
    attacker = await nats.connect(nats_server.url)
    try:
        js = attacker.jetstream()
        with pytest.raises(nats.js.errors.APIError, match="maximum"):
            await js.publish(subjects.heartbeat("c1", "n1"), b"x" * (MAX_HEARTBEAT_SIZE + 1))
        with pytest.raises(nats.js.errors.APIError, match="maximum"):
            await js.publish(subjects.result("c1", "n1"), b"x" * (MAX_RESULT_SIZE + 1))
    finally:
        await attacker.close()


async def test_an_unreadable_record_is_skipped_and_counted(
    fleet: Fleet, nats_server: NatsServer, bus: NatsBus, prefix: str
) -> None:
    """Garbage under one key and a record a node beats into but cannot be read: the
    aggregator neither restarts nor overwrites them, counts them, and the rest of the
    fleet is still listed by ``fleetctl nodes``."""
    nodes = await bus.kv(Subjects(prefix).bucket_name(BUCKET_NODES))
    await nodes.put("garbage", b"\xff not a record")
    metrics = AggregatorMetrics()
    # The record a node beats into is met again at each checkpoint: often, here.
    aggregator = new_aggregator(
        bus, prefix, metrics, sweep_interval=0.1, full_sweep_interval=0.1, checkpoint_interval=0.5
    )
    supervisor = await fleet.start_supervisor(aggregator)
    await fleet.start_agent()
    await fleet.start_agent(fleet.config("n2"))
    await wait_record(bus, prefix, "n1", lambda r: r.state == "active")
    await nodes.put("n2", b'{"node_id": "n2", "state": 7}')
    await wait_for(lambda: (metrics.registry.get_sample_value(UNREADABLE) or 0) >= 4)
    assert supervisor.status[aggregator.name].restarts == 0
    assert (await nodes.get("n2")).value == b'{"node_id": "n2", "state": 7}'
    process = await asyncio.create_subprocess_exec(
        FLEETCTL,
        "nodes",
        "--json",
        "--server",
        nats_server.url,
        "--prefix",
        prefix,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, _ = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode == 0
    listed = msgspec.json.decode(out, type=list[NodeRecord])
    assert [record.node_id for record in listed] == ["n1"]


async def test_a_state_a_newer_version_adds_is_read(bus: NatsBus, prefix: str) -> None:
    """Rolling upgrade: a newer aggregator's record with a state, schedulability and health
    status this version does not know is read as it is."""
    nodes = await bus.kv(Subjects(prefix).bucket_name(BUCKET_NODES))
    await nodes.put(
        "n1",
        b'{"node_id": "n1", "cluster": "c1", "state": "quarantined", "last_seq": 3, '
        b'"last_seen": 1.0, "schedulability": "paused", "health_status": "suspect", '
        b'"new_field": [1, 2]}',
    )
    record = await read_record(bus, Subjects(prefix), "n1")
    assert (record.state, record.schedulability, record.health_status) == (
        "quarantined",
        "paused",
        "suspect",
    )


SMALL = StreamLimits(
    heartbeats_max_bytes=4 * MIB,
    records_max_bytes=4 * MIB,
    commands_max_bytes=2 * MIB,
    results_max_bytes=4 * MIB,
    alerts_max_bytes=4 * MIB,
    trust_max_bytes=1 * MIB,
    results_per_node=1000,
    alerts_per_subject=1000,
)
STORE = 56 * MIB
"""Above what the server reserves for SMALL (SMALL.total, 27 MiB, plus the leases' 1 MiB,
the maintenance windows' 16 MiB and the state index's 8 MiB), below the 60 MB (57.2 MiB)
the flood writes."""


@pytest.fixture
async def small_fleet(tmp_path: Path, prefix: str) -> AsyncIterator[Fleet]:
    """A fleet on a server of its own whose whole JetStream store is STORE bytes."""
    config = tmp_path / "server.conf"
    config.write_text(
        "listen: 127.0.0.1:-1\n"
        f'jetstream {{ store_dir: "{tmp_path / "js"}", max_file_store: {STORE} }}\n'
    )
    server = NatsServer(tmp_path, config_file=config).start()
    try:
        bus = await NatsBus.connect(server.url, "test")
        try:
            await provision(bus.js, Subjects(prefix), limits=SMALL)
            async with AsyncExitStack() as stack:
                yield Fleet(server.url, bus, prefix, tmp_path / "state", stack)
        finally:
            await bus.close()
    finally:
        server.stop()


async def test_a_result_flood_cannot_stop_failure_detection(
    small_fleet: Fleet, prefix: str
) -> None:
    """A node writes 60 MB of results as fast as it can into a 56 MiB store. The results
    stream keeps its budget (dropping the flooder's oldest), heartbeats keep being
    accepted, and when the node dies its TTL marker still makes it stale."""
    fleet = small_fleet
    await fleet.start_aggregator(**dataclasses.asdict(SMALL))
    agent = await fleet.start_agent()
    await wait_record(fleet.bus, prefix, "n1", lambda r: r.state == "active")

    attacker = await nats.connect(fleet.url)
    js = attacker.jetstream()
    body = os.urandom(60_000)
    subject = Subjects(prefix).result("c1", "n1")
    started = time.monotonic()
    refused = 0
    for _ in range(25):
        acks = await asyncio.gather(
            *(js.publish(subject, body) for _ in range(40)), return_exceptions=True
        )
        refused += sum(isinstance(ack, BaseException) for ack in acks)
    flood_seconds = time.monotonic() - started
    await attacker.close()
    assert refused == 0  # DiscardPolicy.OLD: the flooder only evicts its own results
    events = await fleet.bus.js.stream_info(Subjects(prefix).stream_name(STREAM_EVENTS))
    assert events.state.bytes <= SMALL.results_max_bytes

    after_flood = (await read_record(fleet.bus, Subjects(prefix), "n1")).last_seq
    await wait_record(fleet.bus, prefix, "n1", lambda r: r.last_seq >= after_flood + 2)
    await agent.stop(goodbye=False)  # a crash: stale
    stale = await wait_record(fleet.bus, prefix, "n1", lambda r: r.state == "stale")
    assert stale.stale_since is not None
    print(f"flood of 60 MB in {flood_seconds:.2f}s")


async def test_a_refusal_flood_makes_a_bounded_number_of_alerts(
    fleet: Fleet, nats_server: NatsServer, bus: NatsBus, prefix: str
) -> None:
    """300 unsigned heartbeats a second for two seconds: every one the aggregator reads is
    refused (FLEET_HB keeps one per node, and a caught-up aggregator takes what is there
    once per ``fetch_linger``, 0.02 s here: a hundred at most), but the node gets one alert,
    then at most one summary per window, counting the ones held back."""
    window = 1.0
    subjects = Subjects(prefix)
    key = signing.KeyPair.generate()
    await approve(bus, subjects, "n1", key.public_key)
    metrics = AggregatorMetrics()
    await fleet.start_supervisor(
        new_aggregator(
            bus, prefix, metrics, alert_window=window, alert_repeat=window, sweep_interval=0.1
        )
    )
    by_id: dict[str, Alert] = {}

    async def on_alert(msg: Msg) -> None:
        # By its Nats-Msg-Id, as the alert stream keeps it: an alert whose publish was not
        # acknowledged (a loaded server) is published again with the same id.
        by_id[(msg.headers or {})["Nats-Msg-Id"]] = codec.decode(msg.data, Alert, msg.subject)

    await bus.subscribe(subjects.alerts(), on_alert)
    await bus.flush()

    attacker = await nats.connect(nats_server.url)
    js = attacker.jetstream()
    body = b'{"node_id": "n1"}'
    started = time.monotonic()
    for sent in range(600):
        await js.publish(
            subjects.heartbeat("c1", "n1"), body, headers={"Nats-Msg-Id": os.urandom(8).hex()}
        )
        await asyncio.sleep(max(0.0, started + (sent + 1) / 300 - time.monotonic()))
    publishing = time.monotonic() - started
    await attacker.close()

    def refused() -> float:
        return metrics.registry.get_sample_value(REFUSED, {"kind": "bad_signature"}) or 0

    def accounted() -> float:
        first = sum(1 for alert in by_id.values() if "suppressed" not in alert.details)
        held = sum(int(alert.details.get("suppressed", "0")) for alert in by_id.values())
        return first + held

    try:
        await wait_for(lambda: refused() > 0 and accounted() == refused())
    except AssertionError:
        raise AssertionError(f"{refused()} refused, {accounted()} in the alerts") from None
    alerts = list(by_id.values())
    assert {alert.kind for alert in alerts} == {"bad_signature"}
    # The first alert, then a summary per window the refusals spanned at most: those of the
    # flood's time (two or three on an idle machine), and two more for the last heartbeat's
    # way to a busy aggregator. Refusals taken: a hundred at most, far fewer when loaded.
    windows = math.ceil(publishing / window) + 2
    assert len(alerts) <= 1 + windows, (len(alerts), publishing)
    assert refused() >= 10
    print(f"{refused():.0f} refusals, {len(alerts)} alerts in {publishing:.2f}s")


def test_the_agent_reports_the_most_recent_xid_codes() -> None:
    codes = {code: XidCount(code=code, count=1, last_at=float(code % 7)) for code in range(40)}
    kept = in_code_order(codes)
    assert len(kept) == MAX_XIDS
    assert [xid.code for xid in kept] == sorted(xid.code for xid in kept)
    assert min(xid.last_at for xid in kept) >= max(
        xid.last_at for xid in codes.values() if xid not in kept
    )


async def test_provision_brings_an_older_bucket_to_direct_gets_and_its_budget(
    bus: NatsBus, prefix: str
) -> None:
    """A bucket created by an older version (no direct gets, no budget) is updated, so
    peer discovery works under auth.conf and a full bucket cannot starve the store."""
    subjects = Subjects(f"{prefix}old")
    name = subjects.bucket_name(BUCKET_NODES)
    await bus.js.create_key_value(KeyValueConfig(bucket=name, history=1))
    assert not (await bus.js.stream_info(f"KV_{name}")).config.allow_direct
    await provision(bus.js, subjects, limits=TEST_LIMITS)
    config = (await bus.js.stream_info(f"KV_{name}")).config
    assert config.allow_direct
    assert config.max_bytes == TEST_LIMITS.records_max_bytes
    assert config.max_msg_size == MAX_RECORD_SIZE
