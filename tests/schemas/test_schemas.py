"""Every wire type round-trips, stays compatible, and its JSON Schema on disk is current."""

from __future__ import annotations

import json
import random
import time

import msgspec
import pytest

from schemas import codec, events, inventory, jsonschema, messages, placement, remediation, settings
from schemas.errors import DecodeError
from schemas.fleet_index import IndexedNode, PartitionIndex
from schemas.pci import PassthroughGpu
from schemas.workloads import Deploy

NOW = time.time()
GPU = events.Gpu(
    index=0,
    uuid="GPU-1",
    name="H100",
    pci_bus_id="00000000:18:00.0",
    memory_total=80,
    memory_used=10,
    temperature_c=50.0,
    xids=[events.XidCount(code=79, count=1, last_at=NOW)],
    health=events.GpuHealth(
        remap=events.RowRemap(correctable=0, uncorrectable=1, pending=True, failed=False),
        clock_reasons=0x8,
        nvlinks=[events.NvLink(link=0, active=False, crc_errors=3)],
        fabric=events.Fabric(state="completed", status=0, health_mask=1),
        persistence_mode=True,
        unread={"nvmlDeviceGetRetiredPages": "Not Supported"},
    ),
)
SAMPLE = events.Sample(
    ts=NOW,
    capacity=events.Capacity(
        cpu_cores=8,
        cpu_percent=12.5,
        load_avg_1m=0.4,
        memory_total=10,
        memory_available=5,
        gpus_total=1,
        gpus_available=1,
        storage_total=100,
        storage_available=50,
        cpu_cores_available=7,
    ),
    gpus=[GPU],
    gpu_source="fake",
    fingerprint="ab" * 32,
    passthrough_gpus=[
        PassthroughGpu(
            pci_bus_id="0000:3c:00.0", device_id="0x2330", name="NVIDIA H100", iommu_group="42"
        )
    ],
)
HEALTH = events.Health(
    ts=NOW,
    status="degraded",
    score=75,
    components=[
        events.HealthComponent(
            name="gpu_temperature", points=15, max_points=20, reason="hottest GPU 75 C"
        )
    ],
    checks=[
        events.HealthCheck(
            name="xid", status="unhealthy", reason="XID 79", action="drain", gpus=[0]
        )
    ],
)
LATENCY = events.Latency(
    ts=NOW,
    peers=[events.PeerLatency(target_node_id="n2", rtt_us=150, loss_pct=0.0, measured_at=NOW)],
    gateway_rtt_us=800,
)
ENGINE = events.Engine(
    ts=NOW,
    engines=[events.EngineStatus(kind="vllm", url="http://x", healthy=True, in_flight=3)],
    in_flight=3,
)
NOTICE = events.Interruption(
    ts=NOW, provider="aws", kind="terminate", deadline=NOW + 120, rehearsal=True
)
HEARTBEAT = messages.Heartbeat(
    node_id="n1",
    cluster="c1",
    seq=7,
    boot_id="b",
    ts=NOW,
    agent_version="0.1.0",
    interval=10,
    stale_after=30,
    schedulability="cordoned",
    sample=SAMPLE,
    health=HEALTH,
    latency=LATENCY,
    engine=ENGINE,
    jobs=events.Jobs(running=3),
    spot=events.SpotStatus(provider="aws", notice=NOTICE),
    capabilities=["llamacpp", "process", "container:vllm"],
)
KEY = "U" + "A" * 55

