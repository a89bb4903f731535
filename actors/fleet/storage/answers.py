"""A node's answers to one command, read from ``FLEET_EVENTS`` by one batched direct get
(no consumer): the remediation policy asks whether a node refused its cordon.

Only results on the node's own result subject, signed by its approved key and naming
the command (by id, or by the digest of the body sent: a rejection of a message whose
signer the node does not trust names no id) count; anything else there is ignored, so
nobody but the node can make the policy believe it refused.
"""

from __future__ import annotations

import datetime

from actors.runtime import direct_get
from actors.runtime.bus import Bus
from schemas import codec, signing
from schemas.errors import DecodeError, SignatureError
from schemas.messages import CommandResult
from schemas.subjects import STREAM_EVENTS, Subjects

READ_TIMEOUT = 5.0
"""Seconds one node's answers may take to read."""


def _start_time(since: float) -> str:
    stamp = datetime.datetime.fromtimestamp(since, datetime.UTC)
    return stamp.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


async def answers(
    bus: Bus,
    subjects: Subjects,
    cluster: str,
    node: str,
    key: str,
    since: float,
    command: tuple[str, str],
) -> list[CommandResult]:
    """The results ``node`` (in ``cluster``, its approved ``key``) stored since ``since``
    that answer ``command`` (its id, or none, and the digest of its body), oldest first;
    at most a page (the stream keeps ``results_per_node`` a node)."""
    command_id, digest = command
    asked = await direct_get.ask(
        bus,
        subjects.stream_name(STREAM_EVENTS),
        {"start_time": _start_time(since), "next_by_subj": subjects.result(cluster, node)},
    )
    page = await direct_get.read(asked, READ_TIMEOUT)
    found = []
    for stored in page.messages:
        try:
            if signing.verify(stored.headers, stored.data) != key:
                continue
            result = codec.decode(stored.data, CommandResult, stored.subject)
        except (SignatureError, DecodeError):
            continue
        same = (result.node_id, result.cluster) == (node, cluster)
        named = result.command_id in (command_id, "")
        if same and named and result.command_digest == digest:
            found.append(result)
    return found
