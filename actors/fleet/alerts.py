"""Publishing alerts with deterministic ids, so N aggregators never raise one twice."""

from __future__ import annotations

import logging
import time
from typing import Literal

import nats.errors

from actors.runtime.bus import PUBLISH_TIMEOUT, Bus
from schemas import codec
from schemas.messages import Alert, AlertKind
from schemas.subjects import Subjects

log = logging.getLogger(__name__)

Severity = Literal["info", "warning", "critical"]

SEVERITY: dict[AlertKind, Severity] = {
    "stale": "warning",
    "offline": "critical",
    "recovered": "info",
    "anomaly": "warning",
    "sequence_gap": "warning",
    "replay": "critical",
    "bad_signature": "critical",
    "unknown_node": "warning",
    "clock_skew": "warning",
    "health": "warning",
    "interruption": "critical",
    "deregistered": "info",
}


class AlertPublisher:
    def __init__(self, bus: Bus, subjects: Subjects) -> None:
        self.bus = bus
        self.subjects = subjects

    async def publish(
        self, kind: AlertKind, cluster: str, node: str, message: str, event: str, **details: str
    ) -> None:
        """``event`` names what happened (a stream or heartbeat sequence, a notice id), so
        the alert id ``kind:cluster:node:event`` — also its Nats-Msg-Id — is the same in
        every aggregator that sees it, and JetStream keeps one."""
        alert_id = f"{kind}:{cluster}:{node}:{event}"
        alert = Alert(
            id=alert_id,
            kind=kind,
            node_id=node,
            cluster=cluster,
            severity=SEVERITY[kind],
            message=message,
            ts=time.time(),
            details=details,
        )
        try:
            await self.bus.js.publish(
                self.subjects.alert(kind, cluster, node),
                codec.encode(alert),
                timeout=PUBLISH_TIMEOUT,
                headers={"Nats-Msg-Id": alert_id},
            )
        except (nats.errors.Error, TimeoutError) as exc:
            log.error("alert not published", extra={"alert": alert_id, "reason": str(exc)})