EXAMPLES: list[msgspec.Struct] = [
    HEARTBEAT,
    SAMPLE,
    HEALTH,
    LATENCY,
    ENGINE,
    NOTICE,
    events.NodeState(ts=NOW, schedulability="draining", reason="spot", until=NOW + 60),
    events.Inject(ts=NOW, node_id="n1", fault="xid", gpu=0, value=79),
    events.Inject(ts=NOW, node_id="n1", fault="spot", value=120),
    events.Workloads(
        ts=NOW,
        workloads=[
            events.Workload(
                name="chat",
                engine="llamacpp",
                state="ready",
                since=NOW,
                port=8080,
                gpus=[0],
                model="/models/x.gguf",
            )
        ],
        capabilities=["llamacpp"],
    ),
    events.WorkloadOrder(
        ts=NOW,
        command_id="c-2",
        action=Deploy(name="chat", engine="llamacpp", gpus=[0, 1], model="/m.gguf", port=0),
        command_digest="ab",
    ),
    events.Gateway(ts=NOW, serving=True, in_flight=2, waiting=1),
    events.Scheduler(
        ts=NOW,
        kind="slurm",
        node_name="gpu7",
        reachable=True,
        slurm_state="mixed+drain",
        state_reason="fleet: spot (c-1)",
        drain=True,
        ours=True,
        jobs=events.SchedulerJobs(running_count=2, pending_count=1, history_reason="no sacct"),
        services=events.SchedulerServices(slurmd_running=True, slurmd_version="22.05.8"),
        cpus_total=64,
        cpus_allocated=24,
    ),
    messages.Command(
        id="c-1",
        node_id="n1",
        cluster="c1",
        action=messages.Drain(deadline=60),
        issued_at=NOW,
        expires_at=NOW + 3600,
        reason="maintenance",
    ),
    messages.CommandResult(command_id="c-1", node_id="n1", cluster="c1", status="done", ts=NOW),
    messages.CommandResult(
        command_id="",
        node_id="n1",
        cluster="c1",
        status="rejected",
        ts=NOW,
        detail="signed by an untrusted key",
        signer=KEY,
        claimed_id="c-2",
        placed=1,
    ),
    messages.Alert(
        id="stale:c1:n1:q7",
        kind="stale",
        node_id="n1",
        cluster="c1",
        severity="warning",
        message="m",
        ts=NOW,
        details={"last_seq": "7"},
    ),
    messages.Registration(node_id="n1", cluster="c1", public_key=KEY, ts=NOW),
    messages.RegistrationReply(node_id="n1", status="pending"),
    messages.Forget(node_id="n1", ts=NOW, reason="dead"),
    messages.ForgetReply(node_id="n1", status="forgotten", revoked=True, purged=True),
    messages.Maintenance(
        action="start",
        id="r12-psu",
        ts=NOW,
        selector={"rack": "r12"},
        cluster="c1",
        nodes=["n9"],
        until=NOW + 7200,
        reason="PSU swap",
    ),
    messages.MaintenanceWindow(
        id="r12-psu", since=NOW, until=NOW + 7200, by="U" + "A" * 55, selector={"rack": "r12"}
    ),
    messages.MaintenanceReply(id="r12-psu", status="started"),
    PartitionIndex(
        partition=3,
        partitions=8,
        holder="aggregator-1",
        written=NOW,
        counts={"c1": {"active": 7, "stale": 1}},
        health={"healthy": 6, "degraded": 1},
        listed={"n9": IndexedNode(cluster="c1", state="stale")},
    ),
    messages.PolicyRequest(action="clear", cluster="c1", ts=NOW, node="n1", since=NOW),
    messages.PolicyReply(status="rejected", reason="the hold changed since"),
    messages.Probe(from_node="n1", nonce="x", sent_at=NOW),
    messages.ProbeReply(node_id="n2", nonce="x", sent_at=NOW, replied_at=NOW),
    messages.NodeRecord(
        node_id="n1", cluster="c1", state="active", last_seq=7, last_seen=NOW, heartbeat=HEARTBEAT
    ),
    messages.TrustEntry(
        node_id="n1",
        public_key=KEY,
        approved_at=NOW,
        identity=messages.NodeIdentity(
            hostname="gpu7",
            gpus=["GPU-1"],
            gpu_product="NVIDIA H100 80GB HBM3",
            gpu_count=2,
            gpu_passthrough=1,
            provider="aws",
            region="us-east-1",
            instance_type="p5.48xlarge",
        ),
    ),
    events.CloudFacts(
        ts=NOW,
        provider="aws",
        region="us-east-1",
        zone="us-east-1a",
        instance_type="p5.48xlarge",
        lifecycle="spot",
    ),
    messages.EnrollClaims(
        id="0" * 32, issuer=KEY, cluster="c1", issued_at=NOW, expires_at=NOW + 60, uses=3
    ),
    messages.EnrollRecord(
        id="0" * 32, issuer=KEY, issued_at=NOW, expires_at=NOW + 60, uses=3, used=1, nodes=["n1"]
    ),
    messages.AggregatorLease(holder="host-1a2b3c4d", ttl=6.0, renewed=NOW),
    remediation.PolicyRecord(
        cluster="c1",
        holds={
            "n1": remediation.Hold(
                reason_class="xid", reason="XID 79", action="cordon", command_id="c", since=NOW
            ),
            "n3": remediation.Hold(
                reason_class="hung",
                reason="no heartbeat for 10m",
                action="cordon",
                command_id="d",
                since=NOW,
                command_digest="ab",
                refused="rejected: signed by an untrusted key",
                needs_attention=True,
                check="xid",
                gpus=[2],
                back_at=NOW,
            ),
        },
        history={"n1": [NOW]},
        tripped_at=NOW,
        would=["cordon n2"],
        limit=2,
        base=20,
        dry={"n4": "cordon: policy: xid: XID 79"},
        skipped={"n5": "in maintenance (window r12)"},
    ),
    placement.PlacedWorkload(
        name="chat",
        deploy=Deploy(name="chat", engine="llamacpp", model="/m.gguf", placed=True),
        gpus=1,
        selector={"pool": "a"},
        replicas=[
            placement.Replica(index=0, node="n1", cluster="c1", gpus=[0], deployed_at=NOW),
            placement.Replica(index=1, why="no node fits: n2: cordoned", avoid=["n3"]),
        ],
        leftovers=[placement.Leftover(node="n3", cluster="c1", index=1, since=NOW, stop_by=NOW)],
        created_at=NOW,
    ),
    settings.SettingsEntry(
        scope="selector",
        revision=7,
        issued_at=NOW,
        values={"heartbeat_interval": "10s", "gpu_thresholds.temperature": "88"},
        selector={"pool": "inference"},
        reason="cooler room",
    ),
    settings.Settings(
        ts=NOW,
        status=settings.SettingsStatus(
            revision=7,
            applied={"heartbeat_interval": "cluster.c1"},
            restart=["shutdown_timeout"],
            refused={"server": "not settable from the fleet (the node's own file sets it)"},
        ),
        live={"heartbeat_interval": 10.0, "peers": ["n2"], "expected_gpus": None, "max_peers": 8},
    ),
    inventory.NodeInventory(
        node_id="n1",
        cluster="c1",
        ts=NOW,
        sample=SAMPLE,
        engine=ENGINE,
        labels={"rack": "r7", "gpu.count": "2"},
        found_labels={"gpu.count": "2"},
    ),
]


