"""``node-agent status`` shows that the aggregators refuse the node's heartbeats."""

from __future__ import annotations

import msgspec

from actors.cli.node_status import render_status
from actors.node.standing import refusal_of
from tests.fleet.test_lifecycle_rules import accepted
from tests.support.fleet import heartbeat


def test_status_shows_the_refusal_line() -> None:
    """A /status document with ``refused`` renders a REFUSED line; without, none."""
    refused = "heartbeats refused by the aggregator: unknown_node"
    shown = render_status({"node": "n1", "seq": 3, "refused": refused})
    assert f"REFUSED   {refused}" in shown.splitlines()
    assert "REFUSED" not in render_status({"node": "n1", "seq": 3, "refused": ""})


def test_refusal_of_reads_the_record() -> None:
    """The node's own record says refused (its kind), forgotten by an operator, or nothing."""
    record = accepted(heartbeat(seq=1))
    assert refusal_of(None) == "" and refusal_of(record) == ""
    assert refusal_of(msgspec.structs.replace(record, refused="replay")) == "replay"
    forgotten = msgspec.structs.replace(record, deregistered=True, deregistered_by="UOP")
    assert refusal_of(forgotten) == "deregistered by an operator"
    itself = msgspec.structs.replace(record, deregistered=True, deregistered_by="node")
    assert refusal_of(itself) == ""
