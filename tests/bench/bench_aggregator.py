"""Issue 12's aggregator benchmark: prints the whole table in one run (a script, not a test).

Each part runs against its own embedded nats-server (a fresh store), aggregators as their
own processes (``fleetctl aggregator``) and ``fleetctl simulate`` as a subprocess (with
``--processes``): on a small machine they all share the cores, and the figures say so.
Every part is selected by its flag, ``--all`` runs every one; each prints its lines as it
goes and its rows of the table (figure, target, measured, ✓/✗) at the end.

- ``--fleet``: the same-run ratio as a fleet meets it (issue 48): one aggregator as
  shipped, ``--fleet-nodes`` (5,000) nodes of 8 fake GPUs at ``--fleet-rate`` (1,500/s)
  for ``--fleet-duration`` (60 s), ``--runs`` (5) runs on fresh servers: CPU per
  accepted heartbeat once every node had beaten twice and the server held every node's
  command consumer (as in a running fleet) ÷ a bare PyNaCl verify timed in the same
  seconds, each run's ratio, their median and range; beside it the ratio from every
  node's second beat while the fresh fleet's consumers are still made, and the whole
  run's with every first contact.
- ``--ratio``: one aggregator, two nodes per heartbeat/s at each of ``--rates``. (a) the
  aggregator's CPU time per accepted heartbeat once every node had beaten twice (CPU
  seconds / the ``fleet_heartbeats_accepted`` delta, over every rate but the first, the
  warm-up) ÷ the CPU time of one bare PyNaCl Ed25519 verify of a heartbeat of the same
  size, measured in short bursts through the same seconds (the median; the aggregator
  shares the cores with the simulator and the server, and so does that verify); the
  ratio to the verify measured idle before the load is printed beside it. (b) the
  highest rate it sustains: lag
  < 1 s and ≥ 95% of the beats accepted. Lag: seconds from the simulator's last publish
  until every consumer of ``FLEET_HB`` has nothing pending or unacknowledged.
- ``--two``: (b) the same sweep with two aggregators (each given ``--partitions K`` if
  the bench is; without it the second stands by).
- ``--big``: (c) ``--big-nodes`` (100,000) nodes at a 30 s interval for ``--big-duration``
  (120 s): every record current at the end, p99 publish-to-record (each node's first
  heartbeat: see ``fleetctl simulate --help``), aggregator RSS, nats-server RSS.
- ``--storm``: (d) ``--storm-nodes`` (10,000) nodes stop at once: each gets exactly one
  ``stale`` alert (counted in the ALERTS stream, by node), p99 TTL expiry -> alert, in a
  run of twice as many nodes; with ``--big`` also in its run (the first 10,000 of the
  100,000 nodes stop half way), where the aggregator may still be behind.
- ``--cold``: (e) the aggregator restarted with ``--big-nodes`` records: seconds until it
  holds the lease with the records loaded, until it is current again (each partition's
  consumer has acknowledged every heartbeat its partition held at the restart), and
  until its consumers are drained (after ``--big``, on its records; alone, after a run
  that gives every node one record). The simulated nodes are silent by then, so their
  TTL markers start coming within the minute: the drain includes them, the first figure
  does not.
- ``--failover``: (f) two aggregators under load; when the first ``stale`` alert of a storm
  arrives, the first aggregator is SIGKILLed: seconds until every heartbeat lease is held
  by a live aggregator and each partition's consumer has acknowledged what its partition
  held at the kill;
  alerts lost and duplicated (per node, in the ALERTS stream).
- ``--memory``: the aggregator's RSS with ``--big-nodes`` records loaded (no heartbeats),
  once with the simulator's heartbeats in them and once with agents', against the same
  process with none; each node of ``--memory-gpus`` GPUs (1; 8 for a fleet of 8-GPU
  machines, whose GPU uuids and readings each node keeps).

- ``--side`` (not in ``--all``): two aggregators side by side under one load at the last
  of ``--rates``, each owning half the partitions, the second with ``--setting
  NAME=VALUE``: CPU per accepted heartbeat of each, ``--repeat`` rounds. On a shared
  machine back-to-back runs drift by more than a setting's effect; side by side, both
  pay the same seconds.

Run: ``python tests/bench/bench_aggregator.py --all`` (about 15 minutes), or e.g.
``--ratio --rates 1000,2000 --duration 20``. To add a part: a function ``part_x(bench)``
and a line in ``PARTS``; to add an option: a line in ``options()``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import nacl.bindings
import nats.js.errors
import psutil
from nats.aio.msg import Msg

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from actors.cli.simulate.publisher import SimOptions, template
from actors.fleet.config import AggregatorConfig
from actors.runtime.bus import NatsBus
from actors.runtime.embedded import NatsServer
from schemas import signing
from schemas.messages import AggregatorLease
from schemas.subjects import (
    BUCKET_LEASES,
    BUCKET_TRUST,
    STREAM_COMMANDS,
    STREAM_HEARTBEATS,
    Subjects,
)
from tests.support.ports import free_port

PREFIX = "fleet"
BUDGETS = (
    *("--heartbeats-max-bytes", str(1024 * 2**20)),
    *("--records-max-bytes", str(1024 * 2**20)),
    *("--trust-max-bytes", str(256 * 2**20)),
)
"""Stream budgets for 100,000 nodes of one fake GPU (about 2 KB a heartbeat)."""
ACCEPTED = "fleet_heartbeats_accepted_total"
"""The aggregator's counter of heartbeats accepted (its /metrics)."""
INTERVAL = 2.0
"""The sweeps' heartbeat interval: nodes = rate x INTERVAL. Long enough that a beat is
replaced in FLEET_HB only when the aggregator falls INTERVAL behind; short enough that
the first beat of each node (a new key and boot: a record written at once) is a tenth
of a 20 s run, not half of it (at 10 s the sweep measured first contacts, not the
steady state)."""
LAG_EVERY = 2.0
"""Seconds between two samples of :class:`LagProbe`."""
LAG_OK = 1.0
"""A rate is sustained when the consumers drain within this after the last publish..."""
ACCEPTED_OK = 0.95
"""... and at least this share of the beats published was accepted (FLEET_HB keeps one
beat per node: a beat replaced by the node's next one before it was read is skipped, so
a short interval can hide an aggregator that falls behind)."""


def options() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    for part in PARTS:
        parser.add_argument(f"--{part.name}", action="store_true", help=part.help)
    parser.add_argument("--all", action="store_true", help="every part")
    parser.add_argument(
        "--nodes",
        type=int,
        default=0,
        help="nodes of the rate sweeps (default 0: two per heartbeat/s, a 2 s interval)",
    )
    parser.add_argument(
        "--rates", default="1000,2000,3000,4000", help="rates of the sweeps (first: warm-up)"
    )
    parser.add_argument("--duration", type=float, default=20.0, help="seconds per rate")
    parser.add_argument("--fleet-nodes", type=int, default=5000, help="nodes of --fleet")
    parser.add_argument("--fleet-rate", type=float, default=1500.0, help="beats/s of --fleet")
    parser.add_argument(
        "--fleet-duration", type=float, default=60.0, help="seconds of each --fleet run"
    )
    parser.add_argument("--runs", type=int, default=5, help="--fleet: runs (default 5)")
    parser.add_argument("--big-nodes", type=int, default=100_000, help="nodes of --big/--cold")
    parser.add_argument("--big-duration", type=float, default=120.0, help="seconds of --big")
    parser.add_argument(
        "--memory-gpus", type=int, default=1, help="GPUs of each node --memory fills (default 1)"
    )
    parser.add_argument("--storm-nodes", type=int, default=10_000, help="nodes that stop")
    parser.add_argument(
        "--failover-rate", type=float, default=1000.0, help="heartbeats/s of --failover"
    )
    parser.add_argument(
        "--processes", type=int, default=2, help="fleetctl simulate --processes (default 2)"
    )
    parser.add_argument(
        "--partitions",
        type=int,
        default=0,
        help="pass --partitions K to every fleetctl aggregator (0: do not pass the flag)",
    )
    parser.add_argument("--profile", default="", help="cProfile the --ratio aggregator here")
    parser.add_argument(
        "--setting", default="", help="--side: NAME=VALUE of the second aggregator's setting"
    )
    parser.add_argument("--repeat", type=int, default=3, help="--side: rounds (default 3)")
    return parser


