"""``fleetctl simulate``: N signed-heartbeat nodes from P processes, to load-test aggregators.

Each simulated node has an in-memory key pair, approved in ``fleet_trust``, and a
heartbeat as big as a real one (a Sample of fake GPUs, a scored Health). Its body is
encoded once and cut at the marker values for ``seq`` and ``ts``; a beat joins the pieces
around the real ones, signs the bytes and publishes them with JetStream's asynchronous
publish. Beats are spread evenly over the run at a total rate and sent in bursts of one
tick (``TICK``) without yielding to the event loop in between, so nats-py writes a burst
with one socket send instead of one per beat (a send per beat was the simulator's limit).

``--processes P`` spreads the nodes over P worker processes (``actors.cli.sim_worker``),
each with its own NATS connection and every P-th node: the parent sends each its job
and, once all have built and approved their nodes, one common start time; the workers
send back what they published, and the parent follows ``fleet_nodes`` (a KV watch shows
when every node's record carries its last seq) and ``fleet.alerts`` and prints the
figures. A worker whose parent goes away (its stdin closes) exits at once.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import math
import sys
import time
import uuid
from typing import TextIO

import msgspec
import nats.js.errors
from nats.aio.msg import Msg
from nats.js.kv import KeyValue

from actors.cli.common import ClientConfig
from actors.fleet import registry
from actors.node.health import checks, scoring
from actors.node.inventory.actor import fingerprint
from actors.node.inventory.fake_gpus import FakeGpus
from actors.runtime import kv
from actors.runtime.bus import PUBLISH_TIMEOUT, Bus, NotProvisioned, unsubscribe_quietly
from schemas import codec, signing
from schemas.errors import DecodeError, FleetError
from schemas.events import Capacity, Health, Jobs, Latency, Sample, SpotStatus
from schemas.messages import AGENT_VERSION, Alert, Heartbeat
from schemas.subjects import BUCKET_NODES, STREAM_ALERTS, STREAM_HEARTBEATS, Subjects

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
SETUP_TIMEOUT = 60.0
SETUP_PER_NODE = 0.01
"""A worker builds and approves its nodes within SETUP_TIMEOUT + SETUP_PER_NODE x nodes."""


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


class _Beat(msgspec.Struct):
    ts: float = 0.0


class _Progress(msgspec.Struct):
    """The NodeRecord fields progress needs: decoding only them keeps the watch cheap."""

    last_seq: int = 0
    boot_id: str = ""
    heartbeat: _Beat | None = None


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
        self.first: set[str] = set()
        """Nodes whose record was written for this run (this boot) at least once."""
        self.latencies: list[float] = []
        """Publish-to-record seconds of each node's first record of this run: from the
        ``ts`` of the heartbeat the record carries to when this watch saw the record. A
        new boot is a state change, so the aggregator writes it at once; later heartbeats
        reach ``fleet_nodes`` only at checkpoints, so they are not measured."""

    async def follow(self, bucket: KeyValue) -> None:
        await kv.follow(bucket, _Progress, self._on_change, self.synced.set)

    def _on_change(self, node: str, found: _Progress | None) -> None:
        if node not in self.seen or found is None:
            return
        self.seen[node] = found.last_seq
        if found.boot_id == self.boot and self.synced.is_set():
            self.updates += 1
            if node not in self.first:
                self.first.add(node)
                if found.heartbeat is not None:
                    self.latencies.append(max(0.0, time.time() - found.heartbeat.ts))
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


class WorkerJob(msgspec.Struct, frozen=True, kw_only=True):
    """The parent's first line to a worker: which nodes are its, and how to connect."""

    worker: int
    options: SimOptions
    client: ClientConfig
    boot: str


class WorkerGo(msgspec.Struct, frozen=True, kw_only=True):
    """The parent's second line: when to start (wall clock) and where each node's seq
    starts (the worker's nodes in order)."""

    start_at: float
    seqs: list[int]


READY = b"ready\n"
"""A worker's first line: its nodes are built and approved."""


def own_indices(options: SimOptions, worker: int) -> range:
    """The nodes of worker ``worker``: every P-th, so a ``--kill`` hits all workers."""
    return range(worker, options.nodes, options.processes)


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


class WorkerFailed(FleetError):
    """A worker process exited or answered something else than expected."""


