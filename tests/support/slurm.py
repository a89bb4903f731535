"""A real single-node Slurm cluster for tests: ``munged``, ``slurmctld`` and ``slurmd`` run
from a temp dir on free ports, named after this host (Slurm's default node name), and are
stopped by PID at the end (../shared/recipes/slurm-single-node.md).

Slurm's state belongs to the host, not to a test, so one cluster serves a test module and
each test puts the node back (:meth:`SlurmCluster.reset`) before it starts.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.support.fleet import HANG, poll, wait_for
from tests.support.ports import free_port

BINARIES = ("munged", "slurmctld", "slurmd", "scontrol", "squeue", "sbatch", "sinfo")
TOOL_TIMEOUT = 10.0


def missing_binaries() -> list[str]:
    return [name for name in BINARIES if shutil.which(name) is None]


@dataclass
class SlurmCluster:
    """One running cluster: its config file (what ``SLURM_CONF`` names) and the node."""

    root: Path
    conf: Path
    node: str

    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def tool(self, *args: str) -> str:
        """Run a Slurm tool against this cluster; its stdout (raises on failure)."""
        done = subprocess.run(
            args, env=self.env(), capture_output=True, text=True, timeout=TOOL_TIMEOUT, check=True
        )
        return done.stdout

    def sbatch(self, seconds: float) -> str:
        """Submit ``sleep seconds`` to this node; the job id."""
        # The job's output goes to the cluster's temp dir, not slurm-<id>.out in the cwd.
        output = str(self.root / "slurm-%j.out")
        out = self.tool(
            "sbatch", "--parsable", "-w", self.node, "-o", output, "--wrap", f"sleep {seconds:g}"
        )
        return out.strip().split(";")[0]

    def cancel(self, job: str) -> None:
        """End job ``job`` now: tests end their jobs themselves, so no assertion races a
        job's own end on a loaded machine."""
        self.tool("scancel", job)

    def running(self) -> list[str]:
        return self.tool("squeue", "--noheader", "-w", self.node, "-t", "R,CG", "-o", "%i").split()

    def node_line(self) -> str:
        return self.tool("scontrol", "show", "node", self.node, "--oneliner")

    def state(self) -> str:
        """Slurm's node state, lower case (``idle``, ``mixed+drain``, ...)."""
        for word in self.node_line().split():
            if word.startswith("State="):
                return word.removeprefix("State=").lower()
        raise AssertionError(f"no State in {self.node_line()!r}")

    def wait_state(self, check: str, timeout: float = HANG) -> str:
        """Poll until the node's state has every ``+``-flag of ``check``."""
        try:
            poll(lambda: self.has_state(check), timeout, interval=0.2)
        except AssertionError:
            raise AssertionError(
                f"Slurm node {self.state()}, not {check}, after {timeout:g}s"
            ) from None
        return self.state()

    def answers(self) -> bool:
        """slurmctld answers ``scontrol ping``."""
        try:
            self.tool("scontrol", "ping")
        except subprocess.CalledProcessError:
            return False
        return True

    def has_state(self, check: str) -> bool:
        """The node's state has every ``+``-flag of ``check``."""
        return set(check.split("+")) <= set(self.state().split("+"))

    async def until_state(self, check: str, timeout: float = HANG) -> None:
        """As :meth:`wait_state`, without blocking the event loop the agent runs in."""
        await wait_for(lambda: self.has_state(check), timeout)

    def reset(self) -> None:
        """Cancel every job and resume the node: each test starts from an idle node."""
        self.tool("scancel", "-w", self.node)
        poll(lambda: not self.running(), interval=0.2)
        if "drain" in self.state().split("+"):
            self.tool("scontrol", "update", f"nodename={self.node}", "state=resume")
        self.wait_state("idle")


CONF = """\
ClusterName=fleettest
SlurmctldHost={host}
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
AuthInfo=socket={root}/munge/run/munge.sock
CryptoType=crypto/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1
ReturnToService=2
MpiDefault=none
NodeName={host} CPUs=2 RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


def _stop(pid_file: Path) -> None:
    """SIGTERM the daemon named by ``pid_file``, SIGKILL if it has not gone in 10 s."""
    try:
        pid = int(pid_file.read_text().strip())
    except (OSError, ValueError):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)

    def gone() -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False

    try:
        poll(gone, timeout=10, interval=0.1)
    except AssertionError:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def start_munged(root: Path) -> Path:
    munge = root / "munge"
    (munge / "run").mkdir(parents=True)
    munge.chmod(0o700)
    key = munge / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    subprocess.run(
        [
            "munged",
            f"--key-file={key}",
            f"--socket={munge}/run/munge.sock",
            f"--pid-file={munge}/munged.pid",
            f"--log-file={munge}/munged.log",
            f"--seed-file={munge}/seed",
            "-f",
        ],
        check=True,
        timeout=TOOL_TIMEOUT,
    )
    return munge / "munged.pid"


def start_daemon(cluster: SlurmCluster, daemon: str) -> Path:
    """Start ``slurmctld`` or ``slurmd`` (each daemonizes); its PID file."""
    subprocess.run(
        [daemon, "-f", str(cluster.conf)], env=cluster.env(), check=True, timeout=TOOL_TIMEOUT
    )
    return cluster.root / f"{daemon}.pid"


@contextlib.contextmanager
def slurm_cluster(root: Path) -> Iterator[SlurmCluster]:
    """A cluster in ``root``, its node idle; every daemon stopped by PID on the way out."""
    host = socket.gethostname().split(".")[0]
    for sub in ("state", "spool", "log"):
        (root / sub).mkdir(parents=True)
    conf = root / "slurm.conf"
    conf.write_text(
        CONF.format(host=host, root=root, ctld_port=free_port(), slurmd_port=free_port())
    )
    cluster = SlurmCluster(root=root, conf=conf, node=host)
    pid_files: list[Path] = []
    try:
        pid_files.append(start_munged(root))
        pid_files.append(start_daemon(cluster, "slurmctld"))
        poll(cluster.answers, interval=0.2)
        pid_files.append(start_daemon(cluster, "slurmd"))
        cluster.wait_state("idle")
        yield cluster
    finally:
        for pid_file in reversed(pid_files):
            _stop(pid_file)


def stop_daemon(cluster: SlurmCluster, daemon: str) -> None:
    """Stop ``slurmctld`` or ``slurmd`` of ``cluster`` by its PID file."""
    _stop(cluster.root / f"{daemon}.pid")
