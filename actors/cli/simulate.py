"""``fleetctl simulate``: N signed-heartbeat nodes from one process, to load-test aggregators.

Each simulated node has an in-memory key pair, approved in ``fleet_trust``, and a
heartbeat as big as a real one (a Sample of fake GPUs, a scored Health). Its body is
encoded once with marker values for ``seq`` and ``ts``; a beat only splices in the real
ones, signs the bytes and publishes them with JetStream's asynchronous publish, so the
client is not what limits the rate. Beats are spread evenly over the run at a total rate.
A KV watch of ``fleet_nodes`` shows when every node's record carries its last seq.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
import uuid
from typing import TextIO

import msgspec
import nats.js.errors
from nats.aio.msg import Msg
from nats.js.api import PubAck
from nats.js.kv import KeyValue

from actors.fleet import registry
from actors.node.health import checks, scoring
from actors.node.inventory.actor import fingerprint
from actors.node.inventory.fake_gpus import FakeGpus
from actors.runtime import kv
from actors.runtime.bus import PUBLISH_TIMEOUT, Bus, NotProvisioned, unsubscribe_quietly
from schemas import codec, signing
from schemas.errors import DecodeError
from schemas.events import Capacity, Health, Jobs, Latency, Sample, SpotStatus
from schemas.messages import AGENT_VERSION, Alert, Heartbeat
from schemas.subjects import BUCKET_NODES, STREAM_ALERTS, STREAM_HEARTBEATS, Subjects

SEQ_MARK = 987654321987654
TS_MARK = 1111111111.0625
"""Marker values no real beat carries; both encode exactly, so they can be replaced."""
APPROVE_CHUNK = 100
SEQ_BLOCK = 1000
"""Seqs skipped by a node the aggregators already know (an agent's reserved block)."""


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

    @property
    def interval(self) -> float:
        """Each node's heartbeat period: N nodes at R beats/s in all."""
        return self.nodes / self.rate

    @property
    def stale_after(self) -> float:
        """Three periods, as agents use, but never below their default of 30 s."""
        return max(self.min_stale_after, 3 * self.interval)


def template(node: str, options: SimOptions, boot_id: str) -> bytes:
    """The node's heartbeat, encoded, with SEQ_MARK and TS_MARK where seq and ts go."""
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
    )
    return msgspec.json.encode(heartbeat)


class SimNode:
    __slots__ = ("key", "node_id", "seq", "subject", "template", "ttl")

    def __init__(self, node_id: str, subjects: Subjects, options: SimOptions, boot: str) -> None:
        self.node_id = node_id
        self.key = signing.KeyPair.generate()
        self.subject = subjects.heartbeat(options.cluster, node_id)
        self.template = template(node_id, options, boot)
        self.ttl = str(math.ceil(options.stale_after))
        self.seq = 0

    def beat(self, ts: bytes, boot: str) -> tuple[bytes, dict[str, str]]:
        """The next heartbeat's body and headers (signature, Nats-Msg-Id, Nats-TTL)."""
        self.seq += 1
        body = self.template.replace(b"%d" % SEQ_MARK, b"%d" % self.seq).replace(
            repr(TS_MARK).encode(), ts
        )
        headers = self.key.headers(body)
        headers["Nats-Msg-Id"] = f"{self.node_id}:{boot}:{self.seq}"
        headers["Nats-TTL"] = self.ttl
        return body, headers


class _Progress(msgspec.Struct):
    """The two NodeRecord fields progress needs: decoding only them keeps the watch cheap."""

    last_seq: int = 0
    boot_id: str = ""