class Worker:
    """The parent's handle on one worker process: JSON lines over its stdin and stdout."""

    def __init__(self, index: int, process: asyncio.subprocess.Process) -> None:
        self.index = index
        self.process = process
        self.errors: collections.deque[str] = collections.deque(maxlen=20)
        """The last lines of its stderr, read all along so that it never fills the pipe."""
        self.reader = asyncio.create_task(self._read_errors())

    async def _read_errors(self) -> None:
        assert self.process.stderr is not None
        async for line in self.process.stderr:
            if line.strip():
                self.errors.append(line.decode(errors="replace").strip())

    @classmethod
    async def start(cls, index: int) -> Worker:
        process = await asyncio.create_subprocess_exec(
            *(sys.executable, "-m", "actors.cli.sim_worker"),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            limit=2**26,  # a result names every node of the worker
        )
        return cls(index, process)

    async def send(self, message: msgspec.Struct) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(msgspec.json.encode(message) + b"\n")
        try:
            async with asyncio.timeout(PUBLISH_TIMEOUT):
                await self.process.stdin.drain()
        except (OSError, TimeoutError):
            raise await self.failed() from None

    async def receive(self, timeout: float) -> bytes:
        """The worker's next line; WorkerFailed if it ends, or after ``timeout``."""
        assert self.process.stdout is not None
        try:
            async with asyncio.timeout(timeout):
                line = await self.process.stdout.readline()
        except TimeoutError:
            raise WorkerFailed(
                f"simulate worker {self.index} did not answer within {timeout:.0f}s"
            ) from None
        if not line.endswith(b"\n"):
            raise await self.failed()
        return line

    async def failed(self) -> WorkerFailed:
        """The worker's own last error line, once it has exited."""
        await self.stop()
        last = self.errors[-1].removeprefix("error: ") if self.errors else "no message"
        return WorkerFailed(
            f"simulate worker {self.index} failed (exit {self.process.returncode}): {last}"
        )

    async def stop(self) -> None:
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()
        await self.process.wait()
        # Its stderr ends with it: the reader has read the last line.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(PUBLISH_TIMEOUT):
                await asyncio.shield(self.reader)
        self.reader.cancel()
        await asyncio.gather(self.reader, return_exceptions=True)


async def _in_workers(
    options: SimOptions, client: ClientConfig, boot: str, progress: Progress
) -> SliceResult:
    """The run spread over ``options.processes`` workers; their results merged."""
    workers: list[Worker] = []
    try:
        for index in range(options.processes):
            workers.append(await Worker.start(index))
        for worker in workers:
            await worker.send(
                WorkerJob(worker=worker.index, options=options, client=client, boot=boot)
            )
        setup = SETUP_TIMEOUT + SETUP_PER_NODE * options.nodes / options.processes
        for line in await asyncio.gather(*(worker.receive(setup) for worker in workers)):
            if line != READY:
                raise WorkerFailed(f"simulate worker said {line[:80]!r}, not ready")
        async with asyncio.timeout(PUBLISH_TIMEOUT):
            await progress.synced.wait()
        start_at = time.time() + 0.5
        for worker in workers:
            names = [node_id(i) for i in own_indices(options, worker.index)]
            await worker.send(WorkerGo(start_at=start_at, seqs=start_seqs(names, progress.seen)))
        run = options.duration + 2 * PUBLISH_TIMEOUT + SETUP_TIMEOUT
        lines = await asyncio.gather(*(worker.receive(run) for worker in workers))
        try:
            results = [msgspec.json.decode(line, type=SliceResult) for line in lines]
        except msgspec.DecodeError as exc:
            raise WorkerFailed(f"simulate worker sent a bad result: {exc}") from None
    finally:
        await asyncio.gather(*(worker.stop() for worker in workers))
    return SliceResult(
        published=sum(r.published for r in results),
        failed=sum(r.failed for r in results),
        first_at=min(r.first_at for r in results if r.first_at) if results else 0.0,
        last_at=max(r.last_at for r in results),
        last_seq={node: seq for r in results for node, seq in r.last_seq.items()},
        killed={node: ts for r in results for node, ts in r.killed.items()},
    )


async def simulate(
    bus: Bus, options: SimOptions, out: TextIO, client: ClientConfig | None = None
) -> int:
    """Run the simulation and print its figures; 0 if every node's last beat was accepted.
    ``client`` (how to connect) is needed by worker processes only."""
    subjects = Subjects(options.prefix)
    stream = subjects.stream_name(STREAM_HEARTBEATS)
    try:
        await bus.js.stream_info(stream)
    except nats.js.errors.NotFoundError:
        raise NotProvisioned(stream) from None
    nodes_bucket = await bus.kv(subjects.bucket_name(BUCKET_NODES))
    boot = uuid.uuid4().hex[:16]
    names = [node_id(i) for i in range(options.nodes)]
    local: list[SimNode] = []
    if options.processes == 1:
        local = await build_nodes(bus, options, range(options.nodes), boot)
    progress = Progress(names, boot)
    follower = asyncio.create_task(progress.follow(nodes_bucket))
    watch = StaleAlerts()
    alerts = None
    try:
        # Followed from before the first beat: a killed node's alert may come before the
        # run ends.
        if options.kill:
            alerts = await bus.subscribe(subjects.alerts(), watch.on_alert)
        if options.processes == 1:
            async with asyncio.timeout(PUBLISH_TIMEOUT):
                await progress.synced.wait()
            for node, seq in zip(local, start_seqs(names, progress.seen), strict=True):
                node.seq = seq
            result = await publish_slice(bus, options, local, time.time())
        else:
            if client is None:
                raise ValueError("simulate: worker processes need the client settings")
            result = await _in_workers(options, client, boot, progress)
        return await _report(bus, options, result, progress, watch, out)
    finally:
        if alerts is not None:
            await unsubscribe_quietly(alerts)
        follower.cancel()
        await asyncio.gather(follower, return_exceptions=True)