@dataclass
class Row:
    figure: str
    target: str
    measured: str
    ok: bool | None = None
    """None: a figure without a target."""

    def line(self) -> str:
        mark = "" if self.ok is None else ("✓ " if self.ok else "✗ ")
        return f"| {self.figure} | {self.target} | {mark}{self.measured} |"


@dataclass
class Bench:
    args: argparse.Namespace
    rows: list[Row] = field(default_factory=list)

    def say(self, text: str) -> None:
        print(text, flush=True)

    def selected(self, name: str) -> bool:
        return bool(getattr(self.args, name) or (self.args.all and name not in ONLY_ASKED))

    def row(self, figure: str, target: str, measured: str, ok: bool | None = None) -> None:
        self.rows.append(Row(figure, target, measured, ok))
        self.say(Row(figure, target, measured, ok).line())

    def table(self, heading: str = "benchmark") -> None:
        """Every row so far, as a markdown table (what docs/performance.md quotes)."""
        self.say(f"| {heading} | target | measured |\n|---|---|---|")
        for row in self.rows:
            self.say(row.line())


# ---------------------------------------------------------------- processes and probes


class Aggregator:
    """One ``fleetctl aggregator`` process with its HTTP port; stopped by ``servers``."""

    def __init__(
        self, url: str, bench: Bench, profile: str = "", env: dict[str, str] | None = None
    ) -> None:
        self.port = free_port()
        partitions = ("--partitions", str(bench.args.partitions)) if bench.args.partitions else ()
        self.process = subprocess.Popen(
            [
                sys.executable,
                *(("-m", "cProfile", "-o", profile) if profile else ()),
                *("-m", "actors.cli.fleetctl", "aggregator", "--server", url),
                *("--http-port", str(self.port), "--log-level", "error", *BUDGETS),
                *partitions,
            ],
            stdout=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
        )
        self.ps = psutil.Process(self.process.pid)

    def metrics(self, timeout: float = 5.0) -> str | None:
        url = f"http://127.0.0.1:{self.port}/metrics"
        try:
            with urllib.request.urlopen(url, timeout=timeout) as p:
                text: str = p.read().decode()
                return text
        except OSError:
            return None

    def metric(self, name: str, timeout: float = 5.0) -> float | None:
        """The sum of every sample of ``name`` (any labels); None if it does not answer
        within ``timeout``."""
        text = self.metrics(timeout)
        if text is None:
            return None
        found = re.findall(rf"^{name}(?:{{[^}}]*}})? ([\d.e+-]+|NaN)$", text, re.M)
        return sum(float(value) for value in found if value != "NaN")

    def wait_answering(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while self.metrics() is None:
            if time.monotonic() > deadline or self.process.poll() is not None:
                raise RuntimeError(f"aggregator on :{self.port} did not start")
            time.sleep(0.2)

    def wait_owner(self, timeout: float) -> float | None:
        """Seconds until it holds a heartbeat lease (records loaded)."""
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if (self.metric("fleet_aggregator_owner") or 0) >= 1:
                return time.monotonic() - start
            # Not faster: each /metrics counts every record (100,000 in the big runs).
            time.sleep(0.5)
        return None

    def cpu(self) -> float:
        times = self.ps.cpu_times()
        return float(times.user + times.system)

    def start_mark(self) -> tuple[float, float]:
        """(CPU seconds, heartbeats accepted) to measure from: the count asked first, so
        what its /metrics page costs the aggregator (every record's series, tens of
        milliseconds at 5,000 nodes) is not counted in the window after."""
        accepted = self.metric(ACCEPTED) or 0
        return self.cpu(), accepted

    def end_mark(self) -> tuple[float, float]:
        """(CPU seconds, heartbeats accepted) to measure to: the CPU read first, so the
        /metrics page asked after is not counted in the window before."""
        cpu = self.cpu()
        return cpu, self.metric(ACCEPTED) or 0

    def rss_mb(self) -> float:
        return float(self.ps.memory_info().rss) / 2**20

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@contextlib.contextmanager
def servers(bench: Bench) -> Iterator[Cluster]:
    """A fresh nats-server and whatever aggregators the part starts, all stopped after."""
    with tempfile.TemporaryDirectory() as store:
        server = NatsServer(Path(store) / "nats")
        server.start()
        cluster = Cluster(bench, server)
        try:
            yield cluster
        finally:
            for aggregator in cluster.aggregators:
                aggregator.stop()
            server.stop()


@dataclass
class Cluster:
    bench: Bench
    server: NatsServer
    aggregators: list[Aggregator] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.server.url

    def server_rss_mb(self) -> float:
        assert self.server.process is not None
        return float(psutil.Process(self.server.process.pid).memory_info().rss) / 2**20

    def start_aggregator(self, profile: str = "", env: dict[str, str] | None = None) -> Aggregator:
        aggregator = Aggregator(self.url, self.bench, profile, env)
        self.aggregators.append(aggregator)
        aggregator.wait_answering()
        asyncio.run(wait_provisioned(self.url))
        return aggregator

    def simulate(
        self, nodes: int, rate: float, duration: float, *extra: str, timeout: float = 0.0
    ) -> Sim:
        """``fleetctl simulate`` to the end (killed after ``timeout``)."""
        command = self.simulate_command(nodes, rate, duration, *extra)
        try:
            done = subprocess.run(
                command, capture_output=True, text=True, timeout=timeout or duration + 600
            )
        except subprocess.TimeoutExpired as exc:
            out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
            return Sim(out, "timed out", -1)
        return Sim(done.stdout, done.stderr, done.returncode)

    def simulate_command(self, nodes: int, rate: float, duration: float, *extra: str) -> list[str]:
        processes = max(1, min(self.bench.args.processes, nodes))
        return [
            *(sys.executable, "-m", "actors.cli.fleetctl", "simulate", "--server", self.url),
            *("--nodes", str(nodes), "--rate", f"{rate:.1f}", "--duration", f"{duration:g}"),
            *("--processes", str(processes), *extra),
        ]


class Sim:
    """What ``fleetctl simulate`` printed, picked apart."""

    def __init__(self, out: str, err: str, code: int) -> None:
        self.out, self.err, self.code = out, err, code

    def find(self, pattern: str) -> re.Match[str] | None:
        return re.search(pattern, self.out, re.M)

    @property
    def published(self) -> int:
        found = self.find(r"^published (\d+) heartbeats")
        return int(found.group(1)) if found else 0

    @property
    def achieved(self) -> float | None:
        found = self.find(r": ([\d.]+)/s \(asked")
        return float(found.group(1)) if found else None

    @property
    def current(self) -> tuple[int, int] | None:
        found = self.find(r"(\d+)/(\d+) records current")
        return (int(found.group(1)), int(found.group(2))) if found else None

    @property
    def latency_ms(self) -> tuple[float, float] | None:
        found = self.find(r"^publish-to-record latency .*: p50 (\d+) ms, p99 (\d+) ms$")
        return (float(found.group(1)), float(found.group(2))) if found else None

    @property
    def storm(self) -> tuple[int, int, int, float, str] | None:
        """Alerted, killed, stored more than once, p99 seconds, and the p99s of the two
        halves (the server's, TTL expiry -> marker; the aggregator's, marker -> alert)."""
        found = self.find(
            r"stale storm: (\d+)/(\d+) killed nodes alerted, (\d+) stored more than once; "
            r"TTL expiry -> alert p50 [\d.na]+s p99 ([\d.na]+)s; TTL expiry -> marker "
            r"stored p50 [-\d.na]+s p99 ([-\d.na]+)s, marker -> alert p50 [-\d.na]+s "
            r"p99 ([-\d.na]+)s"
        )
        if not found:
            return None
        halves = f"expiry → marker stored p99 {found[5]} s, marker → alert p99 {found[6]} s"
        return int(found[1]), int(found[2]), int(found[3]), float(found[4]), halves

    def trouble(self) -> str:
        """One line on what went wrong, for a row."""
        last = (self.err.strip().splitlines() or ["no error output"])[-1]
        return f"simulate exit {self.code}: {last[:200]}"

    def lines(self) -> str:
        return " | ".join(line for line in self.out.splitlines() if line)


async def wait_provisioned(url: str, timeout: float = 30.0) -> None:
    bus = await NatsBus.connect(url, "bench")
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                await bus.js.stream_info(Subjects(PREFIX).stream_name(STREAM_HEARTBEATS))
                await bus.kv(Subjects(PREFIX).bucket_name(BUCKET_TRUST))
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)
    finally:
        await bus.close()


