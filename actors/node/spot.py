"""Spot watcher actor: turns a cloud's interruption notice into an ``Interruption`` event.

AWS (IMDSv2: token, spot instance-action, rebalance recommendation), GCP (``preempted`` and
``maintenance-event``, as hanging gets so a notice arrives at once) and Azure (Scheduled
Events: Preempt, Terminate; acknowledged once the node is drained, so Azure may proceed
early). Each distinct notice is published once. The metadata service is not trusted to be
well: 401, 404, 5xx, timeouts and refused connections are logged and retried with capped
backoff, never fatal. The command executor reacts to the event; this actor only watches.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from datetime import datetime
from email.utils import parsedate_to_datetime
from typing import Literal

import aiohttp
import nats.errors

from actors.node.cloud import (
    AZURE_API,
    AZURE_NAME_API,
    RETRYABLE,
    Metadata,
    MetadataError,
    Provider,
    require_ok,
)
from actors.node.config import AgentConfig
from actors.node.events import NodeEvents
from actors.node.tuning import retuned
from actors.runtime.bus import Bus
from actors.runtime.schedule import Backoff, wait_or_timeout
from actors.runtime.subscriptions import listening
from schemas.events import Event, Inject, Interruption, NodeState
from schemas.settings import Settings
from schemas.subjects import EVENT_CLOUD, EVENT_INTERRUPTION, Subjects

log = logging.getLogger(__name__)

Kind = Literal["terminate", "stop", "hibernate", "preempt", "rebalance", "maintenance"]

GCP_WAIT = 60
"""``timeout_sec`` of a GCP hanging get; the client waits a little longer."""
GCP_PREEMPT_NOTICE = 30.0
"""GCP stops a preempted VM about 30 s after the notice (no time is given)."""
GCP_MAINTENANCE_NOTICE = 60.0
"""GCP gives at least 60 s before host maintenance (no time is given)."""
AZURE_KINDS: dict[str, Kind] = {
    "Preempt": "preempt",
    "Terminate": "terminate",
    "Reboot": "maintenance",
    "Redeploy": "maintenance",
}
MAX_BACKOFF = 5.0


REHEARSED_PROVIDER: Provider = "aws"
"""The provider a rehearsal names on a node that watches no cloud: AWS, whose two-minute
spot notice ``node-agent inject spot --in 120s`` imitates."""


def rehearsal(inject: Inject, watched: Provider | None) -> Interruption:
    """The notice an operator's ``inject spot`` rehearses: a termination ``value``
    seconds after the inject was signed, from the cloud watched (else
    REHEARSED_PROVIDER), marked ``rehearsal``; handled as a real one (drain, hooks,
    deregistration), so rehearse on a node that may go."""
    return Interruption(
        ts=time.time(),
        provider=watched or REHEARSED_PROVIDER,
        kind="terminate",
        deadline=inject.ts + max(0.0, inject.value or 0.0),
        event_id=f"rehearsal-{inject.ts:.3f}",
        detail="rehearsal: node-agent inject spot",
        rehearsal=True,
    )


def _retry_delay(backoff: Backoff, exc: Exception) -> float:
    """The delay before the next try after ``exc``, logged with why."""
    delay = backoff.next()
    log.warning(
        "metadata service failed; retrying",
        extra={"reason": str(exc) or type(exc).__name__, "retry_in_s": delay},
    )
    return delay


def request_timeout(poll_interval: float) -> aiohttp.ClientTimeout:
    """A metadata request's bound: twice the poll interval, from half a second to two."""
    return aiohttp.ClientTimeout(total=max(0.5, min(2.0, 2 * poll_interval)))


