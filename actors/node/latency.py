"""Latency actor: answers peers' probes and measures round trips to peers and to NATS.

Placement and routing want to know how far a node is from its neighbours and whether the
path drops messages. Every agent answers ``fleet.probe.<node>``; this actor also probes its
peers (configured, or up to ``max_peers`` nodes of its own cluster from ``fleet_nodes``)
concurrently, each bounded by ``probe_timeout``, and keeps loss over a sliding window.
It runs beside the heartbeat, never in its path: a silent peer costs one timeout here.
Its peers, interval and timeout follow the fleet's live settings (``settings`` events).

A probe counts as lost only when the path is to blame. One that timed out is first given
its last chance: a round trip to the server (whose answer comes after anything the server
sent us before it) and a short wait for our own callback. It is then not judged at all
(neither answered nor lost) when this node's bus was down (the bus outage is one event of
its own, not a loss per peer) or when this agent's own loop was busy: the timeout fired
more than ``BUSY_LATE`` late, so an answer may have been waiting unread.

Each probe waits on an inbox of its own, ``_INBOX.<us>.probe.<peer>.<token>``: under the
shipped permissions only that peer may publish there (and only we may read), the token is
random, and an answer counts only with the probe's nonce and the peer's name. Answers
go only to such inboxes naming this node as the responder, at most
``ANSWERS_PER_ASKER`` a second to one asker and ``ANSWERS_PER_SECOND`` in all, so this
node is no reflector.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import secrets
import time
from collections import deque
from collections.abc import Callable
from typing import Literal

import nats.errors
from nats.aio.msg import Msg

from actors.node.config import AgentConfig
from actors.node.events import NodeEvents
from actors.node.tuning import retuned
from actors.runtime import kv
from actors.runtime.bus import Bus
from actors.runtime.schedule import RateLimit, sleep_jittered
from actors.runtime.subscriptions import listening, unsubscribe_quietly
from schemas import codec
from schemas.errors import DecodeError
from schemas.events import Event, Latency, PeerLatency
from schemas.messages import NodeRecord, Probe, ProbeReply
from schemas.settings import Settings
from schemas.subjects import (
    BUCKET_NODES,
    EVENT_LATENCY,
    EVENT_SETTINGS,
    Subjects,
    probe_reply,
    probe_reply_responder,
)

log = logging.getLogger(__name__)

LOSS_WINDOW = 20
"""Loss is the share of the last 20 probes to a peer that got no answer."""
DISCOVER_EVERY = 6
"""Re-read the peer list from fleet_nodes every 6 rounds: reading every record is not free."""
KV_TIMEOUT = 5.0
DISCOVER_LIMIT = 4096
"""Discovery reads at most 4,096 records (a fleet larger than that is seen in part)."""
NOT_PEERS = {"pending", "offline", "deregistered", "stale", "stopped"}
"""States whose nodes cannot answer (or are not admitted): probing them is no measure."""
BUSY_LATE = 0.25
"""Seconds a probe's timeout may fire late before this agent's loop counts as too busy
to have read the answer in time (the probe is then not judged)."""
CALLBACK_GRACE = 0.05
"""Seconds a timed-out probe waits, after a round trip to the server, for our callback."""
Outcome = int | Literal["lost", "unjudged"]
"""A probe's round trip in microseconds, ``lost``, or ``unjudged`` (see the module doc)."""
ANSWERS_PER_ASKER = 10
"""Probes answered per second to one asker (an honest one probes us once a round)."""
ANSWERS_PER_SECOND = 500
"""Probes answered per second in all; the rest are dropped unanswered."""


