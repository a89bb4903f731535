"""``python -m tests.faults.run --minutes M --seed S``: the fault harness, its nemesis and
its checker, end to end (as root). Prints the checker's figures and every violation, and
exits 0 when there is none, 1 when there is one, 2 when the run itself could not be made
(not root, a tool missing, the fleet not starting). One run at a time on a machine: a run
starts by removing what any earlier one left (namespaces ``flt-*``, their processes).
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import logging
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from pathlib import Path
from typing import TextIO

import msgspec
import nats.errors
import nats.js.errors

from actors.fleet.storage.registry import approve
from actors.runtime.bus import NatsBus, unanswered
from schemas import codec
from schemas.errors import DecodeError, FleetError
from schemas.messages import AggregatorLease, CommandResult
from schemas.subjects import BUCKET_LEASES, BUCKET_NODES, STREAM_EVENTS, Subjects, lease_key
from tests.faults import collect
from tests.faults.checker import Bounds, Report, check, overloaded
from tests.faults.cluster import AGENTS, AGGREGATORS, PREFIX, SERVERS, Cluster, Timing
from tests.faults.history import History, Settings, load, save
from tests.faults.nemesis import Nemesis, schedule
from tests.faults.net import LOCK, RUN_MARK, Network, clean_leftovers, only_run
from tests.faults.operator import Operator, Wiretap

log = logging.getLogger("tests.faults.run")

PARTITIONS = 8
CONVERGE_BOUND = 60.0
"""Seconds a heal may take to converge (the checker's bound, stated)."""
START_TIMEOUT = 120.0
NOT_LIVE = frozenset({"stale", "offline", "pending", "stopped", "deregistered"})
TOOLS = ("ip", "nft", "mount", "umount")
HISTORY = "history.json"


def preflight() -> str:
    """Why this machine cannot run the harness ("" when it can)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, nft, tmpfs mounts)"
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        return f"needs {', '.join(missing)}"
    return ""


class Run:
    """One run's fleet, clients and records, in the hub namespace."""

    def __init__(self, cluster: Cluster, seed: int, minutes: float) -> None:
        self.cluster = cluster
        self.seed = seed
        self.minutes = minutes
        self.subjects = Subjects(PREFIX)
        self.results: dict[str, set[str]] = {}
        self.results_seq = 0
        self.bus: NatsBus | None = None

    async def connect(self) -> NatsBus:
        c = self.cluster
        bus = await NatsBus.connect(
            c.urls,
            "flt-harness",
            nkey_seed=c.aggregator_key.seed,
            tls=c.pki.client("harness"),
            retry_forever=True,
        )
        self.bus = bus
        return bus

    async def start_fleet(self) -> None:
        c = self.cluster
        await asyncio.gather(*(asyncio.to_thread(c.start_server, s) for s in SERVERS))
        bus = await self.connect()
        await until(lambda: _answers(bus.js.account_info()), "JetStream up")
        for name in AGGREGATORS:
            c.aggregators[name].start()

        async def approved_all() -> bool:
            try:
                for agent in AGENTS:
                    key = c.node_keys[agent].public_key
                    await approve(bus, self.subjects, agent, key)
            except (FleetError, nats.errors.Error, TimeoutError):
                return False  # not provisioned yet, or a timeout while the cluster settles
            return True

        await until(approved_all, "streams provisioned and nodes approved")
        for name in AGENTS:
            c.agents[name].start()
        await until(self.nodes_live, "every node live")

    async def read_results(self) -> None:
        """Take in the results FLEET_EVENTS stored since the last call: from the stream,
        so a result published while the harness's own server was cut off is seen too."""
        assert self.bus is not None
        stream = self.subjects.stream_name(STREAM_EVENTS)
        try:
            async with asyncio.timeout(5.0):
                last = (await self.bus.js.stream_info(stream)).state.last_seq
                while self.results_seq < last:
                    try:
                        msg = await self.bus.js.get_msg(stream, self.results_seq + 1)
                        result = codec.decode(msg.data or b"", CommandResult, msg.subject or "")
                        self.results.setdefault(result.command_id, set()).add(result.status)
                    except (nats.js.errors.NotFoundError, DecodeError):
                        pass
                    # Past a message only once it was read (or is not there): a read that
                    # timed out is tried again at the next call.
                    self.results_seq += 1
        except (nats.errors.Error, TimeoutError) as exc:
            # The harness is a client like any: it leaves a server that lost its quorum.
            if unanswered(exc):
                self.bus.jetstream_answered(False)
            return  # read on at the next call
        self.bus.jetstream_answered(True)

    async def nodes_live(self) -> bool:
        """Whether every agent's record in ``fleet_nodes`` says it is live."""
        assert self.bus is not None
        try:
            nodes = await self.bus.kv(self.subjects.bucket_name(BUCKET_NODES))
            for agent in AGENTS:
                async with asyncio.timeout(2.0):
                    entry = await nodes.get(agent)
                state = msgspec.json.decode(entry.value or b"{}", type=dict[str, object]).get(
                    "state"
                )
                if state in NOT_LIVE or state is None:
                    return False
        except (nats.errors.Error, TimeoutError, msgspec.DecodeError):
            return False  # unreadable while the cluster settles
        return True

    async def partitions_held(self) -> bool:
        """Whether every partition's lease is held and was renewed within two ttls."""
        assert self.bus is not None
        try:
            leases = await self.bus.kv(self.subjects.bucket_name(BUCKET_LEASES))
            for partition in range(PARTITIONS):
                async with asyncio.timeout(2.0):
                    entry = await leases.get(lease_key(partition))
                lease = codec.decode(entry.value or b"", AggregatorLease, lease_key(partition))
                if time.time() - lease.renewed > 2 * self.cluster.timing.lease_ttl:
                    return False
        except (nats.errors.Error, TimeoutError, DecodeError):
            return False  # missing (deleted on a release), or unreadable while it settles
        return True

    async def replicas_caught_up(self) -> bool:
        """Whether every stream has a leader and every replica of it is current (not
        offline, caught up with its leader)."""
        assert self.bus is not None
        try:
            async with asyncio.timeout(5.0):
                streams = await self.bus.js.streams_info()
        except (nats.errors.Error, TimeoutError):
            return False
        for info in streams:
            cluster = info.cluster
            if cluster is None or not cluster.leader:
                return False
            if any(not peer.current or peer.offline for peer in cluster.replicas or []):
                return False
        return True

    def results_in(self, operator: Operator) -> bool:
        """Whether every command FLEET_CMD acknowledged has its final result."""
        finals = {"done", "failed", "rejected"}
        return all(
            self.results.get(command.id, set()) & finals
            for command in operator.sent
            if command.acked is not None
        )

    async def main(self) -> tuple[History, str]:
        c, t = self.cluster, self.cluster.timing
        await self.start_fleet()
        assert self.bus is not None
        bus = self.bus
        wiretap = Wiretap()
        await wiretap.start(
            [c.url(s) for s in SERVERS], c.aggregator_key.seed, c.pki.client("wiretap")
        )
        # The run is judged from here, where the wiretap sees acks and records: from the
        # fleet's start (45 s before on a fresh cluster) a partition whose first fault
        # came early read as silent for the unwatched start.
        started = time.time()
        meter = collect.LoadMeter()
        operator = Operator(bus, c.operator_key, AGENTS, random.Random(self.seed))
        stop = asyncio.Event()

        async def converged() -> bool:
            await self.read_results()
            return (
                self.results_in(operator)
                and await self.nodes_live()
                and await self.partitions_held()
            )

        nemesis = Nemesis(c, self.seed, converged, CONVERGE_BOUND, self.replicas_caught_up)
        tasks = [asyncio.create_task(meter.run()), asyncio.create_task(operator.run(stop))]
        failure = ""
        try:
            plans = schedule(self.seed, self.minutes, t.stale_after, t.lease_ttl)
            await nemesis.run(plans, self.minutes)
        except Exception as exc:  # the run is reported, with what broke it
            failure = f"nemesis stopped: {exc!r}"
            await asyncio.to_thread(nemesis.heal_everything)
        stop.set()
        await tasks[1]
        final = await nemesis.wait_converged(time.time())
        if final is None:
            failure = failure or f"fleet not converged {CONVERGE_BOUND:g}s after the last heal"
        tasks[0].cancel()
        history = History(
            Settings(
                t.heartbeat_interval, t.stale_after, t.lease_ttl, t.sweep_interval, PARTITIONS
            ),
            started,
            time.time(),
            list(AGENTS),
            faults=nemesis.faults,
            commands=operator.sent,
            alerts=await collect.stored_alerts(bus),
            results=await collect.stored_results(bus),
            alert_publishes=sorted((at, msg_id) for msg_id, at in wiretap.alert_publishes.items()),
            acks=wiretap.ack_list(),
            records=sorted(wiretap.records.values(), key=lambda r: r.at),
            load=meter.figures(),
        )
        await wiretap.close()
        await bus.close()
        return history, failure


async def until(
    condition: Callable[[], Awaitable[bool]], what: str, timeout: float = START_TIMEOUT
) -> None:
    """Wait for ``condition``, bounded: the fleet's start, each step of it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await condition():
            return
        await asyncio.sleep(0.5)
    raise RuntimeError(f"{what}: not within {timeout:g}s")


async def _answers(request: Awaitable[object]) -> bool:
    """Whether ``request`` got an answer (JetStream up), within 3 s."""
    try:
        async with asyncio.timeout(3.0):
            await request
    except (nats.errors.Error, TimeoutError, nats.js.errors.APIError):
        return False
    return True


def read_logs(history: History, cluster: Cluster) -> None:
    for name, proc in cluster.agents.items():
        history.executions += collect.executions(name, proc.log)
    for name, proc in [*cluster.agents.items(), *cluster.aggregators.items()]:
        crashes, lost = collect.notable(name, proc.log)
        history.crashes += crashes
        history.not_published += lost
    held = [
        h for name, proc in cluster.aggregators.items() for h in collect.holdings(name, proc.log)
    ]
    # None when no aggregator logged a holding: the checker then counts every partition
    # as owned throughout (its strict rule), rather than none as owned.
    history.holdings = held or None


def print_report(report: Report, history: History, failure: str, out: TextIO) -> None:
    write = out.write
    f = report.figures
    write(f"fault run: {f['minutes']} min, faults {f['faults']}\n")
    write(f"commands: {f['commands']}\n")
    write(f"stale: false {f['false_stale']}, missed {f['missed_stale']}\n")
    write(f"double owners: {f['double_owners']}\n")
    write(f"alerts: {f['alerts']}\n")
    write(f"convergence after a heal (s): {f['convergence_s']}\n")
    write(f"actor crashes logged: {f['crashes']}\n")
    write(f"machine: {f['load']}\n")
    busy = overloaded(history)
    if busy:
        write(f"note: the machine was overloaded ({busy}): timings include starvation\n")
    for fault in history.faults:
        converged = "never" if fault.converged is None else f"{fault.converged:.1f}s"
        write(
            f"  {fault.kind:<20} {fault.target:<4} {fault.healed - fault.started:5.1f}s, "
            f"converged {converged} {fault.note}\n"
        )
    for violation in report.violations:
        write(f"VIOLATION {violation.kind}: {violation.detail}\n")
    if failure:
        write(f"RUN FAILED: {failure}\n")
    write(f"{len(report.violations)} violations\n")


def judge(history: History, failure: str, run_dir: Path, json_path: Path | None) -> int:
    """Check ``history``, print the report (and keep it in the run directory); the exit
    status: 0 clean, 1 any violation or a failed run."""
    report = check(history, Bounds.of(history.settings, CONVERGE_BOUND))
    text = io.StringIO()
    print_report(report, history, failure, text)
    sys.stdout.write(text.getvalue())
    (run_dir / "report.txt").write_text(text.getvalue())
    if json_path is not None:
        json_path.write_text(
            json.dumps(
                {"figures": report.figures, "violations": [asdict(v) for v in report.violations]},
                indent=2,
                default=str,
            )
        )
    return 1 if report.violations or failure else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.faults.run", description=__doc__)
    parser.add_argument("--minutes", type=float, default=3.0, help="length of the fault schedule")
    parser.add_argument("--seed", type=int, default=1, help="seed of the schedule and targets")
    parser.add_argument("--dir", type=Path, help="run directory (default: a new one in /tmp)")
    parser.add_argument(
        "--keep", action="store_true", help="keep the run directory (kept anyway on a violation)"
    )
    parser.add_argument("--json", type=Path, help="also write the report here, as JSON")
    parser.add_argument(
        "--check",
        type=Path,
        metavar="RUN_DIR",
        help="judge the history a kept run directory holds again, without a run",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.check is not None:
        return judge(load(args.check / HISTORY), "", args.check, args.json)
    problem = preflight()
    if problem:
        sys.stderr.write(f"faults: {problem}\n")
        return 2
    lock = only_run()
    if lock is None:
        sys.stderr.write(f"faults: another fault run holds {LOCK}: one run at a time\n")
        return 2
    for leftover in clean_leftovers():
        log.info("removed leftover %s", leftover)
    run_dir = args.dir or Path(tempfile.gettempdir()) / f"{RUN_MARK}{args.seed}-{os.getpid()}"
    run_dir.mkdir(parents=True, exist_ok=True)
    network = Network(SERVERS + AGGREGATORS + AGENTS)
    cluster = Cluster(run_dir, network, Timing())
    try:
        network.create()
        cluster.prepare()
        Network.enter_hub()
        history, failure = asyncio.run(Run(cluster, args.seed, args.minutes).main())
    except Exception as exc:
        sys.stderr.write(f"faults: the run could not be made: {exc!r} (logs in {run_dir})\n")
        return 2
    finally:
        cluster.stop_all()
        network.destroy()
    read_logs(history, cluster)
    save(history, run_dir / HISTORY)
    logs = {proc.name: proc.log for proc in cluster.all_procs()}
    (run_dir / "timeline.txt").write_text("\n".join(collect.timeline(history, logs)) + "\n")
    status = judge(history, failure, run_dir, args.json)
    if args.keep or status:
        sys.stdout.write(f"run directory: {run_dir} (timeline.txt, report.txt, {HISTORY})\n")
    else:
        shutil.rmtree(run_dir, ignore_errors=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
