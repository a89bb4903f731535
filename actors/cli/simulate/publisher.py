"""The simulated nodes of ``fleetctl simulate`` and their publisher, used by the parent
process and by every worker (``actors.cli.simulate.worker``).

Each simulated node has an in-memory key pair, approved in ``fleet_trust``, and a
heartbeat as big as a real one (a Sample of fake GPUs, a scored Health, the labels an
agent finds for those GPUs, the settings status of an agent the fleet sets nothing for,
the time it started). Its body is encoded once and cut at the marker values for ``seq``
and ``ts``; a beat joins the pieces around the real ones, signs the bytes and publishes
them with JetStream's asynchronous publish. Beats are spread evenly over the run at a
total rate and sent in bursts of one tick (``TICK``) without yielding to the event loop
in between, so nats-py writes a burst with one socket send instead of one per beat (a
send per beat was the simulator's limit).
"""

from __future__ import annotations

import asyncio
import base64
import math
import time

import msgspec
from nats.aio.msg import Msg

from actors.fleet.storage import registry
from actors.node.health import checks, scoring
from actors.node.inventory.actor import fingerprint
from actors.node.inventory.fake_gpus import FakeGpus
from actors.node.labels import found_labels
from actors.runtime.bus import PUBLISH_TIMEOUT, Bus
from actors.runtime.subscriptions import unsubscribe_quietly
from schemas import signing
from schemas.errors import FleetError
from schemas.events import Capacity, Health, Jobs, Latency, Sample, SpotStatus
from schemas.messages import Heartbeat
from schemas.settings import SettingsStatus
from schemas.subjects import Subjects
from schemas.version import AGENT_VERSION

SEQ_MARK = 987654321987654
TS_MARK = 1111111111.0625
"""Marker values no real beat carries; both encode exactly, so they can be replaced."""
APPROVE_CHUNK = 100
SEQ_BLOCK = 1000
"""Seqs skipped by a node the aggregators already know (an agent's reserved block)."""
TICK = 0.01
"""Beats due within one tick are published as one burst (one socket write)."""
MAX_IN_FLIGHT = 4000
"""Unacknowledged publishes at most: beyond it the publisher waits for the acks."""


class SimOptions(msgspec.Struct, frozen=True, kw_only=True):
    nodes: int
    rate: float
    duration: float
    cluster: str = "sim"
    gpus: int = 8
    prefix: str = "fleet"
    wait: float = 60.0
    """How long to wait, after the last publish, for the records to catch up."""
    kill: int = 0
    """Nodes that stop beating at once half way through (a stale storm)."""
    min_stale_after: float = 30.0
    """The least ``stale_after`` (tests use less, to see a storm in seconds)."""
    processes: int = 1
    """Worker processes that sign and publish (each every P-th node); 1: this process."""

    @property
    def interval(self) -> float:
        """Each node's heartbeat period: N nodes at R beats/s in all."""
        return self.nodes / self.rate

    @property
    def stale_after(self) -> float:
        """Three periods, as agents use, but never below their default of 30 s."""
        return max(self.min_stale_after, 3 * self.interval)

    @property
    def total(self) -> int:
        """Heartbeats of the whole run, all nodes together."""
        return max(1, round(self.rate * self.duration))

    def beats_of(self, index: int) -> int:
        """Heartbeats of node ``index``: the run's beats go round the nodes in order."""
        return self.total // self.nodes + (1 if index < self.total % self.nodes else 0)