class SpotActor:
    """Subscribes to fleet.evt.<node>.*; publishes Interruption on fleet.evt.<node>.interruption."""

    name = "spot"

    def __init__(self, config: AgentConfig, bus: Bus, events: NodeEvents) -> None:
        self.config = config
        self.bus = bus
        self.events = events
        self.subjects = Subjects(config.prefix)
        self.subject = self.subjects.event(config.node_id, EVENT_INTERRUPTION)
        self.facts_subject = self.subjects.event(config.node_id, EVENT_CLOUD)
        self.timeout = request_timeout(config.spot_poll_interval)
        self.metadata = Metadata(config, self.timeout)
        self.provider: Provider | None = None
        """The cloud watched, once known (configured, or found by ``auto``)."""
        self.published: set[str] = set()
        self.drained = False
        self._azure_unacked: set[str] = set()
        self._azure_vm = ""
        self._last_value: dict[str, str] = {}
        self._wake = asyncio.Event()

    async def run(self, ready: Callable[[], None]) -> None:
        routes = {
            self.subjects.events(self.config.node_id): self.events.decoding(
                self.name, self._on_event
            )
        }
        async with listening(self.bus, routes, ready):
            async with aiohttp.ClientSession() as session:
                provider = self.config.spot_provider
                if provider == "auto":
                    provider = await self.metadata.detect(session) or "none"
                if provider == "none":
                    await asyncio.Event().wait()  # nothing to watch; idle until stopped
                    return
                self.provider = provider
                base = self.metadata.base(provider)
                log.info("watching spot notices", extra={"provider": provider, "base": base})
                async with asyncio.TaskGroup() as group:
                    group.create_task(self._publish_facts(session, provider))
                    if provider == "aws":
                        await self._poll(lambda: self._aws(session))
                    elif provider == "azure":
                        await self._poll(lambda: self._azure(session, base))
                    else:
                        await asyncio.gather(
                            self._gcp_watch(session, base, "preempted"),
                            self._gcp_watch(session, base, "maintenance-event"),
                        )

    async def _poll(self, once: Callable[[], Awaitable[None]]) -> None:
        """Call ``once`` every poll interval; failures back off (capped) and retry."""
        backoff = self._backoff()
        while True:
            try:
                await once()
                delay = self.config.spot_poll_interval
                backoff.reset()
            except RETRYABLE as exc:
                delay = _retry_delay(backoff, exc)
            self._wake.clear()
            await wait_or_timeout(self._wake, delay)

    def _backoff(self) -> Backoff:
        """Failures retry after twice the poll interval, doubling up to MAX_BACKOFF; not
        jittered: each node asks only its own metadata service."""
        return Backoff(2 * self.config.spot_poll_interval, MAX_BACKOFF, spread=0.0)

    async def _publish(self, notice: Interruption) -> None:
        key = f"{notice.provider}:{notice.kind}:{notice.event_id}"
        if key in self.published:
            return
        log.warning(
            "interruption notice",
            extra={"provider": notice.provider, "kind": notice.kind, "deadline": notice.deadline},
        )
        try:
            await self.events.publish(self.bus, self.subject, notice)
        except nats.errors.Error as exc:
            log.warning("interruption not published; will retry", extra={"reason": str(exc)})
            return
        self.published.add(key)

    async def _on_event(self, event: Event) -> None:
        match event:
            case Inject(fault="spot"):
                await self._publish(rehearsal(event, self.provider))
            case NodeState():
                drained = event.schedulability == "drained"
                if drained and not self.drained:
                    self._wake.set()  # an Azure acknowledgement is due now, not at the next poll
                self.drained = drained
            case Settings():
                # The poll interval is read at each poll; requests are bounded by it.
                self.config = retuned(self.config, event)
                self.timeout = request_timeout(self.config.spot_poll_interval)
                self.metadata.timeout = self.timeout

    # Placement facts (labels) ----------------------------------------------------------

    async def _publish_facts(self, session: aiohttp.ClientSession, provider: Provider) -> None:
        """Read where this node runs once (retried with backoff until the metadata service
        answers) and publish it as CloudFacts, which the heartbeat turns into labels."""
        backoff = self._backoff()
        while True:
            try:
                facts = await self.metadata.facts(session, provider)
                await self.events.publish(self.bus, self.facts_subject, facts)
                log.info(
                    "cloud facts",
                    extra={"provider": provider, "region": facts.region, "zone": facts.zone},
                )
                return
            except (*RETRYABLE, nats.errors.Error) as exc:
                await asyncio.sleep(_retry_delay(backoff, exc))

    # AWS -------------------------------------------------------------------------------

    async def _aws(self, session: aiohttp.ClientSession) -> None:
        action = await self.metadata.aws_get(session, "spot/instance-action")
        if action is not None:
            kind = action["action"]
            if kind not in ("terminate", "stop", "hibernate"):
                raise MetadataError(f"unknown instance-action {kind!r}")
            await self._publish(
                Interruption(
                    ts=time.time(),
                    provider="aws",
                    kind=kind,
                    deadline=datetime.fromisoformat(action["time"]).timestamp(),
                    event_id=f"{kind}-{action['time']}",
                )
            )
        rebalance = await self.metadata.aws_get(session, "events/recommendations/rebalance")
        if rebalance is not None:
            await self._publish(
                Interruption(
                    ts=time.time(),
                    provider="aws",
                    kind="rebalance",
                    event_id=f"rebalance-{rebalance['noticeTime']}",
                )
            )

    # GCP -------------------------------------------------------------------------------

    async def _gcp_watch(self, session: aiohttp.ClientSession, base: str, key: str) -> None:
        """Read the value, then hang on it (``wait_for_change`` with ``last_etag``): the
        server answers as soon as it changes, or after ``timeout_sec`` with the same value."""
        url = f"{base}/computeMetadata/v1/instance/{key}"
        etag = ""
        backoff = self._backoff()
        hanging = aiohttp.ClientTimeout(total=GCP_WAIT + 5)
        while True:
            params = {"wait_for_change": "true", "timeout_sec": str(GCP_WAIT), "last_etag": etag}
            try:
                async with session.get(
                    url,
                    params=params if etag else None,
                    headers={"Metadata-Flavor": "Google"},
                    timeout=hanging if etag else self.timeout,
                ) as response:
                    require_ok(response, key)
                    value = (await response.text()).strip()
                    etag = response.headers.get("ETag", "")
                await self._gcp_value(key, value)
                backoff.reset()
                if not etag:
                    await asyncio.sleep(self.config.spot_poll_interval)  # no ETag: plain polling
            except RETRYABLE as exc:
                etag = ""
                await asyncio.sleep(_retry_delay(backoff, exc))

    async def _gcp_value(self, key: str, value: str) -> None:
        previous = self._last_value.get(key)
        self._last_value[key] = value
        if value == previous:
            return
        kind: Kind
        if key == "preempted" and value == "TRUE":
            kind, notice = "preempt", GCP_PREEMPT_NOTICE
        elif key == "maintenance-event" and value.startswith("TERMINATE_ON_HOST_MAINTENANCE"):
            kind, notice = "terminate", GCP_MAINTENANCE_NOTICE
        elif key == "maintenance-event" and value.startswith("MIGRATE_ON_HOST_MAINTENANCE"):
            kind, notice = "maintenance", GCP_MAINTENANCE_NOTICE
        else:
            return
        now = time.time()
        # GCP gives no event id: the moment the value changed names this notice.
        await self._publish(
            Interruption(
                ts=now,
                provider="gcp",
                kind=kind,
                deadline=now + notice,
                event_id=f"{key}-{now:.0f}",
                detail=value,
            )
        )

    # Azure -----------------------------------------------------------------------------

    async def _azure(self, session: aiohttp.ClientSession, base: str) -> None:
        url = f"{base}/metadata/scheduledevents?{AZURE_API}"
        headers = {"Metadata": "true"}
        if not self._azure_vm:
            # Events list every VM of an availability set; act only on those naming us.
            async with session.get(
                f"{base}/metadata/instance/compute/name?{AZURE_NAME_API}&format=text",
                headers=headers,
                timeout=self.timeout,
            ) as response:
                require_ok(response, "compute/name")
                self._azure_vm = (await response.text()).strip()
        async with session.get(url, headers=headers, timeout=self.timeout) as response:
            require_ok(response, "scheduledevents")
            document = json.loads(await response.text())
        for event in document.get("Events", []):
            kind = AZURE_KINDS.get(event.get("EventType", ""))
            if kind is None:
                continue  # Freeze: a pause of seconds, nothing to drain for
            if self._azure_vm not in event.get("Resources", [self._azure_vm]):
                continue
            not_before = event.get("NotBefore") or ""
            deadline = parsedate_to_datetime(not_before).timestamp() if not_before else time.time()
            event_id = str(event["EventId"])
            if kind != "maintenance" and f"azure:{kind}:{event_id}" not in self.published:
                self._azure_unacked.add(event_id)
            await self._publish(
                Interruption(
                    ts=time.time(),
                    provider="azure",
                    kind=kind,
                    deadline=deadline,
                    event_id=event_id,
                    detail=str(event.get("Description", ""))[:200],
                )
            )
        if self.drained and self._azure_unacked:
            # Drained: tell Azure it may go ahead now rather than wait for NotBefore.
            body = {"StartRequests": [{"EventId": e} for e in sorted(self._azure_unacked)]}
            async with session.post(
                url, json=body, headers=headers, timeout=self.timeout
            ) as response:
                require_ok(response, "scheduledevents ack")
            log.info("scheduled events acknowledged", extra={"events": sorted(self._azure_unacked)})
            self._azure_unacked.clear()
