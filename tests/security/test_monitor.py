"""Issue 30 item 7: the monitor user of ``fleetctl nats-config`` is read-only in fact.

A real nats-server includes the generated accounts with a monitor key; the monitor is a
plain nats-py connection. It reads the node records (stream info, direct gets: one key
or the batched scan), what the live views read besides (the latest heartbeats, the
approved public keys, the partitions' consumer info, the policy's holds), alerts and
events; everything else
it tries is refused by the server or lands nowhere: consumers on the records stream, a
registration, a direct get whose reply names ``fleet.register`` or a trust entry,
FLEET's inboxes, other streams.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import nats
import nats.errors
import nats.js.errors
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from actors.fleet.aggregator import record_rules
from actors.fleet.remediation.actor import policy_bucket
from actors.fleet.storage import records, registry
from actors.fleet.storage.nats_config import JS_API_PREFIX
from actors.fleet.storage.streams import heartbeat_partitions, provision
from actors.runtime.bus import NatsBus
from actors.runtime.embedded import NatsServer
from schemas import codec, signing
from schemas.messages import Alert
from schemas.subjects import (
    BUCKET_ENROLL,
    BUCKET_NODES,
    BUCKET_POLICY,
    BUCKET_TRUST,
    STREAM_COMMANDS,
    STREAM_HEARTBEATS,
)
from tests.security.auth_fleet import SETTLE, SUBJECTS, generated
from tests.support.deploy import AUTH_CLUSTER
from tests.support.fleet import wait_for

NODE = "node-1"
NODES_STREAM = f"KV_{SUBJECTS.bucket_name(BUCKET_NODES)}"
COMMANDS_STREAM = SUBJECTS.stream_name(STREAM_COMMANDS)
ENROLL_STREAM = f"KV_{SUBJECTS.bucket_name(BUCKET_ENROLL)}"


@dataclass
class Monitored:
    server: NatsServer
    admin: NatsBus
    node: signing.KeyPair
    monitor: Client
    errors: list[Exception] = field(default_factory=list)

    def refused(self, what: str, subject: str) -> bool:
        """Whether the server said -ERR for ``what`` ("publish to", "subscription to")."""
        wanted = f'permissions violation for {what} "{subject.lower()}"'
        return any(wanted in str(e) for e in self.errors)


@pytest.fixture
async def monitored(tmp_path: Path) -> AsyncIterator[Monitored]:
    """The generated accounts with node-1, an aggregator and a monitor; node-1's record
    and trust entry in place; the monitor connected on a plain client."""
    keys = {name: signing.KeyPair.generate() for name in ("aggregator", "monitor", NODE)}
    config = generated(
        tmp_path / "generated",
        tmp_path / "js",
        keys["aggregator"].public_key,
        {NODE: (AUTH_CLUSTER, keys[NODE].public_key)},
        keys["monitor"].public_key,
    )
    server = NatsServer(tmp_path / "server", name="monitored", config_file=config).start()
    errors: list[Exception] = []

    async def on_error(exc: Exception) -> None:
        errors.append(exc)

    try:
        admin = await NatsBus.connect(server.url, "admin", nkey_seed=keys["aggregator"].seed)
        await provision(admin.js, SUBJECTS)
        await registry.approve(admin, SUBJECTS, NODE, keys[NODE].public_key)
        record = record_rules.pending_record(NODE, AUTH_CLUSTER, keys[NODE].public_key)
        await (await admin.kv(SUBJECTS.bucket_name(BUCKET_NODES))).put(NODE, codec.encode(record))
        monitor = await nats.connect(
            server.url,
            nkeys_seed_str=keys["monitor"].seed,
            error_cb=on_error,
            allow_reconnect=False,
        )
        yield Monitored(server, admin, keys[NODE], monitor, errors)
        await monitor.close()
        await admin.close()
    finally:
        server.stop()


async def test_monitor_reads_records_alerts_and_events(monitored: Monitored) -> None:
    """Through JS.FLEET.API: the records stream's info, one record by key, every record
    by the batched scan; alerts and node events as they are published."""
    js = monitored.monitor.jetstream(prefix=JS_API_PREFIX)
    info = await js.stream_info(NODES_STREAM)
    assert info.state.messages == 1
    entry = await (await js.key_value(SUBJECTS.bucket_name(BUCKET_NODES))).get(NODE)
    assert entry.value is not None and b'"node-1"' in entry.value
    scan = await monitored.monitor.request(
        f"{JS_API_PREFIX}.DIRECT.GET.{NODES_STREAM}",
        msgspec.json.encode({"seq": 1, "batch": 10}),
        timeout=5,
    )
    assert scan.data.startswith(b"{") and b'"node-1"' in scan.data
    # What the live views read (docs/live-reads.md): FLEET_HB's latest heartbeat of the
    # node, its approved key, the partition consumers' info.
    await monitored.admin.js.publish(
        SUBJECTS.heartbeat(AUTH_CLUSTER, NODE), b'{"node_id":"node-1"}'
    )
    heartbeats = SUBJECTS.stream_name(STREAM_HEARTBEATS)
    partitions = await heartbeat_partitions(monitored.admin.js, SUBJECTS)
    stored = SUBJECTS.stored_heartbeat(AUTH_CLUSTER, NODE, partitions)

    async def sourced() -> bool:  # FLEET_HB takes it from FLEET_HB_IN a moment later
        try:
            await monitored.admin.js.get_last_msg(heartbeats, stored)
        except nats.js.errors.NotFoundError:
            return False
        return True

    # 30 s: with both cores busy the server's first sourcing of a new stream once took
    # over 10 s (in 1 of 30 runs).
    await wait_for(sourced, 30)
    latest = await monitored.monitor.request(
        f"{JS_API_PREFIX}.DIRECT.GET.{heartbeats}",
        msgspec.json.encode({"multi_last": [stored], "batch": 1}),
        timeout=5,
    )
    assert latest.data == b'{"node_id":"node-1"}'
    trusted = await (await js.key_value(SUBJECTS.bucket_name(BUCKET_TRUST))).get(NODE)
    assert trusted.value is not None and monitored.node.public_key.encode() in trusted.value
    await js.stream_info(heartbeats)
    # The remediation policy's holds, which describe reads to say who holds a node.
    holds = await monitored.admin.js.create_key_value(policy_bucket(SUBJECTS))
    await holds.put(NODE, b"{}")
    held = await (await js.key_value(SUBJECTS.bucket_name(BUCKET_POLICY))).get(NODE)
    assert held.value == b"{}"

    heard: list[str] = []

    async def on_message(msg: Msg) -> None:
        heard.append(msg.subject)

    await monitored.monitor.subscribe(SUBJECTS.alerts(), cb=on_message)
    await monitored.monitor.subscribe(SUBJECTS.events("*"), cb=on_message)
    await monitored.monitor.flush()
    alert = SUBJECTS.alert("stale", AUTH_CLUSTER, NODE)
    body = Alert(
        id="a-1",
        kind="stale",
        node_id=NODE,
        cluster=AUTH_CLUSTER,
        severity="warning",
        ts=time.time(),
        message="m",
    )
    event = SUBJECTS.event(NODE, "health")
    node = await nats.connect(monitored.server.url, nkeys_seed_str=monitored.node.seed)

    async def heard_both() -> bool:
        # Published until heard: with both cores busy, the first alert after the monitor's
        # flushed subscription through the import went undelivered in 3 of 55 runs (the
        # event never did); what is pinned is that both reach the monitor.
        if alert not in heard:
            await monitored.admin.js.publish(alert, codec.encode(body))
        if event not in heard:
            await node.publish(event, b"{}")
            await node.flush()
        await asyncio.sleep(0.2)
        return {alert, event} <= set(heard)

    try:
        await wait_for(heard_both)
    except AssertionError:
        raise AssertionError(f"heard only {heard}") from None
    finally:
        await node.close()


async def test_monitor_writes_nothing_and_relays_nothing(monitored: Monitored) -> None:
    """Consumers on the records stream (500 tries, both API prefixes), a registration, a
    record or trust write, other streams' info and gets: refused by the server. A direct
    get whose reply names fleet.register or a trust entry: answered into the monitor's
    own account, so no registration is heard and no trust entry changes. FLEET's inboxes:
    a monitor listening on every inbox it may hears none of the aggregator's answers."""
    nc, admin = monitored.monitor, monitored.admin
    registrations: list[bytes] = []

    async def registered(msg: Msg) -> None:
        registrations.append(msg.data)

    await admin.subscribe(SUBJECTS.register(), registered)
    await admin.flush()
    trust_before = await registry.trust_entry(admin, SUBJECTS, NODE)
    overheard: list[str] = []

    async def overhear(msg: Msg) -> None:
        overheard.append(msg.subject)

    await nc.subscribe("_INBOX.>", cb=overhear)
    refused_publish = [
        *(f"{api}.CONSUMER.CREATE.{NODES_STREAM}" for api in ("$JS.API", JS_API_PREFIX)),
        f"{JS_API_PREFIX}.CONSUMER.CREATE.{NODES_STREAM}.c.$KV.fleet_nodes.>",
        f"{JS_API_PREFIX}.CONSUMER.DURABLE.CREATE.{NODES_STREAM}.c",
        "$JS.API.INFO",
        f"{JS_API_PREFIX}.STREAM.INFO.{COMMANDS_STREAM}",
        f"{JS_API_PREFIX}.DIRECT.GET.{COMMANDS_STREAM}",
        f"{JS_API_PREFIX}.STREAM.INFO.{ENROLL_STREAM}",
        f"{JS_API_PREFIX}.STREAM.PURGE.{NODES_STREAM}",
        SUBJECTS.register(),
        f"$KV.fleet_nodes.{NODE}",
        f"$KV.fleet_trust.{NODE}",
    ]
    push = msgspec.json.encode(
        {"stream_name": NODES_STREAM, "config": {"deliver_subject": SUBJECTS.register()}}
    )
    for subject in refused_publish:
        await nc.publish(subject, push, reply="_INBOX.monitor.x")
    for _ in range(500):
        await nc.publish(f"{JS_API_PREFIX}.CONSUMER.CREATE.{NODES_STREAM}", push)
    direct_get = f"{JS_API_PREFIX}.DIRECT.GET.{NODES_STREAM}"
    for reply in (SUBJECTS.register(), f"$KV.fleet_trust.{NODE}"):
        await nc.publish(direct_get, msgspec.json.encode({"seq": 1}), reply=reply)
    for subject in (SUBJECTS.register(), SUBJECTS.heartbeats(), SUBJECTS.commands()):
        await nc.subscribe(subject)
    await nc.flush()
    # The aggregator's own requests in FLEET: their answers go to FLEET's inboxes.
    await admin.js.stream_info(NODES_STREAM)
    await records.read_records(admin, SUBJECTS)
    await wait_for(
        lambda: all(monitored.refused("publish to", subject) for subject in refused_publish)
    )
    await wait_for(lambda: monitored.refused("subscription to", SUBJECTS.register()))
    await asyncio.sleep(SETTLE)
    assert registrations == []
    assert await registry.trust_entry(admin, SUBJECTS, NODE) == trust_before
    assert (await admin.js.stream_info(NODES_STREAM)).state.consumer_count == 0
    assert overheard == []
