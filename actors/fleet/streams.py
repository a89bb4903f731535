"""Idempotent provisioning of the JetStream streams and KV buckets of the wire contract.

Safe to run from every process at start-up: a stream that exists is updated to the
settings below (failure detection needs ``allow_msg_ttl`` and delete markers), a bucket
that exists is left alone.
"""

from __future__ import annotations

import logging

import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import (
    DiscardPolicy,
    KeyValueConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)

from schemas.subjects import (
    BUCKET_NODES,
    BUCKET_TRUST,
    STREAM_ALERTS,
    STREAM_COMMANDS,
    STREAM_EVENTS,
    STREAM_HEARTBEATS,
    Subjects,
)

log = logging.getLogger(__name__)

DAY = 24 * 3600.0
DUPLICATE_WINDOW = 300.0
"""Five minutes: replays inside it are dropped by the server itself (Nats-Msg-Id)."""
MARKER_TTL = 3600.0
"""How long a delete marker stays, so an aggregator down for an hour still sees it."""
HEARTBEATS_PER_NODE = 1
"""Only the latest heartbeat per node is kept. This is also what lets a heartbeat's short
Nats-TTL stand beside the hour-long marker TTL: with more messages per subject the server
raises every per-message TTL to the marker TTL (nats-server PRs 6741 and 6818)."""


def stream_configs(subjects: Subjects, replicas: int = 1) -> list[StreamConfig]:
    return [
        StreamConfig(
            name=subjects.stream_name(STREAM_HEARTBEATS),
            description="signed node heartbeats; per-message TTL marks dead nodes",
            subjects=[subjects.heartbeats()],
            storage=StorageType.FILE,
            num_replicas=replicas,
            max_msgs_per_subject=HEARTBEATS_PER_NODE,
            max_age=0,
            duplicate_window=DUPLICATE_WINDOW,
            allow_msg_ttl=True,
            subject_delete_marker_ttl=MARKER_TTL,
            discard=DiscardPolicy.OLD,
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
        ),
        StreamConfig(
            name=subjects.stream_name(STREAM_EVENTS),
            description="signed command results (audit trail)",
            subjects=[subjects.results()],
            storage=StorageType.FILE,
            num_replicas=replicas,
            max_age=30 * DAY,
            duplicate_window=DUPLICATE_WINDOW,
        ),
        StreamConfig(
            name=subjects.stream_name(STREAM_ALERTS),
            description="aggregator alerts, deduplicated by deterministic Nats-Msg-Id",
            subjects=[subjects.alerts()],
            storage=StorageType.FILE,
            num_replicas=replicas,
            max_age=30 * DAY,
            duplicate_window=DUPLICATE_WINDOW,
        ),
    ]


def bucket_configs(subjects: Subjects, replicas: int = 1) -> list[KeyValueConfig]:
    return [
        KeyValueConfig(
            bucket=subjects.bucket_name(BUCKET_NODES),
            description="one NodeRecord per node, written by aggregators",
            history=1,
            storage=StorageType.FILE,
            replicas=replicas,
            # Direct gets: agents read records without creating a consumer, and under
            # auth.conf a node may read the bucket in no other way.
            direct=True,
        ),
        KeyValueConfig(
            bucket=subjects.bucket_name(BUCKET_TRUST),
            description="approved node public keys",
            history=5,
            storage=StorageType.FILE,
            replicas=replicas,
            direct=True,
        ),
    ]


async def provision(js: JetStreamContext, subjects: Subjects, replicas: int = 1) -> None:
    for config in stream_configs(subjects, replicas):
        try:
            await js.stream_info(config.name or "")
        except nats.js.errors.NotFoundError:
            await js.add_stream(config)
            log.info("stream created", extra={"stream": config.name})
        else:
            await js.update_stream(config)
    for bucket in bucket_configs(subjects, replicas):
        try:
            await js.key_value(bucket.bucket)
        except nats.js.errors.BucketNotFoundError:
            await js.create_key_value(bucket)
            log.info("bucket created", extra={"bucket": bucket.bucket})
