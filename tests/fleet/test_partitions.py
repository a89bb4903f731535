"""FLEET_HB's partitions: the server's transform and :func:`partition_of` agree, N never
changes once the stream has it, and a stream of the old layout gets the transform."""

from __future__ import annotations

import dataclasses
import os
import socket
import string
from unittest import mock

import nats.js.errors
from nats.js.api import SubjectTransform

from actors.fleet.aggregator.lease import holder_id
from actors.fleet.metrics import AggregatorMetrics
from actors.fleet.storage.registry import approve
from actors.fleet.storage.streams import heartbeat_partitions, provision, stream_configs
from actors.runtime.bus import NatsBus
from schemas import codec
from schemas.subjects import (
    STREAM_HEARTBEAT_INTAKE,
    STREAM_HEARTBEATS,
    Subjects,
    member_key,
    partition_of,
)
from tests.fleet.test_aggregator import watch_alerts
from tests.support.fleet import (
    TEST_LIMITS,
    Fleet,
    heartbeat,
    new_aggregator,
    wait_for,
    wait_record,
)

ALPHABET = string.ascii_letters + string.digits + "_-"


async def stored_subjects(bus: NatsBus, stream: str, count: int) -> list[str]:
    """The subjects of the first ``count`` messages of ``stream``, as stored (once it has
    sourced them from FLEET_HB_IN)."""

    async def sourced() -> bool:
        return (await bus.js.stream_info(stream)).state.last_seq >= count

    # 30 s: with both cores busy the server's first sourcing of a new stream once took
    # over 10 s (tests/security/test_monitor.py, 1 of 30 runs).
    await wait_for(sourced, 30)
    subjects = []
    for seq in range(1, count + 1):
        message = await bus.js.get_msg(stream, seq)
        subjects.append(message.subject or "")
    return subjects


async def test_partition_of_matches_the_servers_transform(bus: NatsBus, prefix: str) -> None:
    """Heartbeats of 400 node ids (every token character, lengths 1 to 64) published to
    FLEET_HB are stored under exactly the partition partition_of computes, for the
    fixture's N (8) and for a stream made with N = 13."""
    subjects = Subjects(prefix)
    rng = os.urandom(400 * 64)
    nodes = [
        "".join(ALPHABET[b % len(ALPHABET)] for b in rng[i * 64 : i * 64 + 1 + i % 64])
        for i in range(400)
    ]
    nodes = list(dict.fromkeys(nodes))
    stream = subjects.stream_name(STREAM_HEARTBEATS)
    for node in nodes:
        await bus.js.publish(subjects.heartbeat("c1", node), b"{}")
    stored = await stored_subjects(bus, stream, len(nodes))
    assert stored == [subjects.stored_heartbeat("c1", node, 8) for node in nodes]
    assert len({partition_of(node, 8) for node in nodes}) == 8

    other = Subjects(f"{prefix}x")
    config = dataclasses.replace(TEST_LIMITS, partitions=13)
    await provision(bus.js, other, limits=config)
    assert await heartbeat_partitions(bus.js, other) == 13
    for node in nodes:
        await bus.js.publish(other.heartbeat("c1", node), b"{}")
    stored = await stored_subjects(bus, other.stream_name(STREAM_HEARTBEATS), len(nodes))
    assert stored == [f"{prefix}x.hb.{partition_of(node, 13)}.c1.{node}" for node in nodes]


async def test_provision_never_changes_an_existing_streams_partitions(
    bus: NatsBus, prefix: str
) -> None:
    """Provisioned again with another partitions setting, FLEET_HB keeps its N (8): a
    node's heartbeats stay on the same stored subject."""
    subjects = Subjects(prefix)
    limits = dataclasses.replace(TEST_LIMITS, partitions=32)
    await provision(bus.js, subjects, limits=limits)
    assert await heartbeat_partitions(bus.js, subjects) == 8
    await bus.js.publish(subjects.heartbeat("c1", "n1"), b"{}")

    async def sourced() -> bytes | None:
        try:
            message = await bus.js.get_last_msg(
                subjects.stream_name(STREAM_HEARTBEATS), subjects.stored_heartbeat("c1", "n1", 8)
            )
        except nats.js.errors.NotFoundError:
            return None  # FLEET_HB sources it from FLEET_HB_IN a moment later
        return message.data

    assert await wait_for(sourced, 30) == b"{}"  # as in stored_subjects