async def _consumers(bus: NatsBus) -> list[nats.js.api.ConsumerInfo]:
    stream = Subjects(PREFIX).stream_name(STREAM_HEARTBEATS)
    return list(await asyncio.wait_for(bus.js.consumers_info(stream), 5))


async def consumers_drained(url: str, timeout: float) -> float | None:
    """Seconds until every consumer of FLEET_HB (one per partition) has nothing pending
    or unacknowledged; None if not within ``timeout``."""
    bus = await NatsBus.connect(url, "bench-lag")
    start = time.monotonic()
    try:
        while time.monotonic() - start < timeout:
            infos = await _consumers(bus)
            if infos and all(i.num_pending == 0 and i.num_ack_pending == 0 for i in infos):
                return time.monotonic() - start
            await asyncio.sleep(0.05)
        return None
    finally:
        await bus.close()


async def oldest_unacknowledged(bus: NatsBus) -> float:
    """Seconds the oldest heartbeat in FLEET_HB that its partition's consumer has not
    acknowledged has waited (the first message after each consumer's ack floor; 0: none
    waiting): the aggregators' lag, as the server sees it."""
    now, oldest = time.time(), 0.0
    for info in await _consumers(bus):
        if not info.num_pending and not info.num_ack_pending:
            continue
        floor = (info.ack_floor.stream_seq or 0) if info.ack_floor else 0
        try:
            first = await bus.js.get_msg(
                info.stream_name, seq=floor + 1, subject=info.config.filter_subject, next=True
            )
        except nats.js.errors.NotFoundError:
            continue
        if first.time is not None:
            oldest = max(oldest, now - first.time.timestamp())
    return oldest