class Progress:
    """Follows ``fleet_nodes``: each simulated node's last seq, and when all are current."""

    def __init__(self, nodes: list[str], boot: str) -> None:
        self.boot = boot
        self.seen = dict.fromkeys(nodes, 0)
        self.updates = 0
        self.synced = asyncio.Event()
        self.caught_up = asyncio.Event()
        self.caught_up_at = 0.0
        self.targets: dict[str, int] = {}
        self.behind: set[str] = set()
        self.first_sent: dict[str, float] = {}
        """Each node's first heartbeat of this run: when it was sent (its ``ts``)."""
        self.latencies: list[float] = []
        """Publish-to-record seconds of each node's first heartbeat of this run (a new
        boot is a state change, so the aggregator writes it at once, not at a checkpoint)."""

    async def follow(self, bucket: KeyValue) -> None:
        await kv.follow(bucket, _Progress, self._on_change, self.synced.set)

    def _on_change(self, node: str, found: _Progress | None) -> None:
        if node not in self.seen or found is None:
            return
        previous = self.seen[node]
        self.seen[node] = found.last_seq
        if found.boot_id == self.boot and self.synced.is_set():
            self.updates += 1
            sent = self.first_sent.pop(node, None)
            if sent is not None and found.last_seq != previous:
                self.latencies.append(max(0.0, time.time() - sent))
        if node in self.behind and found.last_seq >= self.targets[node]:
            self._done(node)

    def expect(self, targets: dict[str, int]) -> None:
        self.targets = targets
        self.behind = {node for node, seq in targets.items() if self.seen[node] < seq}
        if not self.behind:
            self._done(None)

    def _done(self, node: str | None) -> None:
        self.behind.discard(node or "")
        if not self.behind and not self.caught_up.is_set():
            self.caught_up_at = time.monotonic()
            self.caught_up.set()


async def simulate(bus: Bus, options: SimOptions, out: TextIO) -> int:
    """Run the simulation and print its figures; 0 if every node's last beat was accepted."""
    subjects = Subjects(options.prefix)
    stream = subjects.stream_name(STREAM_HEARTBEATS)
    try:
        await bus.js.stream_info(stream)
    except nats.js.errors.NotFoundError:
        raise NotProvisioned(stream) from None
    nodes_bucket = await bus.kv(subjects.bucket_name(BUCKET_NODES))
    boot = uuid.uuid4().hex[:16]
    nodes = [SimNode(f"sim-{i:05d}", subjects, options, boot) for i in range(options.nodes)]
    for first in range(0, len(nodes), APPROVE_CHUNK):
        await asyncio.gather(
            *(
                registry.approve(bus, subjects, n.node_id, n.key.public_key, "fleetctl simulate")
                for n in nodes[first : first + APPROVE_CHUNK]
            )
        )
    progress = Progress([node.node_id for node in nodes], boot)
    follower = asyncio.create_task(progress.follow(nodes_bucket))
    try:
        await asyncio.wait_for(progress.synced.wait(), PUBLISH_TIMEOUT)
        # A node the aggregators already know continues its sequence past a reserved
        # block, as a restarted agent does: fleet_nodes may be a checkpoint behind the
        # last seq the aggregator accepted.
        for node in nodes:
            seen = progress.seen[node.node_id]
            node.seq = seen + SEQ_BLOCK if seen else 0
        watch = StaleAlerts()
        # Followed from before the first beat: a killed node's alert may come before the
        # run ends.
        alerts = await bus.subscribe(subjects.alerts(), watch.on_alert) if options.kill else None
        try:
            return await _run(bus, options, nodes, progress, boot, watch, out)
        finally:
            if alerts is not None:
                await unsubscribe_quietly(alerts)
    finally:
        follower.cancel()
        await asyncio.gather(follower, return_exceptions=True)


