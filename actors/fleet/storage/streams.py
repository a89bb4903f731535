"""Idempotent provisioning of the JetStream streams and KV buckets of the wire contract.

Safe to run from every process at start-up: a stream that exists is updated to the
settings below (failure detection needs ``allow_msg_ttl`` and delete markers), a bucket
that exists is left alone.

Nodes' heartbeats are stored first in ``FLEET_HB_IN``, which refuses ``Nats-Rollup``
headers, and ``FLEET_HB`` sources them from there (partitioned by the source's subject
transform). A stream with TTL delete markers cannot refuse rollups (nats-server turns
``allow_rollup_hdrs`` on for it), and one node's ``Nats-Rollup: all`` there purged every
node's heartbeat and pending TTL marker; in ``FLEET_HB_IN`` the server refuses it to the
publisher, and ``FLEET_HB`` has no subject anyone can publish to.

Every stream and bucket is bounded three ways: a byte budget (``max_bytes``, which the
server reserves for it), a message count and a message size. Because every budget is
reserved, a flood on one stream fills only that stream's budget: the store failure
detection needs (``FLEET_HB`` and its delete markers) can never be taken by results or
alerts. ``FLEET_HB`` discards *new* subjects when full (a node that was beating keeps
beating, since its message replaces its last one); results and alerts discard their own
oldest messages, capped per subject, so a flooding node evicts only its own.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import (
    DiscardPolicy,
    KeyValueConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
    StreamSource,
    SubjectTransform,
)

from actors.fleet.config import AggregatorConfig
from schemas.subjects import (
    BUCKET_ENROLL,
    BUCKET_INDEX,
    BUCKET_LEASES,
    BUCKET_MAINTENANCE,
    BUCKET_NODES,
    BUCKET_SETTINGS,
    BUCKET_TRUST,
    BUCKET_WORKLOADS,
    STREAM_ALERTS,
    STREAM_COMMANDS,
    STREAM_EVENTS,
    STREAM_HEARTBEAT_INTAKE,
    STREAM_HEARTBEATS,
    Subjects,
)

log = logging.getLogger(__name__)

DAY = 24 * 3600.0
SUBJECTS_OVERLAP = 10065
"""JetStream's error code for a stream whose subjects another stream takes already."""
DUPLICATE_WINDOW = 300.0
"""Five minutes: replays inside it are dropped by the server itself (Nats-Msg-Id)."""
MARKER_TTL = 3600.0
"""How long a delete marker stays, so an aggregator down for an hour still sees it."""
HEARTBEATS_PER_NODE = 1
"""Only the latest heartbeat per node is kept. This is also what lets a heartbeat's short
Nats-TTL stand beside the hour-long marker TTL: with more messages per subject the server
raises every per-message TTL to the marker TTL (nats-server PRs 6741 and 6818)."""


KIB = 1024
MAX_HEARTBEAT_SIZE = 512 * KIB
"""FLEET_HB's ``max_msg_size``: the server refuses a larger heartbeat and its sender gets
the error. An honest heartbeat is a few KB (64 GPUs with every field about 60 KB); the
bounds of :mod:`schemas.base` allow a larger one (every character of every string
JSON-escaped to six bytes), so this size, not the structure, is what a heartbeat may
weigh, and what a record must make room for."""
MAX_RECORD_SIZE = 768 * KIB
"""``fleet_nodes``' ``max_value_size``: a record embeds one heartbeat (at most
MAX_HEARTBEAT_SIZE) plus its own fields (about 70 KB at most), and stays below the
server's 1 MiB ``max_payload``."""
MAX_COMMAND_SIZE = 64 * KIB
MAX_RESULT_SIZE = 64 * KIB
MAX_ALERT_SIZE = 128 * KIB
MAX_TRUST_SIZE = 16 * KIB
MAX_ENROLL_SIZE = 8 * KIB
ENROLL_KEEP = 31 * DAY
"""An enrollment record lives this long after its last change; tokens live at most 30 days
(``fleetctl enroll-token create --ttl``), so a record outlives its token."""
MAINTENANCE_KEEP = 31 * DAY
"""A maintenance window is kept this long after it was written; windows last at most 30
days (:data:`actors.fleet.storage.windows.MAX_WINDOW`)."""
MAX_MAINTENANCE_SIZE = 64 * KIB
"""A window naming its 1,000 nodes fits."""
MAX_PLACED_SIZE = 256 * KIB
"""A placed workload's record: 64 replicas with their reasons, avoided nodes and copies to
stop fit (about 200 KiB at most with 64-character node names)."""
MAX_SETTINGS_SIZE = 64 * KIB
"""One scope's settings entry (64 values of a few hundred characters fit many times)."""
SETTINGS_HISTORY = 16
"""Revisions kept per settings key: what ``fleetctl settings history`` shows and
``rollback`` goes back to."""
SETTINGS_MAX_BYTES = 4 * 1024 * KIB
"""fleet_settings' budget: hundreds of scopes with their history at a few KB each."""
MIB_LEASES = 1024 * KIB
"""fleet_leases holds one small value per partition; not one of the configurable budgets."""
INDEX_VALUE_SIZE = 512 * KIB
"""One partition's state index: MAX_LISTED nodes of up to about 128 bytes each fit."""