async def _report(
    bus: Bus,
    options: SimOptions,
    result: SliceResult,
    progress: Progress,
    watch: StaleAlerts,
    out: TextIO,
) -> int:
    sent = result.published
    elapsed = max(result.last_at - result.first_at, 1e-9)
    last_publish = time.monotonic() - (time.time() - result.last_at)
    spread = f" by {options.processes} processes" if options.processes > 1 else ""
    out.write(
        f"published {sent} heartbeats from {options.nodes} nodes in {elapsed:.2f}s{spread}: "
        f"{sent / elapsed:.1f}/s (asked {options.rate:g}/s), {result.failed} not acknowledged\n"
    )
    progress.expect(result.last_seq)
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(options.wait):
            await progress.caught_up.wait()
    nodes = len(result.last_seq)
    current = f"{nodes - len(progress.behind)}/{nodes} records current"
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
            f"publish-to-record latency of the first heartbeat of each of {len(latencies)} "
            "nodes (a new boot, written at once; from its ts to this watch seeing its "
            "fleet_nodes record; later beats reach fleet_nodes only at checkpoints): "
            f"p50 {_quantile(latencies, 0.5) * 1000:.0f} ms, "
            f"p99 {_quantile(latencies, 0.99) * 1000:.0f} ms\n"
        )
    storm_ok = True
    if result.killed:
        storm_ok = await _stale_storm(bus, options, result.killed, watch, out)
    return 0 if progress.caught_up.is_set() and result.failed == 0 and storm_ok else 1


class StaleAlerts:
    """When each node's first ``stale`` alert arrived, followed from before the run."""

    def __init__(self) -> None:
        self.arrived: dict[str, float] = {}
        self.marked: dict[str, float] = {}
        """When the server stored each node's TTL marker, as its alert says."""
        self.changed = asyncio.Event()

    async def on_alert(self, msg: Msg) -> None:
        try:
            alert = codec.decode(msg.data, Alert, msg.subject)
        except DecodeError:
            return
        if alert.kind == "stale" and alert.node_id not in self.arrived:
            self.arrived[alert.node_id] = time.time()
            with contextlib.suppress(KeyError, ValueError):
                marked_at = float(alert.details["marked_at"])
                # A nan would sort anywhere and spoil the quantiles; an inf is no time.
                if math.isfinite(marked_at):
                    self.marked[alert.node_id] = marked_at
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
            async with asyncio.timeout(max(0.0, deadline - time.time())):
                await watch.changed.wait()
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
    expiry = {node: killed[node] + options.stale_after for node in arrived}
    delays = sorted(max(0.0, arrived[node] - expiry[node]) for node in arrived)
    marked = {node: at for node, at in watch.marked.items() if node in arrived}
    # The two halves: the server's (TTL expiry -> its marker stored) and the aggregator's
    # (marker stored -> alert seen here), each node's from the alert's marked_at.
    by_server = sorted(marked[node] - expiry[node] for node in marked)
    by_aggregator = sorted(arrived[node] - marked[node] for node in marked)
    out.write(
        f"stale storm: {len(arrived)}/{len(killed)} killed nodes alerted, {twice} stored "
        f"more than once; TTL expiry -> alert p50 {_quantile(delays, 0.5):.2f}s "
        f"p99 {_quantile(delays, 0.99):.2f}s; TTL expiry -> marker stored p50 "
        f"{_quantile(by_server, 0.5):.2f}s p99 {_quantile(by_server, 0.99):.2f}s, marker "
        f"-> alert p50 {_quantile(by_aggregator, 0.5):.2f}s "
        f"p99 {_quantile(by_aggregator, 0.99):.2f}s\n"
    )
    return len(arrived) == len(killed) and twice == 0


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    return values[min(len(values) - 1, int(q * len(values)))]