async def _run(
    bus: Bus,
    options: SimOptions,
    nodes: list[SimNode],
    progress: Progress,
    boot: str,
    watch: StaleAlerts,
    out: TextIO,
) -> int:
    total = max(1, round(options.rate * options.duration))
    failed = 0

    def acked(future: asyncio.Future[PubAck]) -> None:
        nonlocal failed
        if future.cancelled() or future.exception() is not None:
            failed += 1

    start = time.monotonic()
    sent = 0
    killed: dict[str, float] = {}
    """Killed node -> the ts of its last heartbeat."""
    first: set[str] = set()
    last_ts: dict[str, float] = {}
    while sent < total:
        due = min(total, int((time.monotonic() - start) * options.rate) + 1)
        now = time.time()
        ts = b"%.6f" % now
        if options.kill and not killed and sent >= total // 2:
            killed = {
                node.node_id: last_ts.get(node.node_id, 0.0) for node in nodes[: options.kill]
            }
        while sent < due:
            node = nodes[sent % len(nodes)]
            if node.node_id in killed:
                sent += 1
                continue
            if options.kill:
                last_ts[node.node_id] = now
            if node.node_id not in first:
                first.add(node.node_id)
                progress.first_sent[node.node_id] = now
            body, headers = node.beat(ts, boot)
            future = await bus.js.publish_async(
                node.subject, body, wait_stall=PUBLISH_TIMEOUT, headers=headers
            )
            future.add_done_callback(acked)
            sent += 1
        await asyncio.sleep(max(0.0, start + sent / options.rate - time.monotonic()))
    last_publish = time.monotonic()
    try:
        await asyncio.wait_for(bus.js.publish_async_completed(), PUBLISH_TIMEOUT)
    except TimeoutError:
        failed += bus.js.publish_async_pending()
    elapsed = max(last_publish - start, 1e-9)
    out.write(
        f"published {sent} heartbeats from {len(nodes)} nodes in {elapsed:.2f}s: "
        f"{sent / elapsed:.1f}/s (asked {options.rate:g}/s), {failed} not acknowledged\n"
    )
    progress.expect({node.node_id: node.seq for node in nodes})
    try:
        await asyncio.wait_for(progress.caught_up.wait(), options.wait)
    except TimeoutError:
        pass
    current = f"{len(nodes) - len(progress.behind)}/{len(nodes)} records current"
    if progress.caught_up.is_set():
        lag = max(0.0, progress.caught_up_at - last_publish)
        out.write(f"caught up: {current} {lag:.3f}s after the last publish\n")
    else:
        out.write(f"not caught up: {current} after {options.wait:g}s\n")
    # A beat replaced in FLEET_HB (one per node) before an aggregator read it is skipped.
    out.write(f"accepted: {progress.updates} record updates for {sent} heartbeats\n")
    latencies = sorted(progress.latencies)
    if latencies:
        out.write(
            f"publish-to-record latency of each node's first heartbeat ({len(latencies)}): "
            f"p50 {_quantile(latencies, 0.5) * 1000:.0f} ms, "
            f"p99 {_quantile(latencies, 0.99) * 1000:.0f} ms\n"
        )
    storm_ok = True
    if killed:
        storm_ok = await _stale_storm(bus, options, killed, watch, out)
    return 0 if progress.caught_up.is_set() and failed == 0 and storm_ok else 1


class StaleAlerts:
    """When each node's first ``stale`` alert arrived, followed from before the run."""

    def __init__(self) -> None:
        self.arrived: dict[str, float] = {}
        self.changed = asyncio.Event()

    async def on_alert(self, msg: Msg) -> None:
        try:
            alert = codec.decode(msg.data, Alert, msg.subject)
        except DecodeError:
            return
        if alert.kind == "stale" and alert.node_id not in self.arrived:
            self.arrived[alert.node_id] = time.time()
            self.changed.set()


async def _stale_storm(
    bus: Bus, options: SimOptions, killed: dict[str, float], watch: StaleAlerts, out: TextIO
) -> bool:
    """Wait for a ``stale`` alert of every killed node (within ``options.wait`` after the
    last one's TTL ran out); report how many came, how many were stored more than once,
    and the delay from each node's TTL expiry (last heartbeat + stale_after) to its
    alert. True if every node got exactly one."""
    subjects = Subjects(options.prefix)
    deadline = max(killed.values()) + options.stale_after + options.wait
    while not all(node in watch.arrived for node in killed) and time.time() < deadline:
        watch.changed.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(watch.changed.wait(), max(0.0, deadline - time.time()))
    arrived = {node: at for node, at in watch.arrived.items() if node in killed}
    stream = subjects.stream_name(STREAM_ALERTS)
    info = await bus.js.stream_info(
        stream, subjects_filter=subjects.alerts_of("stale", options.cluster)
    )
    stored = info.state.subjects or {}
    per_node = {
        node: stored.get(subjects.alert("stale", options.cluster, node), 0) for node in killed
    }
    twice = sum(1 for node in killed if per_node.get(node, 0) > 1)
    delays = sorted(
        max(0.0, arrived[node] - (killed[node] + options.stale_after)) for node in arrived
    )
    out.write(
        f"stale storm: {len(arrived)}/{len(killed)} killed nodes alerted, {twice} stored "
        f"more than once; TTL expiry -> alert p50 {_quantile(delays, 0.5):.2f}s "
        f"p99 {_quantile(delays, 0.99):.2f}s\n"
    )
    return len(arrived) == len(killed) and twice == 0


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    return values[min(len(values) - 1, int(q * len(values)))]