def index_max_bytes(partitions: int) -> int:
    """fleet_index's budget: one value per partition, twice over (a value and its
    replacement); not a configurable budget. The server reserves it whole, so it follows
    the partitions (8 MiB at the default 8) rather than the most there can be."""
    return 2 * partitions * INDEX_VALUE_SIZE


MAX_NODES = 100_000
"""Messages in FLEET_HB (one per node) and values in the buckets (one per node)."""
MAX_STREAM_MSGS = 1_000_000
COMMAND_CONSUMERS = 2 * MAX_NODES
"""Consumers FLEET_CMD takes: one per node (its command queue), with room for readers.
Set on the stream because nats-server 2.15 gives every stream that sets none (or -1) a
limit of 1,000: past that many nodes, a node's consumer was refused ("maximum consumers
limit reached") and its commands had nobody to read them."""


@dataclass(frozen=True)
class StreamLimits:
    """The byte budgets and per-subject caps an aggregator's config sets; the defaults are
    :class:`AggregatorConfig`'s."""

    heartbeats_max_bytes: int
    records_max_bytes: int
    commands_max_bytes: int
    results_max_bytes: int
    alerts_max_bytes: int
    trust_max_bytes: int
    results_per_node: int
    alerts_per_subject: int
    enroll_max_bytes: int = 4 * 1024 * 1024
    partitions: int = 8
    """N of FLEET_HB's partition transform; used only when the stream is created (or
    given its first transform): see :func:`provision`."""

    @classmethod
    def of(cls, config: AggregatorConfig) -> StreamLimits:
        return cls(
            heartbeats_max_bytes=config.heartbeats_max_bytes,
            records_max_bytes=config.records_max_bytes,
            commands_max_bytes=config.commands_max_bytes,
            results_max_bytes=config.results_max_bytes,
            alerts_max_bytes=config.alerts_max_bytes,
            trust_max_bytes=config.trust_max_bytes,
            results_per_node=config.results_per_node,
            alerts_per_subject=config.alerts_per_subject,
            enroll_max_bytes=config.enroll_max_bytes,
            partitions=config.partitions,
        )

    @property
    def total(self) -> int:
        """Bytes the server reserves for one prefix: its max_file_store must exceed it.
        Heartbeats count twice: FLEET_HB_IN and FLEET_HB each have the budget."""
        return (
            2 * self.heartbeats_max_bytes
            + self.records_max_bytes
            + self.commands_max_bytes
            + self.results_max_bytes
            + self.alerts_max_bytes
            + self.trust_max_bytes
            + self.enroll_max_bytes
        )


DEFAULT_LIMITS = StreamLimits.of(AggregatorConfig())


