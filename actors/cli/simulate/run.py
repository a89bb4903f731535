"""``fleetctl simulate``: N signed-heartbeat nodes from P processes, to load-test aggregators.

The nodes and their publishing are in ``sim_publisher``. ``--processes P`` spreads the
nodes over P worker processes (``actors.cli.simulate.worker``, driven through
``sim_processes``), each with its own NATS connection and every P-th node: the parent
sends each its job and, once all have built and approved their nodes, one common start
time; the workers send back what they published. This module runs the simulation: it
follows ``fleet_nodes`` (a KV watch shows when every node's record carries its last seq)
and ``fleet.alerts``, and prints the figures. A worker whose parent goes away (its stdin
closes) exits at once.
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
from nats.js.kv import KeyValue

from actors.cli.common import ClientConfig
from actors.cli.simulate.processes import (
    READY,
    SETUP_PER_NODE,
    SETUP_TIMEOUT,
    Worker,
    WorkerFailed,
    WorkerGo,
    WorkerJob,
    own_indices,
)
from actors.cli.simulate.publisher import (
    SimNode,
    SimOptions,
    SliceResult,
    build_nodes,
    node_id,
    publish_slice,
    start_seqs,
)
from actors.runtime import kv
from actors.runtime.bus import PUBLISH_TIMEOUT, Bus, NotProvisioned
from actors.runtime.subscriptions import unsubscribe_quietly
from schemas import codec
from schemas.errors import DecodeError
from schemas.messages import Alert
from schemas.subjects import BUCKET_NODES, STREAM_ALERTS, STREAM_HEARTBEATS, Subjects


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