def template(node: str, options: SimOptions, boot_id: str) -> bytes:
    """The node's heartbeat, encoded, with SEQ_MARK and TS_MARK where seq and ts go; its
    agent started now."""
    gpus = options.gpus
    devices = FakeGpus(gpus, node).read()
    sample = Sample(
        ts=TS_MARK,
        capacity=Capacity(
            cpu_cores=96,
            cpu_percent=23.5,
            load_avg_1m=11.2,
            memory_total=2 * 1024**4,
            memory_available=1536 * 1024**3,
            gpus_total=gpus,
            gpus_available=gpus,
            storage_total=30 * 1024**4,
            storage_available=21 * 1024**4,
        ),
        gpus=devices,
        gpu_source="fake",
        fingerprint=fingerprint(devices),
        hostname=node,
    )
    latency = Latency(ts=TS_MARK, gateway_rtt_us=450)
    components = [
        scoring.engine_component(None, 0, ""),
        scoring.temperature_component(sample, ""),
        scoring.vram_component(sample, ""),
        scoring.cpu_component(sample, ""),
        scoring.latency_component(latency, ""),
    ]
    score = sum(component.points for component in components)
    found = [checks.boot_check(sample, gpus), checks.nvml_check(sample)]
    health = Health(
        ts=TS_MARK,
        status=checks.overall([scoring.score_check(score), *found]),
        score=score,
        components=components,
        checks=found,
    )
    heartbeat = Heartbeat(
        node_id=node,
        cluster=options.cluster,
        seq=SEQ_MARK,
        boot_id=boot_id,
        ts=TS_MARK,
        agent_version=AGENT_VERSION,
        interval=options.interval,
        stale_after=options.stale_after,
        sample=sample,
        health=health,
        latency=latency,
        jobs=Jobs(),
        spot=SpotStatus(),
        labels=found_labels(sample, {}),
        settings=SettingsStatus(),
        started=time.time(),
    )
    return msgspec.json.encode(heartbeat)


def node_id(index: int) -> str:
    return f"sim-{index:05d}"


class SimNode:
    __slots__ = (
        *("after_seq", "before_seq", "index", "key", "msg_id", "node_id", "seq"),
        *("subject", "ttl"),
    )

    def __init__(self, index: int, subjects: Subjects, options: SimOptions, boot: str) -> None:
        self.index = index
        self.node_id = node_id(index)
        self.key = signing.KeyPair.generate()
        self.subject = subjects.heartbeat(options.cluster, self.node_id)
        body = template(self.node_id, options, boot)
        # Cut once at the markers: a beat is three joins, not a search of 4 KB twice.
        before, after = body.split(b"%d" % SEQ_MARK)
        ts_mark = repr(TS_MARK).encode()
        self.before_seq = before.split(ts_mark)
        self.after_seq = after.split(ts_mark)
        self.msg_id = f"{self.node_id}:{boot}:"
        self.ttl = str(math.ceil(options.stale_after))
        self.seq = 0

    def beat(self, ts: bytes) -> tuple[bytes, dict[str, str]]:
        """The next heartbeat's body and headers (signature, Nats-Msg-Id, Nats-TTL)."""
        self.seq += 1
        body = b"".join((ts.join(self.before_seq), b"%d" % self.seq, ts.join(self.after_seq)))
        headers = {
            signing.HEADER_KEY: self.key.public_key,
            signing.HEADER_SIG: base64.b64encode(self.key.sign(body)).decode(),
            "Nats-Msg-Id": f"{self.msg_id}{self.seq}",
            "Nats-TTL": self.ttl,
        }
        return body, headers


class SliceResult(msgspec.Struct, kw_only=True):
    """What one publisher (this process or a worker) did."""

    published: int = 0
    failed: int = 0
    first_at: float = 0.0
    """Wall clock of the first publish (workers share the clock of one machine)."""
    last_at: float = 0.0
    last_seq: dict[str, int] = {}
    """Each node's last seq published."""
    killed: dict[str, float] = {}
    """Each node stopped half way (``--kill``): the ts of its last heartbeat."""


async def build_nodes(bus: Bus, options: SimOptions, indices: range, boot: str) -> list[SimNode]:
    """The nodes, each approved in ``fleet_trust`` (a chunk at a time)."""
    subjects = Subjects(options.prefix)
    nodes = [SimNode(index, subjects, options, boot) for index in indices]
    for first in range(0, len(nodes), APPROVE_CHUNK):
        await asyncio.gather(
            *(
                registry.approve(bus, subjects, n.node_id, n.key.public_key, "fleetctl simulate")
                for n in nodes[first : first + APPROVE_CHUNK]
            )
        )
    return nodes