def stream_configs(
    subjects: Subjects, replicas: int = 1, limits: StreamLimits = DEFAULT_LIMITS
) -> list[StreamConfig]:
    return [
        StreamConfig(
            name=subjects.stream_name(STREAM_HEARTBEATS),
            description="signed node heartbeats by partition; per-message TTL marks dead nodes",
            sources=[_intake_source(subjects, limits.partitions)],
            storage=StorageType.FILE,
            num_replicas=replicas,
            max_msgs_per_subject=HEARTBEATS_PER_NODE,
            max_age=0,
            duplicate_window=DUPLICATE_WINDOW,
            allow_msg_ttl=True,
            subject_delete_marker_ttl=MARKER_TTL,
            discard=DiscardPolicy.NEW,
            max_bytes=limits.heartbeats_max_bytes,
            max_msgs=MAX_NODES,
            max_msg_size=MAX_HEARTBEAT_SIZE,
            # The views read each node's latest heartbeat by direct get
            # (actors/fleet/live/reader.py).
            allow_direct=True,
        ),
        StreamConfig(
            name=subjects.stream_name(STREAM_HEARTBEAT_INTAKE),
            description="signed node heartbeats as published; FLEET_HB sources them",
            subjects=[subjects.published_heartbeats()],
            storage=StorageType.FILE,
            num_replicas=replicas,
            max_msgs_per_subject=HEARTBEATS_PER_NODE,
            max_age=0,
            duplicate_window=DUPLICATE_WINDOW,
            allow_msg_ttl=True,
            allow_rollup_hdrs=False,
            discard=DiscardPolicy.NEW,
            max_bytes=limits.heartbeats_max_bytes,
            max_msgs=MAX_NODES,
            max_msg_size=MAX_HEARTBEAT_SIZE,
        ),
        StreamConfig(
            name=subjects.stream_name(STREAM_COMMANDS),
            description="signed operator commands, one work queue per node subject",
            subjects=[subjects.commands()],
            storage=StorageType.FILE,
            num_replicas=replicas,
            retention=RetentionPolicy.WORK_QUEUE,
            max_age=7 * DAY,
            duplicate_window=DUPLICATE_WINDOW,
            discard=DiscardPolicy.NEW,
            max_bytes=limits.commands_max_bytes,
            max_msgs=MAX_STREAM_MSGS,
            max_msg_size=MAX_COMMAND_SIZE,
            max_consumers=COMMAND_CONSUMERS,
        ),
        StreamConfig(
            name=subjects.stream_name(STREAM_EVENTS),
            description="signed command results (audit trail)",
            subjects=[subjects.results()],
            storage=StorageType.FILE,
            num_replicas=replicas,
            max_age=30 * DAY,
            duplicate_window=DUPLICATE_WINDOW,
            discard=DiscardPolicy.OLD,
            max_bytes=limits.results_max_bytes,
            max_msgs=MAX_STREAM_MSGS,
            max_msgs_per_subject=limits.results_per_node,
            max_msg_size=MAX_RESULT_SIZE,
            # The remediation policy reads a node's answers to its cordon by direct get
            # (actors/fleet/storage/answers.py).
            allow_direct=True,
        ),
        StreamConfig(
            name=subjects.stream_name(STREAM_ALERTS),
            description="aggregator alerts, deduplicated by deterministic Nats-Msg-Id",
            subjects=[subjects.alerts()],
            storage=StorageType.FILE,
            num_replicas=replicas,
            max_age=30 * DAY,
            duplicate_window=DUPLICATE_WINDOW,
            discard=DiscardPolicy.OLD,
            max_bytes=limits.alerts_max_bytes,
            max_msgs=MAX_STREAM_MSGS,
            max_msgs_per_subject=limits.alerts_per_subject,
            max_msg_size=MAX_ALERT_SIZE,
        ),
    ]


