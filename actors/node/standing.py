"""Standing actor: tells the node when the aggregators refuse its heartbeats.

A node whose heartbeats are refused (its key revoked or never approved, a replayed or
skewed seq, deregistered) would otherwise beat on, believing all is well. Aggregators note
the refusal kind in the node's record (``NodeRecord.refused``, rate-limited); this actor
reads the node's own record every few heartbeat intervals with one batched direct get
(:func:`kv.latest_value`, the read a node is allowed under deploy/nats/auth.conf), logs
"heartbeats refused by the aggregator: <kind>" when it starts or changes, and keeps it for
``/status`` and ``node-agent status``. It does not make ``/healthz`` fail: restarting the
agent (the systemd watchdog's answer) cannot fix a refusal, an operator must.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import nats.errors

from actors.node.config import AgentConfig
from actors.runtime import kv
from actors.runtime.bus import Bus
from actors.runtime.schedule import sleep_jittered
from schemas import codec
from schemas.errors import DecodeError
from schemas.messages import NodeRecord
from schemas.subjects import BUCKET_NODES, Subjects

log = logging.getLogger(__name__)

READ_EVERY = 3
"""Heartbeat intervals between two reads of the node's record."""
MIN_PERIOD = 1.0
KV_TIMEOUT = 5.0


def refusal_of(record: NodeRecord | None) -> str:
    """What the record says about this node's heartbeats being refused ("" if nothing)."""
    if record is None:
        return ""
    if record.refused:
        return record.refused
    if record.deregistered and record.deregistered_by not in ("", "node"):
        return "deregistered by an operator"
    return ""


class StandingActor:
    """Reads ``fleet_nodes/<node>``; publishes nothing, logs and exposes ``refused``."""

    name = "standing"

    def __init__(self, config: AgentConfig, bus: Bus) -> None:
        self.config = config
        self.bus = bus
        self.bucket = Subjects(config.prefix).bucket_name(BUCKET_NODES)
        self.refused = ""
        """The refusal kind the aggregators last noted; "" while heartbeats are accepted."""

    def message(self) -> str:
        """The line ``/status`` shows ("" when not refused)."""
        return f"heartbeats refused by the aggregator: {self.refused}" if self.refused else ""

    async def run(self, ready: Callable[[], None]) -> None:
        ready()
        period = max(MIN_PERIOD, READ_EVERY * self.config.heartbeat_interval)
        while True:
            # First a period: nothing is refused before the first heartbeats are judged.
            await sleep_jittered(period)
            await self.check()

    async def check(self) -> None:
        """Read the record once and report a change."""
        node = self.config.node_id
        try:
            value = await kv.latest_value(self.bus, self.bucket, node, KV_TIMEOUT)
            record = None if value is None else codec.decode(value, NodeRecord, f"key {node}")
        except (nats.errors.Error, TimeoutError, DecodeError) as exc:
            log.debug("own record not read", extra={"node": node, "reason": str(exc)})
            return
        refused = refusal_of(record)
        if refused == self.refused:
            return
        self.refused = refused
        if refused:
            log.warning(self.message(), extra={"node": node, "kind": refused})
        else:
            log.info("heartbeats accepted by the aggregator again", extra={"node": node})