def test_examples_cover_every_wire_type() -> None:
    """The round-trip examples include one of each exported wire type."""
    assert {type(example) for example in EXAMPLES} == set(jsonschema.WIRE_TYPES)


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda e: type(e).__name__)
def test_round_trip(example: msgspec.Struct) -> None:
    """encode -> decode gives back an equal message."""
    assert codec.decode(codec.encode(example), type(example)) == example


def test_command_actions_use_stable_tags() -> None:
    """Actions are tagged by explicit strings, never by class names."""
    for action, tag in [
        (messages.Cordon(ttl=5), "cordon"),
        (messages.Drain(), "drain"),
        (messages.Uncordon(), "uncordon"),
        (messages.Deregister(), "deregister"),
    ]:
        assert json.loads(codec.encode(action))["kind"] == tag


def test_unknown_fields_are_ignored_and_bad_values_named() -> None:
    """Newer writers' extra fields pass; a bad value is a DecodeError naming the subject."""
    raw = json.loads(codec.encode(HEARTBEAT))
    raw["field_from_the_future"] = 1
    assert codec.decode(json.dumps(raw).encode(), messages.Heartbeat) == HEARTBEAT
    raw["node_id"] = "bad.node"
    with pytest.raises(DecodeError, match=r"fleet\.hb\.c1\.n1"):
        codec.decode(json.dumps(raw).encode(), messages.Heartbeat, "fleet.hb.c1.n1")
    with pytest.raises(DecodeError):
        codec.decode(b"not json", messages.Heartbeat)


def test_json_schemas_on_disk_are_current() -> None:
    """schemas/json/ matches the Structs; run `python -m schemas.jsonschema` if this fails."""
    on_disk = {path.name: path.read_text() for path in jsonschema.JSON_DIR.glob("*.json")}
    assert on_disk == jsonschema.render()


def test_readme_wire_tables_are_current() -> None:
    """The README's field tables match the Structs; `python -m schemas.jsonschema` fixes."""
    text = jsonschema.README.read_text()
    assert jsonschema.readme_with_tables(text) == text


def test_invalid_utf8_in_a_string_is_a_decode_error() -> None:
    """msgspec raises UnicodeDecodeError (not DecodeError) for invalid UTF-8 inside a JSON
    string; a signed command with one such byte once broke the command handler. Every
    reader catches DecodeError only, so the codec must turn it into one."""
    with pytest.raises(DecodeError, match="Command"):
        codec.decode(b'{"id":"\x80","node_id":"n1"}', messages.Command, "fleet.cmd.c1.n1")