class LatencyActor:
    """Answers fleet.probe.<node>, subscribes to fleet.evt.<node>.settings; publishes
    Latency on fleet.evt.<node>.latency."""

    name = "latency"

    def __init__(self, config: AgentConfig, bus: Bus, events: NodeEvents) -> None:
        self.config = config
        self.bus = bus
        self.events = events
        self.subjects = Subjects(config.prefix)
        self.subject = self.subjects.event(config.node_id, EVENT_LATENCY)
        self.peers: list[str] = list(config.peers)
        # Per peer: True for an answered probe, False for a lost one, newest last.
        self.windows: dict[str, deque[bool]] = {}
        self.answers = RateLimit(ANSWERS_PER_SECOND, 1.0)
        self.answers_per_asker = RateLimit(ANSWERS_PER_ASKER, 1.0)

    async def _answer(self, msg: Msg) -> None:
        # The reply subject is the sender's choice: answering anything but a probe inbox
        # naming us would let any client make this node publish under its name (a probe
        # with reply ``$KV.fleet_trust.<node>`` once rewrote another node's trust entry).
        if probe_reply_responder(msg.reply) != self.config.node_id:
            log.debug("ignoring probe without a probe inbox reply", extra={"reply": msg.reply})
            return
        asker = msg.reply.split(".")[1]
        if not (self.answers.allow() and self.answers_per_asker.allow(asker)):
            return
        try:
            probe = codec.decode(msg.data, Probe, msg.subject)
        except DecodeError as exc:
            log.debug("ignoring malformed probe", extra={"reason": str(exc)})
            return
        reply = ProbeReply(
            node_id=self.config.node_id,
            nonce=probe.nonce,
            sent_at=probe.sent_at,
            replied_at=time.time(),
        )
        await msg.respond(codec.encode(reply))

    async def discover(self) -> list[str]:
        """Up to ``max_peers`` live nodes of our cluster; the same ones while they stay.

        Every record of fleet_nodes comes in one batched direct get (no consumer is created,
        see :func:`kv.latest_values`). Only admitted, reachable nodes are peers: ``pending``
        ones are anyone's self-signed registrations, offline or deregistered ones would
        only time out. Ordered by a hash of (us, them), so every node picks a different
        subset of a large cluster instead of all probing the alphabetically first few.
        """
        try:
            values = await kv.latest_values(
                self.bus, self.subjects.bucket_name(BUCKET_NODES), DISCOVER_LIMIT, KV_TIMEOUT
            )
        except (nats.errors.Error, TimeoutError) as exc:
            log.debug("peer discovery failed", extra={"reason": str(exc) or type(exc).__name__})
            return self.peers
        me = self.config.node_id
        found = []
        for node, value in values.items():
            try:
                peer = codec.decode(value, NodeRecord, f"key {node}")
            except DecodeError:
                continue
            if (
                node != me
                and peer.node_id == node
                and peer.cluster == self.config.cluster
                and peer.state not in NOT_PEERS
            ):
                found.append(node)
        found.sort(key=lambda node: hashlib.sha256(f"{me}:{node}".encode()).digest())
        return found[: self.config.max_peers]

    async def probe_peer(self, node: str) -> Outcome:
        """Round trip in microseconds, ``lost`` when no valid answer came in time (after
        its last chance), or ``unjudged`` (module doc). Anything else on the probe's inbox
        (a wrong nonce or name, a malformed body) is ignored and the probe keeps waiting
        for its answer."""
        nonce = secrets.token_hex(16)
        inbox = probe_reply(self.config.node_id, node, nonce)
        body = codec.encode(Probe(from_node=self.config.node_id, nonce=nonce, sent_at=time.time()))
        answered: asyncio.Future[float] = asyncio.get_running_loop().create_future()

        async def on_reply(msg: Msg) -> None:
            try:
                reply = codec.decode(msg.data, ProbeReply, msg.subject)
            except DecodeError:
                return
            if reply.nonce == nonce and reply.node_id == node and not answered.done():
                answered.set_result(time.perf_counter())

        try:
            subscription = await self.bus.subscribe(inbox, on_reply)
        except nats.errors.Error:
            return "unjudged" if not self.bus.connected else "lost"
        start = time.perf_counter()
        try:
            await self.bus.publish(self.subjects.probe(node), body, reply=inbox)
            async with asyncio.timeout(self.config.probe_timeout):
                return round((await asyncio.shield(answered) - start) * 1e6)
        except (nats.errors.Error, TimeoutError):
            late = time.perf_counter() - start - self.config.probe_timeout
            return await self._last_chance(answered, start, late)
        finally:
            await unsubscribe_quietly(subscription)

    async def _last_chance(
        self, answered: asyncio.Future[float], start: float, late: float
    ) -> Outcome:
        """A timed-out probe's verdict: answered after all, lost, or not judged."""
        try:
            await self.bus.flush(self.config.probe_timeout)
            async with asyncio.timeout(CALLBACK_GRACE):
                await asyncio.shield(answered)
        except (nats.errors.Error, TimeoutError):
            pass
        if answered.done():
            return round((answered.result() - start) * 1e6)
        if not self.bus.connected or late > BUSY_LATE:
            return "unjudged"
        return "lost"

    async def gateway_rtt(self) -> int | None:
        try:
            return round(await self.bus.rtt(self.config.probe_timeout) * 1e6)
        except (nats.errors.Error, TimeoutError):
            return None

    async def measure(self) -> Latency:
        """One round: NATS and every peer at once, so the round lasts one timeout at most."""
        peers = self.peers
        async with asyncio.TaskGroup() as group:
            gateway_rtt = group.create_task(self.gateway_rtt())
            probes = [group.create_task(self.probe_peer(peer)) for peer in peers]
        gateway, outcomes = gateway_rtt.result(), [probe.result() for probe in probes]
        now = time.time()
        self.windows = {peer: self.windows.get(peer, deque(maxlen=LOSS_WINDOW)) for peer in peers}
        results = []
        for peer, outcome in zip(peers, outcomes, strict=True):
            window = self.windows[peer]
            if outcome != "unjudged":
                window.append(outcome != "lost")
            results.append(
                PeerLatency(
                    target_node_id=peer,
                    rtt_us=outcome if isinstance(outcome, int) else None,
                    loss_pct=_loss(window),
                    measured_at=now,
                )
            )
        answered = [outcome for outcome in outcomes if isinstance(outcome, int)]
        every_probe = [ok for window in self.windows.values() for ok in window]
        return Latency(
            ts=now,
            peers=results,
            gateway_rtt_us=gateway,
            avg_peer_rtt_us=round(sum(answered) / len(answered)) if answered else None,
            loss_pct=_loss(every_probe),
        )

    async def _on_settings(self, event: Event) -> None:
        """The fleet's probe targets and timing (read at each round)."""
        if not isinstance(event, Settings):
            return
        config = retuned(self.config, event)
        if config is not self.config:
            if config.peers != self.config.peers or config.max_peers != self.config.max_peers:
                self.peers = list(config.peers)  # none: discovered again at the next round
            self.config = config

    async def run(self, ready: Callable[[], None]) -> None:
        routes = {
            self.subjects.probe(self.config.node_id): self._answer,
            self.subjects.event(self.config.node_id, EVENT_SETTINGS): self.events.decoding(
                self.name, self._on_settings
            ),
        }
        async with listening(self.bus, routes, ready):
            rounds = 0
            while True:
                # Look again soon while alone: peers may simply not have registered yet.
                if not self.config.peers and (not self.peers or rounds % DISCOVER_EVERY == 0):
                    self.peers = await self.discover()
                rounds += 1
                latency = await self.measure()
                await self.events.publish(self.bus, self.subject, latency)
                await sleep_jittered(self.config.probe_interval)


def _loss(outcomes: deque[bool] | list[bool]) -> float:
    if not outcomes:
        return 0.0
    return round(100.0 * sum(1 for ok in outcomes if not ok) / len(outcomes), 1)
