"""Issue 40: who set a node's state is said from what the fleet recorded itself (the
remediation policy's own record), never from a node-signed field: a stolen node key that
names an operator, or the policy, as who cordoned it is shown as the node's claim, in
``fleetctl describe``, the fleet API and the dashboard's node page."""

from __future__ import annotations

import os

import aiohttp

from actors.fleet.live import reader as live
from actors.fleet.metrics import AggregatorMetrics
from actors.fleet.remediation.actor import policy_bucket
from actors.fleet.storage.registry import approve
from actors.fleet.views.dashboard import render
from schemas import codec, signing
from schemas.messages import Heartbeat
from schemas.remediation import Hold, PolicyRecord
from schemas.subjects import Subjects
from tests.cli.test_describe_events import fleetctl
from tests.fleet.test_remediation_hooks import sample_claiming
from tests.security.attack import attacker
from tests.support.fleet import Fleet, heartbeat, new_aggregator, new_fleet_api, wait_record

OPERATOR = signing.KeyPair.generate().public_key
POLICY = signing.KeyPair.generate().public_key


async def test_a_forged_by_is_shown_as_the_nodes_claim(fleet: Fleet) -> None:
    """n2's key claims an operator cordoned it and n3's that the policy did (it holds
    nothing of n3); n4 is held in the policy's record. describe labels each ``by`` the
    node's claim (n3's: the policy holds no record of it) and says n4 is held by the
    policy, from its record; the fleet API's ``policy_hold`` is set for n4 alone, and the
    dashboard's node page says the same."""
    subjects = Subjects(fleet.prefix)
    aggregator = new_aggregator(fleet.bus, fleet.prefix)
    metrics = aggregator.metrics
    assert isinstance(metrics, AggregatorMetrics)
    api = new_fleet_api(fleet.bus, fleet.prefix, metrics, live=aggregator.view)
    await fleet.start_supervisor(aggregator, api)
    hold = Hold(reason_class="xid", reason="XID 79", action="cordon", command_id="c", since=1.0)
    bucket = await fleet.bus.js.create_key_value(policy_bucket(subjects))
    record = PolicyRecord(cluster="c1", holds={"n4": hold}, updated_by=POLICY)
    await bucket.put("c1", codec.encode(record))
    claims = {"n2": OPERATOR, "n3": POLICY, "n4": POLICY}
    async with attacker(fleet.url) as nc:
        js = nc.jetstream()
        for node, by in claims.items():
            key = signing.KeyPair.generate()
            await approve(fleet.bus, subjects, node, key.public_key)
            beat: Heartbeat = heartbeat(
                node,
                1,
                schedulability="cordoned",
                schedulability_reason="disk swap",
                schedulability_by=by,
                sample=sample_claiming(f"{node}.example", []),
            )
            body = codec.encode(beat)
            headers = {**key.headers(body), "Nats-Msg-Id": os.urandom(8).hex()}
            await js.publish(subjects.heartbeat("c1", node), body, headers=headers)
    for node in claims:
        await wait_record(fleet.bus, fleet.prefix, node, lambda r: r.state == "cordoned")
    lines = {}
    for node in claims:
        code, out, err = await fleetctl(fleet, "describe", node)
        assert code == 0, err
        [lines[node]] = [line for line in out if line.startswith("Schedulability:")]
        assert f"Hostname:        {node}.example (the node's claim)" in out
        assert any(line.startswith("Identity:        none enrolled") for line in out)
    reason = "Schedulability:  cordoned (reason: disk swap)"
    assert lines["n2"] == f"{reason}, by {OPERATOR} (the node's claim)"
    unheld = "(the node's claim: the policy holds no record of it)"
    assert lines["n3"] == f"{reason}, by {POLICY} {unheld}"
    assert lines["n4"] == (
        f"{reason}, by {POLICY} (the node's claim); held by the remediation policy "
        "(cordon: its own record)"
    )
    async with aiohttp.ClientSession() as session:
        for node, held in (("n2", ""), ("n3", ""), ("n4", "cordon")):
            async with session.get(f"http://127.0.0.1:{api.port}/nodes/{node}") as answer:
                shown = await answer.json()
            assert shown["policy_hold"] == held
            assert shown["heartbeat"]["schedulability_by"] == claims[node]
    pages = {
        node: render.node_detail(await live.read_node(fleet.bus, subjects, node), 0.0)
        for node in ("n2", "n4")
    }
    assert f"(node says: by {OPERATOR})" in pages["n2"] and "remediation policy" not in pages["n2"]
    assert f"(held by the remediation policy (cordon); node says: by {POLICY})" in pages["n4"]