class LagProbe(threading.Thread):
    """:func:`oldest_unacknowledged` every LAG_EVERY seconds until stopped, from the
    server (not the aggregator's /metrics, which counts every record): how far behind
    the aggregators were through a run."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.began = time.monotonic()
        self.samples: list[tuple[float, float]] = []
        """(seconds since the probe began, lag in seconds)."""
        self.done = threading.Event()

    def run(self) -> None:
        asyncio.run(self._sample())

    async def _sample(self) -> None:
        bus = await NatsBus.connect(self.url, "bench-lag-probe")
        try:
            while not self.done.is_set():
                with contextlib.suppress(nats.errors.Error, TimeoutError):
                    lag = await oldest_unacknowledged(bus)
                    self.samples.append((time.monotonic() - self.began, lag))
                await asyncio.sleep(LAG_EVERY)
        finally:
            await bus.close()

    def finish(self) -> None:
        self.done.set()
        self.join()

    def summary(self) -> str:
        """The largest lag and when, and from when on it stayed under LAG_OK (seconds since
        the probe began)."""
        if not self.samples:
            return "not sampled"
        at, worst = max(self.samples, key=lambda sample: sample[1])
        behind = [t for t, lag in self.samples if lag >= LAG_OK]
        settled = (
            "throughout"
            if not behind
            else f"from {behind[-1] + LAG_EVERY:.0f} s on"
            if behind[-1] < self.samples[-1][0]
            else "never"
        )
        return f"at most {worst:.1f} s ({at:.0f} s in); under {LAG_OK:g} s {settled}"


async def partition_ends(url: str) -> dict[str, int]:
    """The stream sequence of the last message each consumer of FLEET_HB (one per
    partition) is filtered to, by consumer (0: none)."""
    bus = await NatsBus.connect(url, "bench-ends")
    ends: dict[str, int] = {}
    try:
        for info in await _consumers(bus):
            try:
                last = await bus.js.get_last_msg(info.stream_name, info.config.filter_subject or "")
                ends[info.name] = int(last.seq or 0)
            except nats.js.errors.NotFoundError:
                ends[info.name] = 0
        return ends
    finally:
        await bus.close()


async def judged_through(url: str, ends: dict[str, int], timeout: float) -> float | None:
    """Seconds until every consumer named in ``ends`` has acknowledged its partition up to
    the sequence given there; None if not within ``timeout``."""
    bus = await NatsBus.connect(url, "bench-judged")
    start = time.monotonic()
    try:
        while time.monotonic() - start < timeout:
            floors = {
                i.name: (i.ack_floor.stream_seq or 0) if i.ack_floor else 0
                for i in await _consumers(bus)
            }
            if all(floors.get(name, -1) >= end for name, end in ends.items()):
                return time.monotonic() - start
            await asyncio.sleep(0.05)
        return None
    finally:
        await bus.close()


async def leases_renewed(url: str, killed_at: float, timeout: float) -> float | None:
    """After a SIGKILL at ``killed_at`` (wall clock): seconds until every heartbeat lease
    was renewed after it (a dead holder renews nothing, so each is held by a live one)."""
    bus = await NatsBus.connect(url, "bench-failover")
    try:
        bucket = await bus.kv(Subjects(PREFIX).bucket_name(BUCKET_LEASES))
        while time.time() - killed_at < timeout:
            keys = [k for k in await _keys(bucket) if k == "hb" or k.startswith("hb.")]
            held = bool(keys)
            for key in keys:
                with contextlib.suppress(nats.js.errors.KeyNotFoundError):
                    entry = await bucket.get(key)
                    if entry.value:
                        lease = msgspec.json.decode(entry.value, type=AggregatorLease)
                        held = held and lease.renewed > killed_at
                        continue
                held = False
            if held:
                return time.time() - killed_at
            await asyncio.sleep(0.1)
        return None
    finally:
        await bus.close()


async def _keys(bucket: nats.js.kv.KeyValue) -> list[str]:
    try:
        return list(await bucket.keys())
    except nats.js.errors.NoKeysError:
        return []


def bare_verify_cpu(rounds: int = 20_000, detached: bool = False) -> float:
    """CPU seconds of one bare PyNaCl Ed25519 verify of a simulated node's heartbeat
    (``crypto_sign_open``, the call ``VerifyKey.verify`` makes), or with ``detached``
    of libsodium's detached check of it, the call the aggregator makes
    (``signing.sodium_verify_detached``: the same check without PyNaCl's two copies of
    the body). The calling thread's CPU time: the bench's other threads (polling the
    server, the aggregators' metrics) run in the same seconds and are not the verify's."""
    body = template("sim-00000", SimOptions(nodes=1, rate=1.0, duration=1.0), "boot")
    pair = signing.KeyPair.generate()
    signature = pair.sign(body)
    key = signing.public_key_bytes(pair.public_key)
    start = time.thread_time()
    if detached:
        for _ in range(rounds):
            signing.sodium_verify_detached(signature, body, len(body), key)
    else:
        for _ in range(rounds):
            nacl.bindings.crypto_sign_open(signature + body, key)
    return (time.thread_time() - start) / rounds


def median_verify_cpu(bursts: int = 5, rounds: int = 4000, detached: bool = False) -> float:
    """The median of ``bursts`` bare verify measurements: one burst on a shared machine
    can land on a quiet or a busy moment of the host."""
    return statistics.median(bare_verify_cpu(rounds, detached) for _ in range(bursts))


class VerifyProbe(threading.Thread):
    """The bare verify measured again while the load runs, in short bursts spread over
    the steady part of a rate (every ``every`` seconds from ``start``): on a shared
    machine every CPU-second costs more under load, the aggregator's verify's too."""

    def __init__(self, start: float, every: float, until: float) -> None:
        super().__init__(daemon=True)
        self.first, self.every, self.until = start, every, until
        self.found: list[float] = []
        self.found_detached: list[float] = []
        self.found_at: list[float] = []
        """When each burst of ``found`` ended (``time.monotonic``)."""

    def run(self) -> None:
        time.sleep(self.first)
        began = time.monotonic()
        while time.monotonic() - began < self.until - self.first:
            self.found.append(bare_verify_cpu(1000))
            self.found_at.append(time.monotonic())
            self.found_detached.append(bare_verify_cpu(1000, detached=True))
            time.sleep(self.every)

    def since(self, moment: float) -> list[float]:
        """The bursts of ``found`` that ended after ``moment``."""
        return [v for v, at in zip(self.found, self.found_at, strict=True) if at > moment]


def fmt(value: float | None, unit: str = " s", digits: int = 1) -> str:
    return "never" if value is None else f"{value:.{digits}f}{unit}"


# ---------------------------------------------------------------- the parts


@dataclass
class Sweep:
    """One sweep's results: per rate the achieved rate and the lag."""

    sustained: float = 0.0
    """Highest achieved rate whose lag was < LAG_OK with ACCEPTED_OK of its beats accepted."""
    share: float = 0.0
    """At that rate, accepted heartbeats / published (the rest were replaced in FLEET_HB,
    which keeps one per node, by the node's next beat before an aggregator read them)."""
    cpu: float = 0.0
    accepted: float = 0.0
    steady_cpu: float = 0.0
    steady_accepted: float = 0.0
    """CPU and accepted heartbeats once every node of a rate had beaten twice: its first
    contact (a fresh trust and record read and a record written at once, about 0.8 ms,
    once per node: every run of the simulator makes new keys) left out."""
    verify_loaded: list[float] = field(default_factory=list)
    detached_loaded: list[float] = field(default_factory=list)
    settled_cpu: float = 0.0
    settled_accepted: float = 0.0
    """CPU and accepted heartbeats once, besides, every node's command consumer existed
    (a fleet as it runs: its consumers are made in its first minute, once)."""
    verify_settled: list[float] = field(default_factory=list)
    """The bare verify's bursts timed in those seconds."""
    settled_after: float | None = None
    """Seconds from the simulator's start until that moment (None: never in the run)."""


async def command_consumers_made(
    url: str, wanted: int, stop: Callable[[], bool], every: float = 0.5
) -> bool:
    """Waits until FLEET_CMD has ``wanted`` consumers (the server's own count: every
    node's command consumer made by the aggregator); False if ``stop`` says so first."""
    bus = await NatsBus.connect(url, "bench-consumers")
    stream = Subjects(PREFIX).stream_name(STREAM_COMMANDS)
    try:
        while not stop():
            with contextlib.suppress(Exception):  # a busy server: ask again
                info = await asyncio.wait_for(bus.js.stream_info(stream), 5.0)
                if (info.state.consumer_count or 0) >= wanted:
                    return True
            await asyncio.sleep(every)
        return False
    finally:
        await bus.close()


class SteadyMark(threading.Thread):
    """Notes the aggregators' CPU and accepted count the moment the accepted count has
    grown by twice the nodes since it started (every node's first contact behind:
    ``mark``), and with ``url``, again once the server holds a command consumer for every
    node as well (``settled``, with its ``time.monotonic``)."""

    def __init__(
        self, aggregators: list[Aggregator], nodes: int, since: float, url: str = ""
    ) -> None:
        super().__init__(daemon=True)
        self.aggregators, self.target, self.stop = aggregators, since + 2 * nodes, False
        self.nodes, self.url = nodes, url
        self.mark: tuple[float, float] | None = None
        self.settled: tuple[float, float] | None = None
        self.settled_at = 0.0

    def accepted(self) -> float:
        return sum(a.metric(ACCEPTED) or 0 for a in self.aggregators)

    def now(self) -> tuple[float, float]:
        marks = [a.start_mark() for a in self.aggregators]
        return sum(cpu for cpu, _ in marks), sum(accepted for _, accepted in marks)

    def run(self) -> None:
        while not self.stop:
            if self.accepted() >= self.target:
                self.mark = self.now()
                break
            time.sleep(0.2)
        if self.mark and self.url:
            made = command_consumers_made(self.url, self.nodes, lambda: self.stop)
            if asyncio.run(made):
                self.settled, self.settled_at = self.now(), time.monotonic()


def sweep(
    bench: Bench,
    cluster: Cluster,
    label: str,
    rates: list[float] | None = None,
    nodes: int = 0,
    settle: bool = False,
) -> Sweep:
    """Every rate of ``rates`` (default ``--rates``) in turn, with ``nodes`` (default
    ``--nodes``, else two per heartbeat/s): achieved rate, lag, CPU, RSS per rate. With
    ``settle``, the CPU per heartbeat also from the moment every node's command consumer
    exists (:class:`SteadyMark`)."""
    result = Sweep()
    rates = rates or [float(r) for r in bench.args.rates.split(",")]
    duration = bench.args.fleet_duration if nodes else bench.args.duration
    for index, rate in enumerate(rates):
        marks = [a.start_mark() for a in cluster.aggregators]
        cpu_before = sum(cpu for cpu, _ in marks)
        accepted_before = sum(accepted for _, accepted in marks)
        for aggregator in cluster.aggregators:
            aggregator.ps.cpu_percent(None)
        count = nodes or bench.args.nodes or round(rate * INTERVAL)
        # From the simulator's start (about 3 s after this) past its first beats, to its end.
        prober = VerifyProbe(3 + 2 * count / rate + 2, 2.0, 3 + duration)
        prober.start()
        started = time.monotonic()
        steady = SteadyMark(
            cluster.aggregators, count, accepted_before, cluster.url if settle else ""
        )
        steady.start()
        sim = cluster.simulate(count, rate, duration, "--wait", "0.01", "--gpus", "8")
        drained = asyncio.run(consumers_drained(cluster.url, 60.0))
        prober.join()
        steady.stop = True
        steady.join()
        wall = time.monotonic() - started
        ends = [a.end_mark() for a in cluster.aggregators]
        cpu_end = sum(cpu for cpu, _ in ends)
        accepted_end = sum(accepted for _, accepted in ends)
        cpu = cpu_end - cpu_before
        accepted = accepted_end - accepted_before
        usage = " + ".join(f"{a.ps.cpu_percent(None):.0f}%" for a in cluster.aggregators)
        rss = " + ".join(f"{a.rss_mb():.0f} MB" for a in cluster.aggregators)
        per = 1e6 * cpu / accepted if accepted else float("nan")
        steady_cpu = steady_accepted = 0.0
        if steady.mark is not None:
            steady_cpu = cpu_end - steady.mark[0]
            steady_accepted = accepted_end - steady.mark[1]
        steady_per = 1e6 * steady_cpu / steady_accepted if steady_accepted else float("nan")
        if steady.settled is not None:
            result.settled_cpu += cpu_end - steady.settled[0]
            result.settled_accepted += accepted_end - steady.settled[1]
            result.verify_settled.extend(prober.since(steady.settled_at))
            result.settled_after = steady.settled_at - started
        settled = (
            f", {1e6 * result.settled_cpu / result.settled_accepted:.1f} us once every "
            f"command consumer was made as well, {result.settled_after:.0f} s in"
            if result.settled_accepted and result.settled_after is not None
            else ", every command consumer never made in the run"
            if settle
            else ""
        )
        achieved = sim.achieved
        share = accepted / sim.published if sim.published else 0.0
        bench.say(
            f"  {label}: {count} nodes at {rate:g}/s: achieved {fmt(achieved, '/s', 0)}, lag "
            f"{fmt(drained, ' s', 2) if drained is not None else 'NOT DRAINED in 60 s'}, "
            f"accepted {accepted:.0f} ({100 * share:.0f}%), CPU/accepted {per:.1f} us "
            f"({steady_per:.1f} us once every node had beaten twice{settled}), "
            f"aggregator CPU {usage} of "
            f"{wall:.0f} s, RSS {rss} (simulate exit {sim.code})"
        )
        if sim.code not in (0, 1) or achieved is None:
            bench.say(f"  {sim.trouble()}")
        kept_up = drained is not None and drained < LAG_OK and share >= ACCEPTED_OK
        if kept_up and achieved and achieved > result.sustained:
            result.sustained = achieved
            result.share = share
        if index > 0 or len(rates) == 1:  # the first rate is the warm-up
            result.cpu += cpu
            result.accepted += accepted
            result.steady_cpu += steady_cpu
            result.steady_accepted += steady_accepted
            result.verify_loaded.extend(prober.found)
            result.detached_loaded.extend(prober.found_detached)
    return result


def part_ratio(bench: Bench) -> None:
    """(a) CPU per accepted ÷ bare verify and (b) one aggregator's sustained rate."""
    with servers(bench) as cluster:
        cluster.start_aggregator(bench.args.profile)
        bench.say(
            f"{bench.args.nodes or f'{INTERVAL:g} per heartbeat/s:'} nodes x 8 fake GPUs, "
            f"{bench.args.duration:g} s per rate"
        )
        verify = median_verify_cpu()
        detached = median_verify_cpu(detached=True)
        result = sweep(bench, cluster, "one aggregator")
    steady = result.steady_cpu / result.steady_accepted if result.steady_accepted else 0.0
    per = result.cpu / result.accepted if result.accepted else float("nan")
    # The aggregator's CPU seconds are spent beside the simulator and the server on the
    # same cores; the bare verify measured in the same seconds pays the same contention.
    loaded = statistics.median(result.verify_loaded) if result.verify_loaded else verify
    detached_loaded = (
        statistics.median(result.detached_loaded) if result.detached_loaded else detached
    )
    measured = (
        f"{steady / loaded:.2f} ({1e6 * steady:.1f} µs per accepted once every node had "
        f"beaten twice ÷ {1e6 * loaded:.1f} µs per bare verify, the median of "
        f"{len(result.verify_loaded)} bursts in the same seconds); against the verify "
        f"measured idle before the load ({1e6 * verify:.1f} µs, median of 5): "
        f"{steady / verify:.2f}; against libsodium's detached check, the call the "
        f"aggregator makes ({1e6 * detached_loaded:.1f} µs in the same seconds, "
        f"{1e6 * detached:.1f} µs idle): {steady / detached_loaded:.2f} "
        f"({steady / detached:.2f} idle); with each node's first contact: {per / loaded:.2f} "
        f"({1e6 * per:.1f} µs; every simulator run makes new keys, so every node of every "
        "rate is new)"
    )
    bench.row(
        "aggregator CPU per accepted heartbeat ÷ bare Ed25519 verify",
        "≤ 2.0",
        measured,
        0 < steady / loaded <= 2.0,
    )
    bench.row(
        "highest rate one aggregator sustains (lag < 1 s, ≥ 95% accepted)",
        "—",
        f"{result.sustained:.0f}/s ({bench.args.rates}/s asked, "
        f"{bench.args.nodes or f'{INTERVAL:g} nodes per heartbeat/s'}; "
        f"{100 * result.share:.0f}% of "
        "its beats accepted)",
    )


def part_fleet(bench: Bench) -> None:
    """(a') The same-run ratio as a fleet meets it: ``--fleet-nodes`` nodes of 8 fake GPUs
    beating ``--fleet-rate``/s in all for ``--fleet-duration``, one aggregator as shipped
    (HTTP port on, every default actor), ``--runs`` runs, each on its own server and
    aggregator. Each run's ratio: the aggregator's CPU per accepted heartbeat ÷ a bare
    PyNaCl verify of the same heartbeat timed in bursts through the same seconds (the
    median of those seconds' bursts), counted from the moment every node had beaten twice
    and the server held every node's command consumer (a running fleet: the headline);
    beside it the same from the moment every node had beaten twice, while the fresh
    fleet's consumers may still be made, and over the whole run with every node's first
    contact. Printed: every run, their median and range."""
    nodes, rate = bench.args.fleet_nodes, bench.args.fleet_rate
    settled: list[float] = []
    steady: list[float] = []
    whole: list[float] = []
    micros: list[tuple[float, float]] = []
    for run in range(bench.args.runs):
        bench.say(f"  {time.strftime('%H:%M:%S', time.gmtime())} load {os.getloadavg()[0]:.2f}")
        with servers(bench) as cluster:
            cluster.start_aggregator()
            result = sweep(bench, cluster, f"run {run + 1}", [rate], nodes, settle=True)
        if not (result.settled_accepted and result.verify_settled and result.verify_loaded):
            bench.say(f"  run {run + 1}: no steady part with every command consumer made")
            continue
        verify = statistics.median(result.verify_settled)
        per = result.settled_cpu / result.settled_accepted
        settled.append(per / verify)
        verify_all = statistics.median(result.verify_loaded)
        steady.append(result.steady_cpu / result.steady_accepted / verify_all)
        whole.append(result.cpu / result.accepted / verify_all)
        micros.append((1e6 * per, 1e6 * verify))
        bench.say(
            f"  run {run + 1}: {settled[-1]:.2f} ({1e6 * per:.1f} µs per accepted ÷ "
            f"{1e6 * verify:.1f} µs per verify, {len(result.verify_settled)} bursts, "
            f"{result.settled_accepted:.0f} heartbeats from {result.settled_after:.0f} s in); "
            f"while consumers are made {steady[-1]:.2f}; with first contacts {whole[-1]:.2f}"
        )
    if not settled:
        bench.row("same-run ratio, fleet", "≤ 2.0", "no run measured", False)
        return

    def spread(ratios: list[float]) -> str:
        return f"{statistics.median(ratios):.2f} ({min(ratios):.2f} to {max(ratios):.2f})"

    median = statistics.median(settled)
    bench.row(
        f"aggregator CPU per heartbeat ÷ PyNaCl verify in the same seconds, {nodes:,} "
        f"nodes x 8 GPUs at {rate:g}/s, HTTP on, every default actor, every command "
        "consumer made",
        "≤ 2.0",
        f"**{median:.2f}** median of {len(settled)} runs ({min(settled):.2f} to "
        f"{max(settled):.2f}: {', '.join(f'{r:.2f}' for r in settled)}); µs per heartbeat / "
        f"per verify: {', '.join(f'{a:.0f}/{b:.0f}' for a, b in micros)}; from every "
        f"node's second beat, consumers still being made: {spread(steady)}; with every "
        f"node's first contact: {spread(whole)}",
        median <= 2.0,
    )


def part_two(bench: Bench) -> None:
    """(b) the same sweep with two aggregators."""
    with servers(bench) as cluster:
        cluster.start_aggregator()
        cluster.start_aggregator()
        result = sweep(bench, cluster, "two aggregators")
    how = (
        f"--partitions {bench.args.partitions}"
        if bench.args.partitions
        else "one partition: the second stands by"
    )
    bench.row(
        "highest rate two aggregators sustain (lag < 1 s, ≥ 95% accepted)",
        "—",
        f"{result.sustained:.0f}/s ({how}; {100 * result.share:.0f}% accepted)",
    )


def big_run(bench: Bench, cluster: Cluster, kill: int) -> Aggregator:
    """(c), and (d) if ``kill``: the 30 s-interval run; returns the aggregator."""
    aggregator = cluster.start_aggregator()
    aggregator.wait_owner(120)
    nodes, duration = bench.args.big_nodes, bench.args.big_duration
    rate = nodes / 30.0
    extra = ("--gpus", "1", "--wait", "150", *(("--kill", str(kill)) if kill else ()))
    bench.say(f"{nodes} nodes at a 30 s interval ({rate:.0f}/s) for {duration:g} s ...")
    lag = LagProbe(cluster.url)
    lag.start()
    sim = cluster.simulate(nodes, rate, duration, *extra, timeout=duration + 1200)
    lag.finish()
    bench.say(f"  {sim.lines() or sim.trouble()}")
    bench.say(f"  lag through the run: {' '.join(f'{t:.0f}:{v:.1f}' for t, v in lag.samples)}")
    current = sim.current
    latency = sim.latency_ms
    achieved = sim.achieved
    bench.row(
        f"{nodes:,} nodes at 30 s for {duration:g} s: records current at the end",
        "all",
        f"{current[0]:,}/{current[1]:,} (published {fmt(achieved, '/s', 0)} of {rate:.0f}/s"
        + (", the stopped nodes' beats not sent)" if kill else ")")
        if current
        else sim.trouble(),
        bool(current and current[0] == current[1] == nodes),
    )
    bench.row(
        "  p99 publish-to-record (each node's first heartbeat of the run)",
        "—",
        f"p50 {latency[0]:.0f} ms, p99 {latency[1]:.0f} ms" if latency else "not measured",
    )
    bench.row(
        "  aggregator lag (oldest heartbeat not acknowledged; seconds since `simulate` "
        "started, its setup of the nodes first)",
        "—",
        lag.summary(),
    )
    rss = aggregator.rss_mb()
    bench.row("  aggregator RSS", f"≤ {RSS_TARGET_MB} MB", f"{rss:.0f} MB", rss <= RSS_TARGET_MB)
    bench.row("  nats-server RSS", "—", f"{cluster.server_rss_mb():.0f} MB")
    if kill:
        storm_row(bench, sim, kill, f"in the {nodes:,}-node run")
    return aggregator


def storm_row(bench: Bench, sim: Sim, kill: int, scene: str) -> None:
    """The storm's rows; ``scene`` says which run the nodes stopped in."""
    storm = sim.storm
    if storm is None:
        bench.row(
            f"stale storm ({scene}): {kill:,} nodes stop at once",
            "one alert each",
            sim.trouble(),
            False,
        )
        return
    alerted, killed, twice, p99, halves = storm
    bench.row(
        f"stale storm ({scene}): {killed:,} nodes stop at once: one `stale` alert each",
        "all, none twice",
        f"{alerted:,}/{killed:,} alerted, {twice} stored more than once",
        alerted == killed == kill and twice == 0,
    )
    bench.row("  p99 TTL expiry → alert", "≤ 5 s", f"{p99:.2f} s ({halves})", p99 <= 5.0)


def cold_start(bench: Bench, cluster: Cluster, aggregator: Aggregator) -> None:
    """(e) stop the aggregator, start another: lease held with records loaded, every
    heartbeat stored before the restart judged (current again), consumers drained."""
    aggregator.stop()
    ends = asyncio.run(partition_ends(cluster.url))
    started = time.monotonic()
    fresh = cluster.start_aggregator()
    owned = fresh.wait_owner(180)
    # No consumer found at the stop: nothing to measure against, so no figure.
    judged = asyncio.run(judged_through(cluster.url, ends, 180.0)) if ends else None
    current = time.monotonic() - started if judged is not None else None
    drained = asyncio.run(consumers_drained(cluster.url, 180.0))
    total = time.monotonic() - started if drained is not None else None
    bench.row(
        f"cold start with {bench.args.big_nodes:,} records: current again",
        "≤ 30 s",
        f"{fmt(current)} (lease held, records loaded {fmt(owned)} after start; every "
        f"heartbeat stored before the restart judged {fmt(current)}; consumers drained "
        f"{fmt(total)}, with the TTL markers of the nodes, silent since the run, that came "
        "meanwhile)",
        current is not None and current <= 30,
    )


def part_big(bench: Bench) -> None:
    """(c) 100,000 nodes at 30 s; with --storm also (d), with --cold also (e)."""
    kill = bench.args.storm_nodes if bench.selected("storm") else 0
    with servers(bench) as cluster:
        aggregator = big_run(bench, cluster, kill)
        if bench.selected("cold"):
            cold_start(bench, cluster, aggregator)


def part_storm(bench: Bench) -> None:
    """(d) alone: twice ``--storm-nodes`` nodes at 30 s, half of them stop at once (with
    ``--big`` also measured in its run, where the aggregator may still be behind)."""
    nodes = 2 * bench.args.storm_nodes
    with servers(bench) as cluster:
        cluster.start_aggregator().wait_owner(60)
        sim = cluster.simulate(
            nodes,
            nodes / 30.0,
            90,
            "--gpus",
            "1",
            "--wait",
            "60",
            "--kill",
            str(bench.args.storm_nodes),
        )
        bench.say(f"  {sim.lines() or sim.trouble()}")
        storm_row(bench, sim, bench.args.storm_nodes, f"alone, {nodes:,} nodes")


def part_cold(bench: Bench) -> None:
    """(e) alone: every node beats once (records written), then the restart."""
    if bench.selected("big"):
        return  # measured after --big's run
    nodes = bench.args.big_nodes
    with servers(bench) as cluster:
        aggregator = cluster.start_aggregator()
        aggregator.wait_owner(60)
        sim = cluster.simulate(nodes, nodes / 30.0, 30, "--gpus", "1", "--wait", "120")
        bench.say(f"  {sim.lines() or sim.trouble()}")
        cold_start(bench, cluster, aggregator)


def part_failover(bench: Bench) -> None:
    """(f) one of two aggregators SIGKILLed while a stale storm's alerts are raised."""
    rate = bench.args.failover_rate
    nodes = int(rate * 4)  # a 4 s interval: the stopped nodes' TTLs run out over 4 s
    kill = nodes // 4
    with servers(bench) as cluster:
        first = cluster.start_aggregator()
        first.wait_owner(60)
        second = cluster.start_aggregator()
        duration = 90.0
        command = cluster.simulate_command(
            nodes, rate, duration, "--gpus", "1", "--wait", "60", "--kill", str(kill)
        )
        load = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            first_alert = asyncio.run(wait_first_stale(cluster.url, duration + 120))
            if first_alert is None:
                raise RuntimeError("no stale alert came")
            time.sleep(1.0)  # the storm's alerts are being raised: some before, some after
            ends = asyncio.run(partition_ends(cluster.url))
            killed_at = time.time()
            first.process.send_signal(signal.SIGKILL)
            first.process.wait(10)
            leases = asyncio.run(leases_renewed(cluster.url, killed_at, 120))
            judged = None
            if leases is not None and ends:
                if asyncio.run(judged_through(cluster.url, ends, 120)) is not None:
                    judged = time.time() - killed_at
            out, err = load.communicate(timeout=duration + 300)
        finally:
            if load.poll() is None:
                load.kill()
                load.communicate()
        sim = Sim(out, err, load.returncode)
        bench.say(f"  {sim.lines() or sim.trouble()}")
        owner = second.metric("fleet_aggregator_owner")
    bench.row(
        f"failover: one of two aggregators SIGKILLed under {rate:g}/s: partitions served again",
        "a few s",
        f"every lease held by a live aggregator {fmt(leases)} after the kill, everything "
        f"the stream held at the kill judged {fmt(judged)} after it (lease_ttl 6 s; the "
        f"survivor owns {owner:g} after)"
        if owner is not None
        else f"leases {fmt(leases)}, judged {fmt(judged)}",
        judged is not None and judged <= 15,
    )
    storm = sim.storm
    if storm is None:
        bench.row("  alerts across the kill: lost / duplicated", "0 / 0", sim.trouble(), False)
        return
    alerted, killed, twice, _, _ = storm
    bench.row(
        f"  alerts across the kill ({killed:,} nodes stopped, the kill 1 s into their alerts): "
        "lost / duplicated",
        "0 / 0",
        f"{killed - alerted} / {twice}",
        alerted == killed and twice == 0,
    )


async def wait_first_stale(url: str, timeout: float) -> float | None:
    """Wall clock of the first ``stale`` alert published; None if none within ``timeout``."""
    bus = await NatsBus.connect(url, "bench-alerts")
    came = asyncio.Event()
    try:

        async def on_alert(_msg: Msg) -> None:
            came.set()

        subscription = await bus.nc.subscribe(
            Subjects(PREFIX).alerts_of("stale", "sim"), cb=on_alert
        )
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(came.wait(), timeout)
        await subscription.unsubscribe()
        return time.time() if came.is_set() else None
    finally:
        await bus.close()


ZONES = ("us-east-1a", "us-east-1b", "us-east-1c", "us-east-1d")
"""The zones of ``fill_records``' agent-shaped nodes, in turn."""


async def fill_records(
    url: str,
    nodes: int,
    state: str = "active",
    stale_after: float | None = None,
    agent: bool = False,
    gpus: int = 1,
) -> None:
    """``nodes`` records of simulated nodes of ``gpus`` GPUs (their last heartbeat whole) put
    straight into fleet_nodes, in ``state`` (active: each node's accepted heartbeat),
    their heartbeats claiming ``stale_after`` if given (else the simulator's). Each
    record names a public key of its own (56 characters, as an nkey; no heartbeat is
    signed with it), as a real fleet's do: one key shared by every record left out a
    string and an interned-name entry a node, about 15 MB at 100,000 nodes. ``agent``:
    each heartbeat as a real agent's on a cloud node (``tests.support.fleet.agent_shaped``:
    its cloud's labels beside its GPUs', capabilities, a settings status the fleet's
    entries reach, start and previous beat; four zones), where the simulator's has its
    GPUs' labels, an empty settings status and its start only."""
    from actors.cli.simulate.publisher import SEQ_MARK, TS_MARK
    from actors.fleet.aggregator import record_rules
    from schemas import codec
    from schemas.messages import Heartbeat
    from schemas.subjects import BUCKET_NODES
    from tests.support.fleet import agent_shaped

    options = SimOptions(nodes=nodes, rate=nodes / 30.0, duration=1.0, gpus=gpus)
    bucket = Subjects("fleet").bucket_name(BUCKET_NODES)
    bus = await NatsBus.connect(url, "bench-fill")
    try:
        for node_index in range(nodes):
            node = f"sim-{node_index:05d}"
            now = time.time()
            body = template(node, options, "boot").replace(b"%d" % SEQ_MARK, b"1")
            beat = codec.decode(body.replace(repr(TS_MARK).encode(), b"%.6f" % now), Heartbeat)
            if stale_after is not None:
                beat = msgspec.structs.replace(beat, stale_after=stale_after)
            if agent:
                beat = agent_shaped(beat, ZONES[node_index % len(ZONES)])
            record = record_rules.accepted(
                record_rules.pending_record(node, beat.cluster),
                beat,
                f"U{node_index:055d}",
                now,
                node_index + 1,
                now,
                record_rules.gpu_fingerprint(beat),
            )
            if state != record.state:
                record = msgspec.structs.replace(record, state=state)
            await bus.js.publish_async(f"$KV.{bucket}.{node}", codec.encode(record))
            if node_index % 4096 == 4095:
                await bus.js.publish_async_completed()
        await bus.js.publish_async_completed()
    finally:
        await bus.close()


RSS_TARGET_MB = 250
"""The aggregator's RSS at 100,000 nodes, records loaded and in the heartbeat run (issue
48; issue 12 asked 300)."""
SAMPLE_EVERY_3_S = {"FLEET_AGGREGATOR_DASHBOARD_HISTORY_INTERVAL": "3"}


def part_memory(bench: Bench) -> None:
    """The aggregator's RSS per node with ``--big-nodes`` records in memory (and its HTTP
    API), against the same process with none; the records put straight into fleet_nodes,
    no heartbeats: once with the simulator's heartbeats in them, once with a real
    agent's (its labels, capabilities and settings status: ``fill_records``' ``agent``),
    each in a fleet of its own. The dashboard samples every 3 s here, so that its history
    of every node (allocated whole at a node's first point) is in the figure, not only
    that of the nodes loaded by its first sample."""
    nodes, gpus = bench.args.big_nodes, bench.args.memory_gpus
    of = f"{gpus}-GPU " if gpus != 1 else ""
    for agent, shape in ((False, "the simulator's heartbeats"), (True, "agents' heartbeats")):
        with servers(bench) as cluster:
            aggregator = cluster.start_aggregator()
            aggregator.wait_owner(60)
            time.sleep(5)
            empty = aggregator.rss_mb()
            aggregator.stop()
            asyncio.run(fill_records(cluster.url, nodes, agent=agent, gpus=gpus))
            started = time.monotonic()
            aggregator = cluster.start_aggregator(env=SAMPLE_EVERY_3_S)
            owned = aggregator.wait_owner(300)
            time.sleep(10)
            rss = aggregator.rss_mb()
        bench.row(
            f"aggregator RSS with {nodes:,} {of}records of {shape} in memory, no heartbeats",
            f"≤ {RSS_TARGET_MB} MB",
            f"{rss:.0f} MB ({empty:.0f} MB with none: "
            f"{(rss - empty) * 2**20 / nodes:,.0f} bytes per node); records loaded "
            f"{fmt(owned)} after start ({time.monotonic() - started - 10:.0f} s), its "
            "command consumers still being made",
            rss <= RSS_TARGET_MB,
        )


def part_side(bench: Bench) -> None:
    """Two aggregators side by side under one load, each owning half the partitions, the
    second with ``--setting`` (``fetch_linger=0.25``: ``FLEET_AGGREGATOR_FETCH_LINGER``):
    CPU per accepted heartbeat of each, ``--repeat`` times. Both pay the same seconds of
    a shared machine, so a setting's effect shows where back-to-back runs of one
    aggregator drift by more than it (see README, "Hot path and checkpoints")."""
    key, _, value = bench.args.setting.partition("=")
    if not key or not value:
        raise SystemExit("--side needs --setting NAME=VALUE (an aggregator setting)")
    if bench.args.repeat < 1:
        raise SystemExit("--side needs --repeat 1 or more")
    try:
        # What the aggregator would refuse at start (an unknown name, a bad value), said here.
        msgspec.convert({key: value}, AggregatorConfig, strict=False)
    except msgspec.ValidationError as exc:
        raise SystemExit(f"--setting {key}={value}: {exc}") from None
    env = {f"FLEET_AGGREGATOR_{key.upper()}": value}
    rate = float(bench.args.rates.split(",")[-1])
    nodes = bench.args.nodes or round(rate * INTERVAL)
    partitions = bench.args.partitions or 8
    ratios: list[float] = []
    for round_index in range(bench.args.repeat):
        with servers(bench) as cluster:
            default = cluster.start_aggregator()
            default.wait_owner(60)
            changed = cluster.start_aggregator(env=env)
            if not wait_split(default, changed, partitions, 60):
                raise RuntimeError("the partitions did not split between the two aggregators")
            both = (default, changed)
            load = subprocess.Popen(
                cluster.simulate_command(
                    nodes, rate, bench.args.duration, "--wait", "0.01", "--gpus", "8"
                ),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            try:
                # Every node's first contact behind (twice the nodes accepted), then the
                # rest of the run.
                deadline = time.monotonic() + bench.args.duration
                while sum(a.metric(ACCEPTED) or 0 for a in both) < 2 * nodes:
                    if time.monotonic() > deadline:
                        raise RuntimeError("the nodes' first contacts did not end in time")
                    time.sleep(0.5)
                before = [a.start_mark() for a in both]
                load.wait(bench.args.duration + 60)
                after = [a.end_mark() for a in both]
            finally:
                if load.poll() is None:
                    load.kill()
                    load.wait()
        per = [
            (cpu1 - cpu0) / (got1 - got0) if got1 > got0 else float("nan")
            for (cpu0, got0), (cpu1, got1) in zip(before, after, strict=True)
        ]
        ratios.append(per[1] / per[0])
        bench.say(
            f"  round {round_index + 1}: {1e6 * per[0]:.1f} µs per accepted by default, "
            f"{1e6 * per[1]:.1f} µs with {key}={value} ({ratios[-1]:.3f}; accepted "
            f"{after[0][1] - before[0][1]:.0f} and {after[1][1] - before[1][1]:.0f})"
        )
    bench.row(
        f"side by side: CPU per accepted with {key}={value} ÷ by default",
        "—",
        f"median {statistics.median(ratios):.3f} of {len(ratios)} rounds "
        f"({', '.join(f'{r:.3f}' for r in ratios)}); {nodes} nodes x 8 GPUs at {rate:g}/s, "
        f"{partitions} partitions split between them",
    )


ONLY_ASKED = {"side"}
"""Parts ``--all`` leaves out: they compare a setting, and need one."""


def wait_split(first: Aggregator, second: Aggregator, partitions: int, timeout: float) -> bool:
    """Whether the two come to own half the ``partitions`` each (one more for one of
    them if odd) within ``timeout``."""
    half = partitions // 2
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        owned = sorted(a.metric("fleet_aggregator_owner") or 0 for a in (first, second))
        if owned == [half, partitions - half]:
            return True
        time.sleep(0.5)
    return False


@dataclass
class Part:
    name: str
    help: str
    run: Callable[[Bench], None]


PARTS = [
    Part("fleet", "(a') the same-run ratio at 5,000 nodes of 8 GPUs, --runs runs", part_fleet),
    Part("ratio", "(a) CPU per accepted ÷ bare verify, (b) one aggregator's rate", part_ratio),
    Part("two", "(b) the highest rate with two aggregators", part_two),
    Part("big", "(c) 100,000 nodes at 30 s for 2 min", part_big),
    Part("storm", "(d) 10,000 nodes stop at once: one stale alert each", part_storm),
    Part("cold", "(e) cold start with 100,000 records", part_cold),
    Part("failover", "(f) one of two aggregators SIGKILLed under load", part_failover),
    Part("memory", "aggregator RSS with --big-nodes records loaded, no heartbeats", part_memory),
    Part(
        "side", "two aggregators side by side, the second with --setting (not in --all)", part_side
    ),
]


def terminated(_signum: int, _frame: object) -> None:
    """SIGTERM as Ctrl-C: a bench's ``with servers(...)`` stops what it started either way."""
    raise KeyboardInterrupt


def main() -> int:
    args = options().parse_args()
    bench = Bench(args)
    if not any(bench.selected(part.name) for part in PARTS):
        options().print_usage()
        print(
            "choose parts (--fleet, --ratio, --two, --big, --storm, --cold, --failover, "
            "--memory, --side) or --all"
        )
        return 2
    signal.signal(signal.SIGTERM, terminated)  # so every part's cleanup runs
    started = time.monotonic()
    bench.say(
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {psutil.cpu_count()} CPUs, "
        f"{psutil.virtual_memory().total / 2**30:.0f} GB RAM shared by nats-server, the "
        f"aggregators and fleetctl simulate --processes {args.processes}"
        + (f"; aggregators --partitions {args.partitions}" if args.partitions else "")
    )
    for part in PARTS:
        if not bench.selected(part.name):
            continue
        bench.say(f"== {part.name}: {part.help}")
        try:
            part.run(bench)
        except KeyboardInterrupt:
            bench.say("interrupted")
            break
        except Exception as exc:  # one part failing must not lose the others' figures
            traceback.print_exc()
            bench.row(part.help, "—", f"failed: {type(exc).__name__}: {exc}", False)
    bench.say(f"\n{time.monotonic() - started:.0f} s in all\n")
    bench.table()
    return 0


if __name__ == "__main__":
    sys.exit(main())
