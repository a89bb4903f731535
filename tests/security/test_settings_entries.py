"""Forged, unsigned, node-signed and replayed fleet settings, written as an attacker would
with a plain nats-py client: where anyone may write the bucket (one account, no
permissions) the agent ignores each and counts it by reason, and runs on with the
operator's settings; under the shipped accounts a node cannot write the bucket at all."""

from __future__ import annotations

import time
from collections.abc import Callable

import nats
import nats.errors
import pytest

from schemas import codec
from schemas.settings import FLEET_KEY, SettingsEntry, cluster_key
from schemas.signing import KeyPair
from schemas.subjects import BUCKET_SETTINGS, Subjects
from tests.security.auth_fleet import PREFIX, SUBJECTS, VICTIM, Attacker, AuthServer
from tests.support.deploy import AUTH_CLUSTER, AUTH_JS_API_PREFIX
from tests.support.fleet import Fleet, wait_for, wait_record
from tests.support.settings import put_settings, wait_settings

IGNORED = "node_agent_settings_ignored_total"


def settings_entry(values: dict[str, str], revision: int) -> SettingsEntry:
    return SettingsEntry(scope="fleet", revision=revision, issued_at=time.time(), values=values)


async def test_forged_unsigned_node_signed_and_replayed_entries_are_ignored(fleet: Fleet) -> None:
    """On a server where anyone may write the bucket, a plain client stores as the fleet's
    entry: an unsigned one, one signed with the node's own key, one whose bytes differ
    from what the operator signed, the operator's older revision again, and a delete.
    The agent ignores each, counts it once under its reason, and keeps the operator's
    newest values."""
    await fleet.start_aggregator()
    operator = KeyPair.generate()
    config = fleet.config(trust_operators=[operator.public_key], settings_interval=0.2)
    agent = await fleet.start_agent(config)
    older = await put_settings(fleet.bus, fleet.prefix, operator, {"sample_interval": "3s"})
    newer = await put_settings(fleet.bus, fleet.prefix, operator, {"sample_interval": "2s"})
    await wait_settings(fleet.bus, fleet.prefix, "n1", lambda s, _: s.revision == newer.revision)

    bucket = Subjects(fleet.prefix).bucket_name(BUCKET_SETTINGS)
    subject = f"$KV.{bucket}.{FLEET_KEY}"
    lowered = codec.encode(settings_entry({"sample_interval": "0.1s"}, newer.revision + 1))
    operator_body = codec.encode(older)
    attacks: list[tuple[str, dict[str, str], bytes]] = [
        ("unsigned", {}, lowered),
        ("node_key", fleet.node_key("n1").headers(lowered), lowered),
        ("bad_signature", operator.headers(operator_body), lowered),
        ("replayed", operator.headers(operator_body), operator_body),
    ]

    def counted(reason: str, times: int) -> Callable[[], bool]:
        return lambda: agent.metrics.value(IGNORED, {"reason": reason}) == times

    attacker = await nats.connect(fleet.url)
    try:
        js = attacker.jetstream()
        for reason, headers, body in attacks:
            await js.publish(subject, body, headers=headers)
            await wait_for(counted(reason, 1))
        deleted = await attacker.jetstream().key_value(bucket)
        await deleted.delete(FLEET_KEY)
        await wait_for(counted("unsigned", 2))
    finally:
        await attacker.close()

    beat = await wait_settings(fleet.bus, fleet.prefix, "n1", lambda s, _: True)
    assert beat.settings is not None and beat.settings.revision == newer.revision
    assert beat.settings.applied == {"sample_interval": FLEET_KEY}
    assert agent.inventory is not None and agent.inventory.config.sample_interval == 2.0
    for reason in ("malformed", "misplaced", "untrusted_key"):
        assert agent.metrics.value(IGNORED, {"reason": reason}) == 0


@pytest.mark.parametrize("api", ["$JS.API", AUTH_JS_API_PREFIX])
async def test_a_node_cannot_write_the_settings_bucket(
    auth: AuthServer, attacker: Attacker, api: str
) -> None:
    """Under the shipped accounts (auth.conf and what fleetctl nats-config generates), a
    node's key writing the fleet's or its cluster's settings, directly or through the
    JetStream API (purge, delete), is refused by the server and nothing changes; the
    honest agent beside it reads the operator's settings with the one direct get it may
    make and takes them, without a permission violation."""
    await auth.fleet.start_aggregator()
    operator = KeyPair.generate()
    agent_config = auth.config(VICTIM, trust_operators=[operator.public_key], settings_interval=0.2)
    await auth.fleet.start_agent(agent_config)
    await wait_record(auth.admin, PREFIX, VICTIM, lambda r: r.state == "active", timeout=20)
    written = await put_settings(
        auth.admin, PREFIX, operator, {"probe_interval": "4s"}, cluster=AUTH_CLUSTER
    )
    await wait_settings(
        auth.admin, PREFIX, VICTIM, lambda s, _: s.revision == written.revision, timeout=20
    )
    stream = f"KV_{SUBJECTS.bucket_name(BUCKET_SETTINGS)}"
    before = (await auth.admin.js.stream_info(stream)).state

    bucket = SUBJECTS.bucket_name(BUCKET_SETTINGS)
    body = codec.encode(settings_entry({"probe_interval": "0.1s"}, written.revision + 1))
    targets = [
        f"$KV.{bucket}.{FLEET_KEY}",
        f"$KV.{bucket}.{cluster_key(AUTH_CLUSTER)}",
        f"{api}.STREAM.PURGE.{stream}",
        f"{api}.STREAM.DELETE.{stream}",
        f"{api}.STREAM.MSG.DELETE.{stream}",
    ]
    nc = attacker.nc
    for target in targets:
        await nc.publish(target, body)
    await nc.flush()
    await wait_for(lambda: all(attacker.refused(target) for target in targets))
    with pytest.raises((nats.errors.Error, TimeoutError)):
        await nc.jetstream(prefix=api).publish(targets[0], body, timeout=0.5)

    after = (await auth.admin.js.stream_info(stream)).state
    assert (after.messages, after.last_seq) == (before.messages, before.last_seq)
    beat = await wait_settings(auth.admin, PREFIX, VICTIM, lambda s, _: True)
    assert beat.settings is not None and beat.settings.revision == written.revision
    assert beat.settings.applied == {"probe_interval": cluster_key(AUTH_CLUSTER)}
    log = auth.server.log_file.read_text().splitlines()
    assert any("Violation" in line for line in log)  # the attacker's
    assert not [line for line in log if "Violation" in line and f"node-agent:{VICTIM}" in line]