def _nesting(info: msgspec.inspect.Type) -> int:
    """The deepest nesting of arrays and objects a value of this type can have."""
    inspect = msgspec.inspect
    if isinstance(info, inspect.StructType):
        return 1 + max((_nesting(field.type) for field in info.fields), default=0)
    if isinstance(info, inspect.ListType | inspect.SetType | inspect.VarTupleType):
        return 1 + _nesting(info.item_type)
    if isinstance(info, inspect.TupleType):
        return 1 + max((_nesting(item) for item in info.item_types), default=0)
    if isinstance(info, inspect.DictType):
        return 1 + _nesting(info.value_type)
    if isinstance(info, inspect.UnionType):
        return max(_nesting(member) for member in info.types)
    if isinstance(info, inspect.Metadata):
        return _nesting(info.type)
    assert not isinstance(info, inspect.AnyType | inspect.RawType), "unbounded nesting"
    return 0


@pytest.mark.parametrize("wire_type", jsonschema.WIRE_TYPES, ids=lambda t: t.__name__)
def test_every_wire_type_nests_well_within_the_bound(wire_type: type[msgspec.Struct]) -> None:
    """No wire type can nest deeper than a quarter of codec.MAX_DEPTH (no Any, no
    recursion), so the bound refuses only what no honest writer sends."""
    assert _nesting(msgspec.inspect.type_info(wire_type)) <= codec.MAX_DEPTH // 4


def _with_field(message: msgspec.Struct, name: str, raw: bytes) -> bytes:
    """``message`` encoded with one more field, ``name``, whose JSON is ``raw``."""
    return codec.encode(message)[:-1] + b',"' + name.encode() + b'":' + raw + b"}"


@pytest.mark.parametrize("depth", [codec.MAX_DEPTH, 1_000, 100_000])
@pytest.mark.parametrize("opening", ["[", '{"a":'])
def test_deep_nesting_is_a_decode_error_at_any_depth(depth: int, opening: str) -> None:
    """A heartbeat with an unknown field nested past MAX_DEPTH (an issue-30 attack: 1,000
    levels made msgspec raise RecursionError, which broke every aggregator) is a
    DecodeError, as deep as Python's recursion limit or far deeper; the top level counts
    as one, so an unknown field may nest MAX_DEPTH - 1 levels."""
    closing = "]" if opening == "[" else "}"
    for levels, refused in ((depth - 1, depth > codec.MAX_DEPTH), (depth, True)):
        deep = (opening * levels + "1" + closing * levels).encode()
        body = _with_field(HEARTBEAT, "unknown", deep)
        if refused:
            with pytest.raises(DecodeError, match="nested deeper than"):
                codec.decode(body, messages.Heartbeat, "fleet.hb.c1.n1")
        else:
            assert codec.decode(body, messages.Heartbeat) == HEARTBEAT


def test_brackets_inside_strings_neither_hide_nor_fake_depth() -> None:
    """Strings holding brackets, quotes and escapes do not count as nesting, and cannot
    cancel out real nesting: forty levels, each with a string that holds the closing
    bracket of a level, are still forty."""
    honest = msgspec.structs.replace(
        HEARTBEAT, boot_id='[[[[{{{{"\\' * 8, agent_version="]]]]}}}}" * 8
    )
    assert codec.decode(codec.encode(honest), messages.Heartbeat) == honest
    hiding = b'["]",' * 40 + b'"["' + b"]" * 40
    with pytest.raises(DecodeError, match="nested deeper than"):
        codec.decode(_with_field(HEARTBEAT, "x", hiding), messages.Heartbeat)
    escaped = b'["\\"]",' * 40 + b'"\\"["' + b"]" * 40
    with pytest.raises(DecodeError, match="nested deeper than"):
        codec.decode(_with_field(HEARTBEAT, "x", escaped), messages.Heartbeat)


def test_within_depth_agrees_with_a_parser() -> None:
    """codec.within_depth measures what json.loads builds, on random documents with
    brackets, quotes and backslashes inside their strings and keys."""
    rng = random.Random(30)

    def value(levels: int) -> object:
        if levels == 0 or rng.random() < 0.2:
            return rng.choice([1, None, "", "a]", "[{", 'x\\"]', '"', "}"])
        if rng.random() < 0.5:
            return [value(levels - 1) for _ in range(rng.randint(0, 3))]
        return {rng.choice(["k", "]", "{[", "\\"]) + str(i): value(levels - 1) for i in range(3)}

    def nesting(item: object) -> int:
        if isinstance(item, list):
            return 1 + max(map(nesting, item), default=0)
        if isinstance(item, dict):
            return 1 + max(map(nesting, item.values()), default=0)
        return 0

    for _ in range(2000):
        document = value(rng.randint(0, 10))
        data = json.dumps(document).encode()
        for limit in (0, 1, 3, 6):
            assert codec.within_depth(data, limit) == (nesting(document) <= limit), data
