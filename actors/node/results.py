"""The node's answers to commands: signed ``CommandResult`` messages on
``fleet.result.<cluster>.<node>`` (FLEET_EVENTS), published one way for the commands actor
and the workload actor.

A result's ``Nats-Msg-Id`` is ``<command id>:<status>:<n>`` (the refused message's digest
stands in for an id the node could not read), ``n`` counting that command's results of
that status: the stream drops a copy sent twice, never a second report of progress. A
final status (:data:`schemas.messages.FINAL_STATUSES`) ends the command's counts. The
detail is cut to the wire's bound for free text.

A result the stream does not acknowledge (its leader being elected, the server cut off
and the connection moving) is sent again, under the same ``Nats-Msg-Id`` (a copy stored
but not acknowledged is dropped, never doubled), up to :data:`RESULT_TRIES` times; only
then is it logged as not published."""

from __future__ import annotations

import asyncio
import logging
import time

import nats.errors

from actors.node.config import AgentConfig
from actors.runtime.bus import Bus, publish_signed
from schemas.base import MAX_TEXT, Schedulability
from schemas.messages import FINAL_STATUSES, CommandResult, CommandStatus
from schemas.signing import KeyPair
from schemas.subjects import Subjects

log = logging.getLogger(__name__)

RESULT_TRIES = 4
RESULT_RETRY_AFTER = 1.0
"""A result the stream does not acknowledge is sent again after 1, 2, 3 s: about 26 s in
all with the publishes' own timeouts, in which a fault of one server has passed."""


class ResultPublisher:
    """Signs and publishes one node's command results, sent again while not acknowledged;
    a failure then is logged, not raised."""

    def __init__(self, config: AgentConfig, bus: Bus, key: KeyPair) -> None:
        self.bus = bus
        self.key = key
        self.node_id = config.node_id
        self.cluster = config.cluster
        self.subject = Subjects(config.prefix).result(config.cluster, config.node_id)
        self._counts: dict[tuple[str, str], int] = {}

    async def publish(
        self,
        command_id: str,
        status: CommandStatus,
        detail: str,
        *,
        digest: str,
        schedulability: Schedulability,
        in_flight: int | None = None,
        jobs_running: int | None = None,
        signer: str = "",
        claimed_id: str = "",
        placed: int | None = None,
    ) -> None:
        """Publish ``command_id``'s result (``digest``: of the command body it answers)
        with the node's ``schedulability`` now, sent again while it is not acknowledged
        (:data:`RESULT_TRIES`)."""
        n = self._counts[command_id, status] = self._counts.get((command_id, status), 0) + 1
        if status in FINAL_STATUSES:
            for other in ("accepted", "in_progress", status):
                self._counts.pop((command_id, other), None)
        result = CommandResult(
            command_id=command_id,
            node_id=self.node_id,
            cluster=self.cluster,
            status=status,
            ts=time.time(),
            detail=detail[:MAX_TEXT],
            schedulability=schedulability,
            in_flight=in_flight,
            command_digest=digest,
            jobs_running=jobs_running,
            signer=signer,
            claimed_id=claimed_id,
            placed=placed,
        )
        msg_id = f"{command_id or digest}:{status}:{n}"
        for attempt in range(1, RESULT_TRIES + 1):
            try:
                await publish_signed(self.bus, self.subject, result, self.key, msg_id)
                return
            except (nats.errors.Error, TimeoutError) as exc:
                reason = str(exc) or type(exc).__name__
                if attempt == RESULT_TRIES:
                    log.error(
                        "command result not published",
                        extra={"id": command_id, "status": status, "reason": reason},
                    )
                    return
                # Sent again under the same Nats-Msg-Id: a copy stored but not
                # acknowledged is dropped, never doubled.
                log.warning(
                    "command result not acknowledged; sending it again",
                    extra={"id": command_id, "status": status, "reason": reason},
                )
                await asyncio.sleep(RESULT_RETRY_AFTER * attempt)
