"""What happened in a run, as plain values: what the checker judges and what its unit test
builds by hand. Everything here was read from the outside: the operator's own records,
the streams (``FLEET_ALERTS``, ``FLEET_EVENTS``), a wiretap on the servers (acks of
``FLEET_HB``'s partition consumers, record writes, alert publishes), the processes' logs
and the nemesis's own timeline.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import msgspec


@dataclass(frozen=True)
class Settings:
    """The fleet's settings the bounds are made of (seconds)."""

    heartbeat_interval: float
    stale_after: float
    lease_ttl: float
    sweep_interval: float
    partitions: int = 8
    """FLEET_HB's partitions (the harness's ``run.PARTITIONS``; a run kept before this
    field was written had 8)."""


@dataclass
class Fault:
    """One fault of the nemesis: what, on whom, when, and who it stopped or cut off."""

    kind: str
    target: str
    started: float
    healed: float = 0.0
    stopped: list[str] = field(default_factory=list)
    """Nodes whose agent really stopped beating (SIGKILL, SIGSTOP) from ``started`` to
    ``healed``: each must be found stale, once, and recover once."""
    cut: list[str] = field(default_factory=list)
    """Nodes cut off from every server: they may be found stale (once) and then recover."""
    converged: float | None = None
    """Seconds from ``healed`` until the fleet converged; None: not within the bound."""
    note: str = ""


@dataclass(frozen=True)
class CommandSent:
    """One command of the operator: ``acked`` when FLEET_CMD acknowledged it (or said it
    already had it), None when no try was acknowledged."""

    id: str
    node: str
    action: str
    sent: float
    acked: float | None
    error: str = ""


@dataclass(frozen=True)
class Execution:
    """A node's log saying it ran a command (``command accepted``)."""

    command_id: str
    node: str
    at: float


@dataclass(frozen=True)
class Result:
    """A CommandResult stored in FLEET_EVENTS."""

    command_id: str
    node: str
    status: str
    ts: float


@dataclass(frozen=True)
class StoredAlert:
    """An Alert stored in FLEET_ALERTS; ``msg_id`` is its ``Nats-Msg-Id``."""

    msg_id: str
    kind: str
    node: str
    ts: float


@dataclass(frozen=True)
class Ack:
    """An acknowledgement of a partition consumer of FLEET_HB, seen on the wire; ``owner``
    is the inbox its acknowledged delivery went to (one per aggregator's partition loop)."""

    at: float
    consumer: str
    stream_seq: int
    owner: str


@dataclass(frozen=True)
class RecordWrite:
    """A write of a node's record in ``fleet_nodes``, seen on the wire."""

    at: float
    node: str
    state: str
    last_seq: int


@dataclass(frozen=True)
class Holding:
    """An aggregator judging one partition of FLEET_HB, read from its log: from the
    partition's ``heartbeats resumed`` (records loaded, consumer open) to the first
    ``partitions lost``, ``released`` or ``stopped`` naming it; ``until`` None: its log
    never ended it (a killed process), held to the run's end."""

    aggregator: str
    partition: int
    since: float
    until: float | None = None


@dataclass(frozen=True)
class LogLine:
    """A line of a process's log worth reporting (a crash, an alert not published)."""

    source: str
    at: float
    msg: str
    reason: str = ""
    traceback: bool = False
    ref: str = ""
    """The alert or command id the line names, if any."""


@dataclass
class Load:
    """The machine while the run ran: CPU busy and stolen (percent of all cores), the
    highest 1-minute load average, and the harness's own event-loop lag (how late its
    timers fired: a starved process)."""

    cores: int = 0
    busy_percent: float = 0.0
    steal_percent: float = 0.0
    load_max: float = 0.0
    lag_p99: float = 0.0
    lag_max: float = 0.0


@dataclass
class History:
    settings: Settings
    started: float
    """When the run was watched from: the fleet up and the wiretap listening."""
    ended: float
    nodes: list[str]
    faults: list[Fault] = field(default_factory=list)
    commands: list[CommandSent] = field(default_factory=list)
    executions: list[Execution] = field(default_factory=list)
    results: list[Result] = field(default_factory=list)
    alerts: list[StoredAlert] = field(default_factory=list)
    alert_publishes: list[tuple[float, str]] = field(default_factory=list)
    """(when, Nats-Msg-Id) of every alert publish seen on the wire, stored or not."""
    acks: list[Ack] = field(default_factory=list)
    records: list[RecordWrite] = field(default_factory=list)
    crashes: list[LogLine] = field(default_factory=list)
    """Actor crashes the processes logged."""
    not_published: list[LogLine] = field(default_factory=list)
    """Alerts and command results a process logged as not published."""
    holdings: list[Holding] | None = None
    """When each aggregator judged each partition; None: not recorded (a history kept
    before it was, or logs without a holding), every partition counts as owned."""
    load: Load = field(default_factory=Load)


def save(history: History, path: Path) -> None:
    """Write ``history`` as JSON (``--check`` judges it again without a run)."""
    path.write_bytes(msgspec.json.encode(history))


def load(path: Path) -> History:
    return msgspec.json.decode(path.read_bytes(), type=History)
