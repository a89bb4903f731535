"""What ``fleetctl watch --events`` says of who signed each node event: an event signed
with the node's approved key is the node's claim (``node-claim``), never more; another
key's is named, and unsigned or badly signed events are marked so."""

from __future__ import annotations

from nats.aio.msg import Msg

from actors.cli.fleetctl.views import EventSigners
from actors.fleet.storage import registry
from schemas import signing
from schemas.subjects import Subjects
from tests.support.fleet import Fleet, wait_for


async def test_node_signed_events_are_shown_as_the_nodes_claims(fleet: Fleet) -> None:
    """The node's key: ``node-claim``; an operator's: ``signed-by=<key>``; no headers:
    ``unsigned``; a signature over other bytes: ``bad-signature``."""
    subjects = Subjects(fleet.prefix)
    node, operator = fleet.node_key("n1"), signing.KeyPair.generate()
    await registry.approve(fleet.bus, subjects, "n1", node.public_key)
    signers = EventSigners(fleet.bus, subjects)
    verdicts: list[str] = []

    async def on_event(msg: Msg) -> None:
        verdicts.append(await signers.verdict(msg))

    await fleet.bus.nc.subscribe(subjects.events("n1"), cb=on_event)
    await fleet.bus.nc.flush()
    body = b'{"ts": 1}'
    forged = dict(node.headers(b"other bytes"))
    for headers in (node.headers(body), operator.headers(body), None, forged):
        await fleet.bus.nc.publish(subjects.event("n1", "health"), body, headers=headers)
    await fleet.bus.nc.flush()
    await wait_for(lambda: len(verdicts) == 4)
    assert verdicts == [
        "node-claim",
        f"signed-by={operator.public_key}",
        "unsigned",
        "bad-signature",
    ]
