"""The harness's fleet as real processes: three nats-servers from the shipped
``deploy/nats/cluster/n1.conf … n3.conf`` (TLS routes that log in, the generated accounts, R3
streams), two ``fleetctl aggregator`` and five ``node-agent start`` with fake GPUs, each
in its own namespace (:mod:`tests.faults.net`), logging JSON to a file of its own in the
run directory. Every process is started with ``ip netns exec`` (which execs it: the pid
is the program's) and stopped, paused or killed by that pid.

Each server's store is a tmpfs of its own (:data:`STORE_MB`), so one disk can be filled
without touching the others.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from schemas import signing
from tests.faults.net import Network, sh
from tests.support.deploy import STORE, fleet_auth, render
from tests.support.pki import TLS_DIR, Pki

BIN = Path(sys.executable).parent
SERVERS = ["n1", "n2", "n3"]
AGGREGATORS = ["a1", "a2"]
AGENTS = ["g1", "g2", "g3", "g4", "g5"]
CLUSTER = "c1"
PREFIX = "fleet"
"""The shipped accounts name the default prefix."""
JS_API_PREFIX = "JS.FLEET.API"
STORE_MB = 192
CLOCK_SHIM = Path(__file__).resolve().parent / "clock"
REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Timing:
    """The fleet's settings the faults and the checker's bounds are made of."""

    heartbeat_interval: float = 1.0
    stale_after: float = 5.0
    lease_ttl: float = 3.0
    sweep_interval: float = 1.0
    fetch_linger: float = 0.25
    checkpoint_interval: float = 5.0


@dataclass
class Proc:
    """One program in one namespace, its output appended to ``log``."""

    name: str
    netns: str
    argv: list[str]
    log: Path
    env: dict[str, str] = field(default_factory=dict)
    process: subprocess.Popen[bytes] | None = None
    paused: bool = False
    starts: int = 0

    @property
    def pid(self) -> int:
        return self.process.pid if self.process is not None else 0

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> None:
        assert not self.running, f"{self.name} is running"
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                ["ip", "netns", "exec", self.netns, *self.argv],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **self.env},
                start_new_session=True,
                cwd=REPO,
            )
        self.paused = False
        self.starts += 1

    def send(self, sig: signal.Signals) -> None:
        if self.running:
            os.kill(self.pid, sig)

    def pause(self) -> None:
        self.send(signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        self.send(signal.SIGCONT)
        self.paused = False

    def kill(self) -> None:
        if self.process is not None:
            self.resume()
            self.send(signal.SIGKILL)
            self.process.wait(timeout=30)

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM, then SIGKILL if it has not exited within ``timeout``."""
        if self.process is None:
            return
        if self.running:
            self.resume()
            self.send(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()


class Cluster:
    """Every process of the run, its keys, certificates and configurations."""

    def __init__(self, run_dir: Path, network: Network, timing: Timing) -> None:
        self.dir = run_dir
        self.network = network
        self.timing = timing
        self.pki = Pki(run_dir / "tls", tuple(network.address(name) for name in SERVERS))
        self.route_password = secrets.token_hex(12)
        self.aggregator_key = signing.KeyPair.generate()
        self.operator_key = signing.KeyPair.generate()
        self.node_keys: dict[str, signing.KeyPair] = {}
        self.servers: dict[str, Proc] = {}
        self.aggregators: dict[str, Proc] = {}
        self.agents: dict[str, Proc] = {}
        self.mounts: list[Path] = []

    @property
    def urls(self) -> str:
        return ",".join(self.url(name) for name in SERVERS)

    def url(self, server: str) -> str:
        return f"tls://{self.network.address(server)}:4222"

    def store(self, server: str) -> Path:
        return self.dir / server / "store"

    def state_dir(self, agent: str) -> Path:
        return self.dir / agent / "state"

    def clock_file(self, agent: str) -> Path:
        return self.dir / agent / "clock"

    def prepare(self) -> None:
        """Keys, accounts, certificates, configurations and each server's tmpfs."""
        for agent in AGENTS:
            self.node_keys[agent] = signing.load_or_create_key_file(
                self.state_dir(agent) / "node.nk"
            )
        auth = fleet_auth(
            self.dir / "auth",
            {agent: (CLUSTER, key.public_key) for agent, key in self.node_keys.items()},
            self.aggregator_key.public_key,
        )
        (self.dir / "aggregator.nk").write_text(self.aggregator_key.seed)
        os.chmod(self.dir / "aggregator.nk", 0o600)
        for number, server in enumerate(SERVERS, 1):
            self._prepare_server(number, server, auth.read_text())
        for aggregator in AGGREGATORS:
            self._prepare_aggregator(aggregator)
        for agent in AGENTS:
            self._prepare_agent(agent)

    def _prepare_server(self, number: int, server: str, auth: str) -> None:
        directory = self.dir / server
        store = self.store(server)
        store.mkdir(parents=True, exist_ok=True)
        sh("mount", "-t", "tmpfs", "-o", f"size={STORE_MB}m", "tmpfs", str(store))
        self.mounts.append(store)
        address = self.network.address(server)
        replacements = {
            f"10.0.0.1{number}:4222": f"{address}:4222",
            f"10.0.0.1{number}:6222": f"{address}:6222",
            "ROUTE_PASSWORD": self.route_password,
            TLS_DIR: str(self.pki.dir),
            STORE: str(store),
        }
        for peer_number, peer in enumerate(SERVERS, 1):
            replacements[f"@fleet-n{peer_number}:6222"] = f"@{self.network.address(peer)}:6222"
        config = render(f"cluster/n{number}.conf", directory / f"{server}.conf", replacements)
        (directory / "fleet-auth.conf").write_text(auth)
        self.servers[server] = Proc(
            server,
            self.network.members[server].netns,
            [str(BIN / "nats-server"), "-c", str(config)],
            directory / f"{server}.log",
        )

    def _tls(self, name: str) -> str:
        cert, key = self.pki.issue(name)
        return f'tls_ca = "{self.pki.ca_file}"\ntls_cert = "{cert}"\ntls_key = "{key}"\n'

    def _prepare_aggregator(self, name: str) -> None:
        directory = self.dir / name
        directory.mkdir(parents=True, exist_ok=True)
        t = self.timing
        config = directory / "aggregator.toml"
        config.write_text(
            f'server = "{self.urls}"\n'
            f'nkey_file = "{self.dir / "aggregator.nk"}"\n' + self._tls(name) + "replicas = 3\n"
            'log_format = "json"\n'
            f"lease_ttl = {t.lease_ttl}\n"
            f"sweep_interval = {t.sweep_interval}\n"
            f"fetch_linger = {t.fetch_linger}\n"
            f"checkpoint_interval = {t.checkpoint_interval}\n"
            "http_port = 9092\n"
            "heartbeats_max_bytes = 8388608\n"
            "records_max_bytes = 8388608\n"
            "commands_max_bytes = 4194304\n"
            "results_max_bytes = 4194304\n"
            "alerts_max_bytes = 4194304\n"
            "trust_max_bytes = 1048576\n"
            "enroll_max_bytes = 1048576\n"
        )
        self.aggregators[name] = Proc(
            name,
            self.network.members[name].netns,
            [str(BIN / "fleetctl"), "aggregator", "--config", str(config)],
            directory / f"{name}.log",
        )

    def _prepare_agent(self, name: str) -> None:
        directory = self.dir / name
        t = self.timing
        config = directory / "agent.toml"
        config.write_text(
            f'server = "{self.urls}"\n'
            f'node_id = "{name}"\n'
            f'cluster = "{CLUSTER}"\n'
            f'state_dir = "{self.state_dir(name)}"\n'
            "nkey_auth = true\n"
            f'js_api_prefix = "{JS_API_PREFIX}"\n'
            + self._tls(name)
            + f"heartbeat_interval = {t.heartbeat_interval}\n"
            f"stale_after = {t.stale_after}\n"
            "fake_gpus = 2\n"
            f'trust_operators = ["{self.operator_key.public_key}"]\n'
            'scheduler = "none"\n'
            'gateway = "off"\n'
            'log_format = "json"\n'
            "shutdown_timeout = 5\n"
        )
        self.clock_file(name).write_text("0\n")
        self.agents[name] = Proc(
            name,
            self.network.members[name].netns,
            [str(BIN / "node-agent"), "start", "--config", str(config)],
            directory / f"{name}.log",
            env={"PYTHONPATH": str(CLOCK_SHIM), "FLT_CLOCK_FILE": str(self.clock_file(name))},
        )

    def all_procs(self) -> list[Proc]:
        return [*self.agents.values(), *self.aggregators.values(), *self.servers.values()]

    def wait_server_ready(self, server: str, since: int, timeout: float = 30.0) -> None:
        """Until ``server``'s log says it is ready after byte ``since`` of it."""
        log = self.servers[server].log
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if log.exists() and b"Server is ready" in log.read_bytes()[since:]:
                return
            if not self.servers[server].running:
                raise RuntimeError(f"{server} exited; see {log}")
            time.sleep(0.1)
        raise RuntimeError(f"{server} not ready within {timeout:g}s; see {log}")

    def start_server(self, server: str) -> None:
        proc = self.servers[server]
        since = proc.log.stat().st_size if proc.log.exists() else 0
        proc.start()
        self.wait_server_ready(server, since)

    def stop_all(self) -> None:
        """Every process by its pid (agents first, servers last), then the mounts."""
        for proc in self.all_procs():
            try:
                proc.stop(timeout=15)
            except (OSError, subprocess.SubprocessError):
                proc.kill()
        for mount in self.mounts:
            sh("umount", "-l", str(mount), check=False)
        self.mounts.clear()