def bucket_configs(
    subjects: Subjects, replicas: int = 1, limits: StreamLimits = DEFAULT_LIMITS
) -> list[KeyValueConfig]:
    return [
        KeyValueConfig(
            bucket=subjects.bucket_name(BUCKET_NODES),
            description="one NodeRecord per node, written by aggregators",
            history=1,
            storage=StorageType.FILE,
            replicas=replicas,
            max_bytes=limits.records_max_bytes,
            max_value_size=MAX_RECORD_SIZE,
            # Direct gets: agents read records without creating a consumer, and under
            # auth.conf a node may read the bucket in no other way.
            direct=True,
        ),
        KeyValueConfig(
            bucket=subjects.bucket_name(BUCKET_LEASES),
            description="which aggregator consumes FLEET_HB now",
            history=1,
            storage=StorageType.FILE,
            replicas=replicas,
            max_bytes=MIB_LEASES,
            max_value_size=4 * KIB,
            direct=True,
        ),
        KeyValueConfig(
            bucket=subjects.bucket_name(BUCKET_INDEX),
            description="each partition's nodes counted by cluster and state, and those "
            "not active: what a summary listing reads",
            history=1,
            storage=StorageType.FILE,
            replicas=replicas,
            max_bytes=index_max_bytes(limits.partitions),
            max_value_size=INDEX_VALUE_SIZE,
            direct=True,
        ),
        KeyValueConfig(
            bucket=subjects.bucket_name(BUCKET_TRUST),
            description="approved node public keys",
            history=5,
            storage=StorageType.FILE,
            replicas=replicas,
            max_bytes=limits.trust_max_bytes,
            max_value_size=MAX_TRUST_SIZE,
            direct=True,
        ),
        KeyValueConfig(
            bucket=subjects.bucket_name(BUCKET_ENROLL),
            description="enrollment tokens: uses and revocation",
            history=1,
            direct=True,
            storage=StorageType.FILE,
            replicas=replicas,
            max_bytes=limits.enroll_max_bytes,
            max_value_size=MAX_ENROLL_SIZE,
            ttl=ENROLL_KEEP,
        ),
        KeyValueConfig(
            bucket=subjects.bucket_name(BUCKET_MAINTENANCE),
            description="maintenance windows: nodes whose alerts are not forwarded",
            history=1,
            direct=True,
            storage=StorageType.FILE,
            replicas=replicas,
            max_bytes=MIB_LEASES,
            max_value_size=MAX_MAINTENANCE_SIZE,
            ttl=MAINTENANCE_KEEP,
        ),
        KeyValueConfig(
            bucket=subjects.bucket_name(BUCKET_WORKLOADS),
            description="workloads placed by the fleet: desired replicas and where they run",
            history=1,
            direct=True,
            storage=StorageType.FILE,
            replicas=replicas,
            # Fixed like fleet_maintenance: a record is 1-5 KB (hundreds of workloads fit).
            max_bytes=MIB_LEASES,
            max_value_size=MAX_PLACED_SIZE,
        ),
        KeyValueConfig(
            bucket=subjects.bucket_name(BUCKET_SETTINGS),
            description="operators' signed settings: the fleet, clusters, label selectors",
            history=SETTINGS_HISTORY,
            direct=True,
            storage=StorageType.FILE,
            replicas=replicas,
            max_bytes=SETTINGS_MAX_BYTES,
            max_value_size=MAX_SETTINGS_SIZE,
        ),
    ]


async def provision(
    js: JetStreamContext,
    subjects: Subjects,
    replicas: int = 1,
    limits: StreamLimits = DEFAULT_LIMITS,
) -> None:
    """Create what is missing and bring existing streams to these settings. A server may
    refuse a change to an existing stream (a budget above what it can reserve, say): that
    stream keeps working with its old settings, and the refusal is logged, not raised, so
    one stale setting never stops an aggregator from starting."""
    for config in stream_configs(subjects, replicas, limits):
        try:
            info = await js.stream_info(config.name or "")
        except nats.js.errors.NotFoundError:
            try:
                await js.add_stream(config)
            except nats.js.errors.APIError as exc:
                if exc.err_code != SUBJECTS_OVERLAP:
                    raise
                # FLEET_HB of an older version kept its subjects (its update was refused,
                # logged above): it stores heartbeats itself, rollups not refused.
                log.error(
                    "stream not created: its subjects are another stream's",
                    extra={"stream": config.name, "reason": str(exc)},
                )
                continue
            log.info("stream created", extra={"stream": config.name})
            continue
        if config.sources:
            config = _keep_partitions(subjects, config, info.config, limits.partitions)
        try:
            await js.update_stream(config)
        except nats.js.errors.APIError as exc:
            log.error(
                "stream settings not updated; it keeps its old ones",
                extra={"stream": config.name, "reason": str(exc)},
            )
    for bucket in bucket_configs(subjects, replicas, limits):
        try:
            await js.key_value(bucket.bucket)
        except nats.js.errors.BucketNotFoundError:
            await js.create_key_value(bucket)
            log.info("bucket created", extra={"bucket": bucket.bucket})
            continue
        await _update_bucket(js, bucket)


