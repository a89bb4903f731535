"""FLEET_HB's source watched: a source nats-server left stalled is set up again at once.

``FLEET_HB`` sources ``FLEET_HB_IN``. When the intake changes leader, FLEET_HB's leader
notices its source stalled at a 10 s health check and creates the source's consumer
again; every attempt that fails (the intake had no leader yet) adds 10 s to the wait
before the next (nats-server's ``calculateRetryBackoff``, up to two minutes). After a few
faults in a row every agent's heartbeats are stored in the intake while none reach
FLEET_HB for a minute or more: a CI fault round saw 71 s (docs/failure-detection.md,
item 3). Their TTL markers are held then (the intake says the nodes beat), so nobody is
called stale, but no heartbeat is judged either.

So the aggregator that holds partition 0 looks every :data:`CHECK_INTERVAL`: when
FLEET_HB's source has been silent for :data:`SOURCE_STALL` (its consumer sends a
heartbeat every second while it lives) while the intake stored new heartbeats since the
last look, it asks FLEET_HB's leader to step down. The new leader sets its sources up
within a second, with no backoff. At most once per :data:`STEPDOWN_SPACING`. A stream of
one replica has nobody to hand over to and is left alone. Owns nothing else.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import nats.errors
import nats.js.errors
from nats.js.api import StreamInfo

from actors.runtime.bus import Bus
from actors.runtime.schedule import stop_if_cancelled
from schemas.subjects import STREAM_HEARTBEAT_INTAKE, STREAM_HEARTBEATS, Subjects

log = logging.getLogger(__name__)

CHECK_INTERVAL = 5.0
"""Seconds between two looks at the streams."""
SOURCE_STALL = 20.0
"""Seconds FLEET_HB's source may stay silent, while the intake stores, before its leader
is asked to step down: two of nats-server's own stall checks (every 10 s), the first of
which retries at once; a source not back by then waits out a backoff. In the CI round
that failed (item 3), the intake stored again 39 s before FLEET_HB heard from it."""
STEPDOWN_SPACING = 60.0
"""Seconds at least between two step-downs asked by this aggregator."""
API_TIMEOUT = 2.0


def source_silent(info: StreamInfo) -> float | None:
    """Seconds since FLEET_HB last heard from its source, as its leader says (None: it has
    not heard from it since it became leader)."""
    sources = info.sources or []
    active = sources[0].active if sources else None
    if active is None or active < 0:
        return None
    return active / 1e9


def replicated(info: StreamInfo) -> bool:
    """Whether the stream has other replicas to take over its leadership."""
    return bool(info.cluster is not None and info.cluster.replicas)


class SourceWatch:
    """The watch of FLEET_HB's source; :meth:`run` looks while ``on_duty()`` (this
    aggregator holds partition 0)."""

    def __init__(
        self,
        bus: Bus,
        subjects: Subjects,
        on_duty: Callable[[], bool],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.bus = bus
        self.on_duty = on_duty
        self.clock = clock
        self.stream = subjects.stream_name(STREAM_HEARTBEATS)
        self.intake = subjects.stream_name(STREAM_HEARTBEAT_INTAKE)
        self._intake_seq = -1
        self._unheard_since: float | None = None
        """Monotonic time the watch first saw the source not heard from since its
        leader took over (nats-server reports no age then)."""
        self._last_stepdown = -STEPDOWN_SPACING

    async def run(self) -> None:
        while True:
            stop_if_cancelled()
            await asyncio.sleep(CHECK_INTERVAL)
            if not self.on_duty():
                self._intake_seq, self._unheard_since = -1, None
                continue
            try:
                await self.check()
            except (nats.errors.Error, TimeoutError) as exc:
                log.debug("heartbeat streams unreadable", extra={"reason": str(exc)})

    async def check(self) -> bool:
        """One look; True when FLEET_HB's leader was asked to step down."""
        async with asyncio.timeout(API_TIMEOUT):
            intake = await self.bus.js.stream_info(self.intake)
        async with asyncio.timeout(API_TIMEOUT):
            info = await self.bus.js.stream_info(self.stream)
        stored = self._intake_seq >= 0 and intake.state.last_seq != self._intake_seq
        self._intake_seq = intake.state.last_seq
        silent = self._silent_for(info)
        now = self.clock()
        if not (stored and silent >= SOURCE_STALL and replicated(info)):
            return False
        if now - self._last_stepdown < STEPDOWN_SPACING:
            return False
        self._last_stepdown = now
        leader = info.cluster.leader if info.cluster else ""
        log.warning(
            "FLEET_HB's source stalled while the intake stores; asking its leader to step down",
            extra={"stream": self.stream, "leader": leader, "silent_s": round(silent, 1)},
        )
        await self.step_down()
        self._unheard_since = None
        return True

    def _silent_for(self, info: StreamInfo) -> float:
        silent = source_silent(info)
        if silent is not None:
            self._unheard_since = None
            return silent
        now = self.clock()
        if self._unheard_since is None:
            self._unheard_since = now
        return now - self._unheard_since

    async def step_down(self) -> None:
        """Ask FLEET_HB's leader to step down (one request; a refusal is logged)."""
        subject = f"{self.bus.js_api_prefix}.STREAM.LEADER.STEPDOWN.{self.stream}"
        reply = await self.bus.request(subject, b"", timeout=API_TIMEOUT)
        if b'"error"' in reply.data:
            log.warning(
                "FLEET_HB's leader did not step down",
                extra={"reply": reply.data[:200].decode(errors="replace")},
            )
