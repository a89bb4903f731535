"""What durability costs (a script, not collected by pytest): heartbeats per second a
three-server cluster acknowledges under each ``sync_interval``.

Starts ``deploy/nats/cluster/n1.conf … n3.conf`` on loopback (TLS routes, the generated
accounts, stores on this machine's disk, not tmpfs: an fsync must reach a disk to cost
anything), provisions the fleet's streams R3, and has ``--publishers`` concurrent
publishers send signed heartbeats of ``--nodes`` nodes (each acknowledged by FLEET_HB_IN,
then sourced into FLEET_HB) for ``--seconds``; for each setting, ``always`` (the shipped
one: an fsync before every acknowledgement), ``1s`` and nats-server's default ``2m``,
run ``--rounds`` times interleaved on a fresh cluster, prints the heartbeats per second
acknowledged, the servers' CPU per heartbeat, and the acknowledgement's p50 and p99.

Run: ``python tests/bench/bench_durability.py [--seconds 20] [--publishers 256] [--rounds 3]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from actors.fleet.storage.streams import StreamLimits, provision
from actors.runtime.bus import NatsBus
from actors.runtime.embedded import NatsServer
from schemas import codec, signing
from schemas.subjects import Subjects
from tests.support.deploy import STORE, fleet_auth, render
from tests.support.fleet import TEST_BUDGETS, heartbeat
from tests.support.pki import TLS_DIR, Pki
from tests.support.ports import free_port

SHIPPED = "sync_interval: always"
SETTINGS = {"always": SHIPPED, "1s": "sync_interval: 1s", "2m (default)": "sync_interval: 2m"}


def start_cluster(directory: Path, pki: Pki, aggregator: str, sync: str) -> list[NatsServer]:
    fleet_auth(directory, {}, aggregator)
    routes = [free_port() for _ in range(3)]
    servers = []
    for n in range(1, 4):
        replacements = {
            f"10.0.0.1{n}:4222": f"127.0.0.1:{free_port()}",
            f"10.0.0.1{n}:6222": f"127.0.0.1:{routes[n - 1]}",
            "ROUTE_PASSWORD": "bench",
            TLS_DIR: str(pki.dir),
            STORE: str(directory / f"js{n}"),
            SHIPPED: sync,
        }
        for peer in range(1, 4):
            replacements[f"@fleet-n{peer}:6222"] = f"@127.0.0.1:{routes[peer - 1]}"
        config = render(f"cluster/n{n}.conf", directory / f"n{n}.conf", replacements)
        servers.append(NatsServer(directory / f"n{n}", name=f"n{n}", config_file=config))
    for server in servers:
        server.start(timeout=30)
    return servers


async def measure(
    url: str, seed: str, pki: Pki, args: argparse.Namespace
) -> tuple[float, list[float]]:
    bus = await NatsBus.connect(url, "bench", nkey_seed=seed, tls=pki.client("bench"))
    subjects = Subjects("fleet")
    for _ in range(30):
        try:
            await provision(bus.js, subjects, replicas=3, limits=StreamLimits.of(TEST_BUDGETS))
            break
        except Exception:  # no meta leader yet
            await asyncio.sleep(1.0)
    keys = [signing.KeyPair.generate() for _ in range(args.nodes)]
    bodies = [codec.encode(heartbeat(node=f"b{i}", seq=1)) for i in range(args.nodes)]
    latencies: list[float] = []
    done = 0
    deadline = time.monotonic() + args.seconds

    async def publisher(index: int) -> None:
        nonlocal done
        seq = 0
        while time.monotonic() < deadline:
            node = (index + seq * args.publishers) % args.nodes
            seq += 1
            body = bodies[node]
            headers = {
                **keys[node].headers(body),
                "Nats-Msg-Id": os.urandom(8).hex(),
                "Nats-TTL": "30",
            }
            start = time.monotonic()
            try:
                await bus.js.publish(
                    subjects.heartbeat("c1", f"b{node}"), body, headers=headers, timeout=5
                )
            except Exception:
                continue
            latencies.append(time.monotonic() - start)
            done += 1

    started = time.monotonic()
    await asyncio.gather(*(publisher(i) for i in range(args.publishers)))
    rate = done / (time.monotonic() - started)
    await bus.close()
    return rate, latencies


def server_cpu(servers: list[NatsServer]) -> float:
    """CPU seconds the servers have used so far."""
    total = 0.0
    for server in servers:
        assert server.process is not None
        times = psutil.Process(server.process.pid).cpu_times()
        total += times.user + times.system
    return total


def one_round(
    sync: str, aggregator: signing.KeyPair, args: argparse.Namespace
) -> tuple[float, float, list[float]]:
    """(heartbeats/s acknowledged, server CPU µs per heartbeat, ack latencies) of one run
    of a fresh cluster under ``sync``."""
    with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp:
        directory = Path(tmp)
        pki = Pki(directory / "tls")
        servers = start_cluster(directory, pki, aggregator.public_key, sync)
        try:
            url = ",".join(server.url for server in servers)
            before = server_cpu(servers)
            rate, latencies = asyncio.run(measure(url, aggregator.seed, pki, args))
            cpu = server_cpu(servers) - before
        finally:
            for server in servers:
                server.stop()
    return rate, 1e6 * cpu / max(1.0, rate * args.seconds), latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--publishers", type=int, default=256)
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3, help="runs of each setting, interleaved")
    args = parser.parse_args()
    aggregator = signing.KeyPair.generate()
    print(
        f"{args.publishers} publishers, {args.nodes} nodes, {args.rounds} x {args.seconds:g} s "
        f"per setting; load average {os.getloadavg()[0]:.2f} at the start"
    )
    results: dict[str, list[tuple[float, float, list[float]]]] = {name: [] for name in SETTINGS}
    for _ in range(args.rounds):
        for name, sync in SETTINGS.items():
            results[name].append(one_round(sync, aggregator, args))
    for name, runs in results.items():
        rates = [rate for rate, _, _ in runs]
        cpu = statistics.median(per for _, per, _ in runs)
        ordered = sorted(latency for _, _, latencies in runs for latency in latencies) or [0.0]
        p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
        print(
            f"sync_interval {name:<13} median {statistics.median(rates):6.0f} heartbeats/s "
            f"(runs {', '.join(f'{rate:.0f}' for rate in rates)}); servers' CPU "
            f"{cpu:.0f} µs a heartbeat; ack p50 {statistics.median(ordered) * 1000:.1f} ms, "
            f"p99 {p99 * 1000:.1f} ms"
        )


if __name__ == "__main__":
    main()