def _intake_source(subjects: Subjects, partitions: int) -> StreamSource:
    """FLEET_HB's one source: FLEET_HB_IN, each heartbeat moved to its partition's subject."""
    return StreamSource(
        name=subjects.stream_name(STREAM_HEARTBEAT_INTAKE),
        subject_transforms=[SubjectTransform(*subjects.heartbeat_transform(partitions))],
    )


def _partitions_of(subjects: Subjects, config: StreamConfig) -> int | None:
    """N of FLEET_HB's partition transform: its source's, or the stream's own (FLEET_HB of
    a version before FLEET_HB_IN); None if it has neither."""
    transforms = [
        transform
        for source in config.sources or []
        for transform in source.subject_transforms or []
    ]
    if config.subject_transform is not None:
        transforms.append(config.subject_transform)
    for transform in transforms:
        found = subjects.transform_partitions(transform.dest)
        if found is not None:
            return found
    return None


def _keep_partitions(
    subjects: Subjects, wanted: StreamConfig, current: StreamConfig, partitions: int
) -> StreamConfig:
    """FLEET_HB's N never changes once set: another N would move every node to another
    subject (and fire a TTL marker for every node's old one). The existing transform is
    kept (moved from the stream to its source, for a FLEET_HB of an older version), and a
    differing setting logged; a stream of the old layout (no transform) gets one with
    ``partitions``."""
    existing = _partitions_of(subjects, current)
    if existing is None:
        if current.subject_transform is not None or current.sources:
            log.error(
                "FLEET_HB has a foreign subject transform; replaced by the partition one",
                extra={"stream": wanted.name},
            )
        else:
            log.warning(
                "FLEET_HB upgraded to partitions: heartbeats stored before are ignored",
                extra={"stream": wanted.name, "partitions": partitions},
            )
        return wanted
    if existing != partitions:
        log.warning(
            "partitions setting differs from FLEET_HB's; the stream's is used",
            extra={"stream": wanted.name, "partitions": partitions, "stream_partitions": existing},
        )
    return replace(wanted, sources=[_intake_source(subjects, existing)])


async def heartbeat_partitions(js: JetStreamContext, subjects: Subjects) -> int:
    """N of FLEET_HB as it exists (provisioned): what every aggregator partitions by."""
    info = await js.stream_info(subjects.stream_name(STREAM_HEARTBEATS))
    found = _partitions_of(subjects, info.config)
    if found is None:
        raise RuntimeError("FLEET_HB has no partition transform (not provisioned)")
    return found


async def _update_bucket(js: JetStreamContext, bucket: KeyValueConfig) -> None:
    """Bring a bucket made by an older version to the settings that matter for safety:
    direct gets (peer discovery under auth.conf reads no other way) and its budgets. The
    bucket's history and storage stay as they are; a refusal is logged like a stream's."""
    name = f"KV_{bucket.bucket}"
    current = (await js.stream_info(name)).config
    wanted = replace(
        current,
        allow_direct=bucket.direct,
        max_bytes=bucket.max_bytes,
        max_msg_size=bucket.max_value_size,
    )
    if wanted == current:
        return
    try:
        await js.update_stream(wanted)
    except nats.js.errors.APIError as exc:
        log.error(
            "bucket settings not updated; it keeps its old ones",
            extra={"bucket": bucket.bucket, "reason": str(exc)},
        )
    else:
        log.info("bucket settings updated", extra={"bucket": bucket.bucket})