def start_seqs(nodes: list[str], seen: dict[str, int]) -> list[int]:
    """A node the aggregators already know continues its sequence past a reserved block,
    as a restarted agent does: fleet_nodes may be a checkpoint behind the last seq the
    aggregator accepted."""
    return [seen[node] + SEQ_BLOCK if seen[node] else 0 for node in nodes]


class Acks:
    """JetStream's acknowledgements of one publisher's beats, all sent to one reply subject
    and only counted: no future, token or JSON decode per beat, as nats-py's
    ``publish_async`` makes (they were a third of a beat's CPU)."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.inbox = bus.new_inbox()
        self.sent = 0
        self.acked = 0
        self.failed = 0
        self.settled = asyncio.Event()
        self.settled.set()

    @property
    def in_flight(self) -> int:
        return self.sent - self.acked

    async def publish(self, subject: str, body: bytes, headers: dict[str, str]) -> None:
        # nats-py's publish only appends to its buffer: a burst leaves as one socket write.
        await self.bus.publish(subject, body, headers, reply=self.inbox)
        self.sent += 1
        self.settled.clear()

    async def on_ack(self, msg: Msg) -> None:
        self.acked += 1
        # A PubAck is {"stream":...,"seq":...}; an error {"error":...}; no stream: a
        # no-responders status without a body.
        if not msg.data.startswith(b"{") or b'"error"' in msg.data:
            self.failed += 1
        if self.acked >= self.sent:
            self.settled.set()

    async def wait(self, timeout: float) -> bool:
        """True once every beat sent is acknowledged; False after ``timeout``."""
        try:
            async with asyncio.timeout(timeout):
                await self.settled.wait()
        except TimeoutError:
            return False
        return True


async def publish_slice(
    bus: Bus, options: SimOptions, nodes: list[SimNode], start_at: float
) -> SliceResult:
    """Publish these nodes' share of the run from ``start_at`` (wall clock) on, at their
    share of the rate; stop the killed ones (index < ``kill``) half way."""
    total = sum(options.beats_of(node.index) for node in nodes)
    result = SliceResult(last_seq={}, killed={})
    if total == 0:
        return result
    acks = Acks(bus)
    subscription = await bus.subscribe(acks.inbox, acks.on_ack)
    try:
        await _publish(bus, options, nodes, start_at, total, acks, result)
    finally:
        await unsubscribe_quietly(subscription)
    result.published = acks.sent
    result.failed = acks.failed + acks.in_flight
    result.last_seq = {node.node_id: node.seq for node in nodes}
    return result


async def _publish(
    bus: Bus,
    options: SimOptions,
    nodes: list[SimNode],
    start_at: float,
    total: int,
    acks: Acks,
    result: SliceResult,
) -> None:
    rate = options.rate * total / options.total
    last_ts: dict[str, float] = {}
    await bus.flush()  # the ack subscription is in place before the first beat
    await asyncio.sleep(max(0.0, start_at - time.time()))
    start = time.monotonic()
    result.first_at = time.time()
    sent = 0
    killed: set[str] = set()
    stopped = False
    while sent < total:
        due = min(total, int((time.monotonic() - start + TICK) * rate) + 1)
        now = time.time()
        ts = b"%.6f" % now
        if options.kill and not stopped and sent >= total // 2:
            stopped = True
            killed = {node.node_id for node in nodes if node.index < options.kill}
            result.killed = {node: last_ts.get(node, 0.0) for node in killed}
        if acks.in_flight + due - sent > MAX_IN_FLIGHT and not await acks.wait(PUBLISH_TIMEOUT):
            raise FleetError(
                f"simulate: {acks.in_flight} heartbeats unacknowledged for "
                f"{PUBLISH_TIMEOUT:g}s; the server is not keeping up"
            )
        # No await in this burst yields to the event loop, so it leaves as one socket write.
        while sent < due:
            node = nodes[sent % len(nodes)]
            sent += 1
            if node.node_id in killed:
                continue
            if node.index < options.kill:
                last_ts[node.node_id] = now
            body, headers = node.beat(ts)
            await acks.publish(node.subject, body, headers)
        await asyncio.sleep(max(TICK, start + sent / rate - time.monotonic()))
    result.last_at = time.time()
    await acks.wait(PUBLISH_TIMEOUT)