async def test_a_stream_of_the_version_before_the_intake_is_moved_behind_it(
    bus: NatsBus, prefix: str
) -> None:
    """A FLEET_HB that takes heartbeats itself (its own subjects and partition transform,
    N = 4, one heartbeat stored) is given FLEET_HB_IN as its source on provisioning: its N
    and its heartbeat are kept, and a heartbeat published now reaches it through the
    intake."""
    subjects = Subjects(f"{prefix}m")
    current = stream_configs(subjects, limits=TEST_LIMITS)[0]
    transform = SubjectTransform(*subjects.heartbeat_transform(4))
    await bus.js.add_stream(
        dataclasses.replace(
            current,
            sources=None,
            subjects=[subjects.published_heartbeats()],
            subject_transform=transform,
        )
    )
    stream = subjects.stream_name(STREAM_HEARTBEATS)
    await bus.js.publish(subjects.heartbeat("c1", "n1"), b"old")
    await provision(bus.js, subjects, limits=TEST_LIMITS)
    info = await bus.js.stream_info(stream)
    assert not info.config.subjects and info.config.subject_transform is None
    assert [source.name for source in info.config.sources or []] == [
        subjects.stream_name(STREAM_HEARTBEAT_INTAKE)
    ]
    assert await heartbeat_partitions(bus.js, subjects) == 4
    ack = await bus.js.publish(subjects.heartbeat("c1", "n2"), b"new")
    assert ack.stream == subjects.stream_name(STREAM_HEARTBEAT_INTAKE)

    async def stored(node: str) -> bytes | None:
        try:
            found = await bus.js.get_last_msg(stream, subjects.stored_heartbeat("c1", node, 4))
        except nats.js.errors.NotFoundError:
            return None
        return found.data

    assert await wait_for(lambda: stored("n2")) == b"new"
    assert await stored("n1") == b"old"


async def test_old_layout_stream_is_upgraded_and_its_heartbeats_ignored(
    fleet: Fleet, bus: NatsBus, prefix: str
) -> None:
    """A FLEET_HB of the old layout (subjects ``<prefix>.hb.>``, no transform) holding a
    4-token heartbeat gets the transform on provisioning; an aggregator then accepts the
    node's new heartbeats and never judges the old message (no alert about it)."""
    subjects = Subjects(f"{prefix}o")
    current = stream_configs(subjects, limits=TEST_LIMITS)[0]
    await bus.js.add_stream(
        dataclasses.replace(current, subjects=[subjects.heartbeats()], subject_transform=None)
    )
    key = fleet.node_key("n1")
    stream = subjects.stream_name(STREAM_HEARTBEATS)
    legacy = codec.encode(heartbeat(seq=1))
    await bus.js.publish(subjects.heartbeat("c1", "n1"), legacy, headers=key.headers(legacy))
    assert (await bus.js.get_msg(stream, 1)).subject == subjects.heartbeat("c1", "n1")

    await provision(bus.js, subjects, limits=TEST_LIMITS)
    info = await bus.js.stream_info(stream)
    assert not info.config.subjects  # FLEET_HB_IN takes what nodes publish
    intake = await bus.js.stream_info(subjects.stream_name(STREAM_HEARTBEAT_INTAKE))
    assert intake.config.subjects == [subjects.published_heartbeats()]
    assert await heartbeat_partitions(bus.js, subjects) == TEST_LIMITS.partitions
    assert info.state.messages == 1  # the old message is kept, and ignored

    await approve(bus, subjects, "n1", key.public_key)
    alerts = await watch_alerts(bus, subjects.prefix)
    metrics = AggregatorMetrics()
    await fleet.start_supervisor(new_aggregator(bus, subjects.prefix, metrics))
    body = codec.encode(heartbeat(seq=2))
    await bus.js.publish(subjects.heartbeat("c1", "n1"), body, headers=key.headers(body))
    record = await wait_record(bus, subjects.prefix, "n1", lambda r: r.last_seq == 2)
    assert record.state == "active"
    await bus.flush()
    assert alerts.alerts == []
    # Only the new heartbeat was judged: the 4-token one is in no partition's consumer.
    assert metrics.registry.get_sample_value("fleet_heartbeats_accepted_total") == 1
    assert not metrics.registry.get_sample_value(
        "fleet_messages_dropped_total", {"reason": "malformed_subject"}
    )


def test_holder_id_is_a_key_token_whatever_the_host_name() -> None:
    """A host name with dots (a cloud VM's) still makes a holder id usable as the token of
    its membership key, and two starts on one host are two holders."""
    with mock.patch.object(socket, "gethostname", return_value="ip-10-0-0-1.ec2.internal"):
        first, second = holder_id(), holder_id()
    assert member_key(first).startswith("member.ip-10-0-0-1-ec2-internal-")
    assert first != second
