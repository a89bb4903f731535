"""``fleetctl describe``'s rendering: one node's record explained top to bottom (state and
why, schedulability and who set it, health, GPUs, host, engines, workloads, latency, spot,
Slurm, the fleet's settings), then its recent alerts and command results. What only the
node says (who set its state, its host name) is labelled as its claim; what the fleet
recorded itself (the policy's hold, the enrolled identity) is said as a fact."""

from __future__ import annotations

from collections.abc import Collection

from actors.cli.render.tables import (
    UNKNOWN_NOW,
    event_line,
    grid,
    in_maintenance,
    printable,
)
from actors.fleet.identity import claimed, differences, summary
from actors.fleet.live import workload_status
from actors.fleet.live.reader import LiveRecord
from actors.fleet.views.history import Entry
from actors.runtime.spans import age, clock, span
from schemas.events import Engine, Health, HostFacts, Latency, Sample, Scheduler, SpotStatus
from schemas.messages import CommandResult, NodeRecord, TrustEntry, WorkloadSummary

RECENT = 10
"""How many alerts and command results ``fleetctl describe`` shows."""


def _opt(value: float | int | None, unit: str = "", fmt: str = "{:g}") -> str:
    return "-" if value is None else fmt.format(value) + unit


def describe(
    record: NodeRecord,
    alerts: list[Entry],
    results: list[Entry],
    now: float,
    remediation: list[str] | None = None,
    identity: list[str] | None = None,
    policy_keys: Collection[str] = (),
    settings: list[str] | None = None,
) -> str:
    """``fleetctl describe``: the record and why it is in its state, read top to bottom;
    ``remediation``: what the remediation policy holds of the node and did to it;
    ``identity``: its enrolled identity against its claims (:func:`identity_lines`);
    ``settings``: the fleet's settings for it (:mod:`actors.cli.render.settings`);
    ``policy_keys``: the keys the policy signs with (a node naming one while the policy
    holds nothing of it is said to)."""
    beat = record.heartbeat
    lines = [
        f"Node:            {record.node_id}",
        f"Cluster:         {record.cluster}",
        f"State:           {record.state}{_why(record)}",
        f"Last seen:       {age(now - record.last_seen) if record.last_seen else 'never'}"
        f" (seq {record.last_seq}, agent {record.agent_version or '-'})",
    ]
    if isinstance(record, LiveRecord) and beat is not None:
        lines.append(f"Heartbeat:       {_liveness(record, now)}")
    lines.append(f"Schedulability:  {_schedulability(record, results, policy_keys)}")
    if in_maintenance(record):
        lines.append(
            f"Maintenance:     window {in_maintenance(record)}: alerts recorded, not forwarded "
            "(fleetctl maintenance list)"
        )
    lines += remediation or []
    claims = f" ({CLAIM}s)" if record.labels else ""
    lines.append(f"Labels:          {labels_text(record.labels)}{claims}")
    lines += identity or []
    lines += _lifecycle(record)
    if beat is None:
        lines.append("No heartbeat accepted yet.")
        lines += _recent(alerts, results)
        return "\n".join(printable(line) for line in lines)
    if beat.sample is not None and beat.sample.hostname:
        lines.insert(2, f"Hostname:        {beat.sample.hostname} ({CLAIM})")
    if record.state in UNKNOWN_NOW:
        lines.append(f"Reported:        what follows is from its last heartbeat, {clock(beat.ts)}")
    lines += _health(beat.health, record.state)
    lines += _gpus(beat.sample)
    agent_up = beat.ts - beat.started if beat.started is not None else None
    lines += _host(beat.sample.host if beat.sample is not None else None, agent_up)
    lines += _engines(beat.engine)
    lines += _workloads(record, beat.workloads, now)
    lines += _latency(beat.latency)
    lines.append(f"Spot:            {_spot(beat.spot)}")
    if beat.scheduler is not None:
        lines += _slurm(beat.scheduler)
    lines += settings or []
    lines += _recent(alerts, results)
    # printable() is idempotent, so escaping the already escaped tables again is harmless.
    return "\n".join(printable(line) for line in lines)


def _workloads(record: NodeRecord, workloads: list[WorkloadSummary], now: float) -> list[str]:
    """The node's workloads as its heartbeat lists them, each as it is now (``unknown`` on a
    node that does not report, ``orphaned`` on a forgotten one: ``fleetctl workloads`` has
    the fleet's, placed replicas and moves included)."""
    if not workloads:
        return ["Workloads:       none"]
    rows = [("NAME", "STATE", "ENGINE", "MODEL", "GPUS", "PORT", "RESTARTS", "")]
    rows += [
        (
            w.name,
            workload_status.status(record, w, (), now),
            w.engine,
            w.model or "-",
            ",".join(map(str, w.gpus)) or "-",
            str(w.port),
            str(w.restarts),
            "placed" if w.placed else "",
        )
        for w in workloads
    ]
    return ["Workloads:", *grid(rows)]


def _liveness(record: LiveRecord, now: float) -> str:
    """Whether describe shows the node's latest accepted heartbeat, read just now."""
    if record.live:
        return "the latest accepted, read live from FLEET_HB"
    return (
        f"NOT LIVE ({record.live_note}): the record's checkpoint is shown, "
        f"{age(now - record.last_seen) if record.last_seen else 'never'}"
    )


def labels_text(labels: dict[str, str]) -> str:
    """Labels as ``key=value`` words, sorted; ``none`` when there are none."""
    return " ".join(f"{key}={value}" for key, value in sorted(labels.items())) or "none"


def _lifecycle(record: NodeRecord) -> list[str]:
    """Who deregistered the node and why, and whether its heartbeats are being refused."""
    lines = []
    if record.deregistered:
        when = clock(record.deregistered_at) if record.deregistered_at else "?"
        lines.append(
            f"Deregistered:    by {record.deregistered_by or 'node'} at {when}"
            + (f": {record.deregistered_reason}" if record.deregistered_reason else "")
        )
    if record.refused:
        lines.append(f"Refused:         its heartbeats are refused ({record.refused})")
    return lines


def _why(record: NodeRecord) -> str:
    """What the record itself says about a state that no heartbeat explains."""
    if record.offline_since:
        return f" (offline since {clock(record.offline_since)})"
    if record.stale_since:
        last = clock(record.last_seen) if record.last_seen else "never"
        return f" (no heartbeat since {last}; stale since {clock(record.stale_since)})"
    if record.stopped_since:
        return f" (stopped on request at {clock(record.stopped_since)})"
    if record.pending_since:
        return f" (awaiting approval since {clock(record.pending_since)})"
    return ""


CLAIM = "the node's claim"
"""What a value only the node says (its signed heartbeats and results) is labelled."""


def identity_lines(entry: TrustEntry | None, record: NodeRecord) -> list[str]:
    """The node's enrolled identity (its trust entry: what the fleet acts on), and its
    claims where they name another machine."""
    enrolled = entry.identity if entry is not None else None
    if enrolled is None:
        return [
            "Identity:        none enrolled (hooks get none; fleetctl approve --identity "
            f"{record.node_id} records what it claims)"
        ]
    when = f" at {clock(entry.identity_at)}" if entry is not None and entry.identity_at else ""
    by = entry.identity_by if entry is not None else ""
    lines = [f"Identity:        enrolled {summary(enrolled)} (by {by or '-'}{when})"]
    found = differences(enrolled, claimed(record))
    if found:
        lines.append(
            f"  DIFFERS:       the node claims {'; '.join(found)}: no hook runs until "
            f"confirmed (fleetctl approve --identity {record.node_id})"
        )
    return lines


NODE_ACTIONS = ("spot:", "shutdown")
"""Command ids a node gives what it does by itself (a spot notice, its own shutdown)."""


def _schedulability(
    record: NodeRecord, results: list[Entry], policy_keys: Collection[str] = ()
) -> str:
    """The schedulability, its reason, who made it so (the heartbeat's
    ``schedulability_by``, labelled the node's claim) and what set it (the node's results,
    labelled so too), then the remediation policy's hold where its own record has one:
    the one "who" the fleet knows itself. Completed results report the schedulability
    the node had when they ended; the one credited is the first of the latest run of such
    results that all report this schedulability (later ones, a stop on a cordoned node
    say, found it so), and only where it changed it: after one reporting another state,
    or, first of all, to other than schedulable (a workload's commands on a node
    schedulable all along set nothing). A schedulability the node changed by itself
    without a result (the last completed result reports another) is credited to nobody,
    and what the node did on its own (spot notices, its shutdown) to the node. Unknown
    (``-``) while no heartbeat says what it is now, with what it last said."""
    beat = record.heartbeat
    text = record.schedulability
    if beat is not None and beat.schedulability_reason:
        text += f" (reason: {beat.schedulability_reason})"
    hold = record.policy_hold if isinstance(record, LiveRecord) else ""
    if beat is not None and beat.schedulability_by:
        by = beat.schedulability_by
        unheld = by in policy_keys and not hold
        text += f", by {by} ({CLAIM}{': the policy holds no record of it' if unheld else ''})"
    text += _credited(record, results)
    if record.state in UNKNOWN_NOW:
        text = f"- (unknown while {record.state}; last reported {text})"
    if hold:
        text += f"; held by the remediation policy ({hold}: its own record)"
    return text


def _credited(record: NodeRecord, results: list[Entry]) -> str:
    """``, set by ...`` from the completed results (see :func:`_schedulability`)."""
    done = [
        entry.message
        for entry in results
        if isinstance(entry.message, CommandResult)
        and entry.message.status == "done"
        and entry.message.schedulability is not None
    ]
    if not done or done[-1].schedulability != record.schedulability:
        return ""
    run = len(done) - 1
    while run > 0 and done[run - 1].schedulability == done[-1].schedulability:
        run -= 1
    setter = done[run]
    if run == 0 and setter.schedulability == "schedulable":
        return ""  # no change seen: a workload's stop on a node schedulable all along
    return f", set by {_setter(setter.command_id)} at {clock(setter.ts)} (the node's result)"


def _setter(command_id: str) -> str:
    if command_id.startswith(NODE_ACTIONS):
        return f"the node itself ({command_id})"
    return f"command {command_id}"


def _health(health: Health | None, state: str) -> list[str]:
    if health is None:
        return ["Health:          not reported"]
    lines = [f"Health:          {health.status}, score {health.score}/100"]
    if state in UNKNOWN_NOW:
        lines = [
            f"Health:          - (unknown while {state}; last reported {health.status}, "
            f"score {health.score}/100)"
        ]
    if health.checks:
        lines.append("Checks:")
        lines += grid(
            [("CHECK", "STATUS", "REASON", "ACTION")]
            + [(c.name, c.status, c.reason, c.action or "-") for c in health.checks]
        )
    if health.components:
        lines.append("Components:")
        lines += grid(
            [("COMPONENT", "POINTS", "REASON")]
            + [(c.name, f"{c.points}/{c.max_points}", c.reason) for c in health.components]
        )
    return lines


def _gpus(sample: Sample | None) -> list[str]:
    if sample is None:
        return ["GPUs:            none"]
    return _managed_gpus(sample) + _passthrough(sample)


def _passthrough(sample: Sample) -> list[str]:
    """The GPUs bound to vfio-pci: one line, each by address and product (or device id)."""
    if not sample.passthrough_gpus:
        return []
    gpus = ", ".join(
        f"{gpu.pci_bus_id} {gpu.name or gpu.device_id}"
        + (f" (iommu group {gpu.iommu_group})" if gpu.iommu_group else "")
        for gpu in sample.passthrough_gpus
    )
    count = len(sample.passthrough_gpus)
    return [f"Passthrough:     {count} GPUs bound to vfio-pci, not this node's to use: {gpus}"]


def _managed_gpus(sample: Sample) -> list[str]:
    if sample.gpu_error and not sample.gpus:
        return [f"GPUs:            none ({sample.gpu_source} fails: {sample.gpu_error})"]
    if not sample.gpus:
        return ["GPUs:            none"]
    rows: list[tuple[str, ...]] = [
        ("GPU", "NAME", "MEMORY", "TEMP", "POWER", "UTIL", "ECC (CORR/UNCORR)", "XIDS", "LOST")
    ]
    for gpu in sample.gpus:
        xids = ",".join(f"{x.code}x{x.count}" for x in gpu.xids) or "-"
        rows.append(
            (
                str(gpu.index),
                gpu.name,
                f"{gpu.memory_used / 2**30:.1f}/{gpu.memory_total / 2**30:.1f} GiB"
                + (
                    f" +{gpu.health.memory_reserved / 2**30:.1f} rsvd"
                    if gpu.health is not None and gpu.health.memory_reserved
                    else ""
                ),
                _opt(gpu.temperature_c, "C", "{:.0f}"),
                _opt(gpu.power_w, "W", "{:.0f}"),
                _opt(gpu.utilization_pct, "%", "{:.0f}"),
                f"{_opt(gpu.ecc_corrected)}/{_opt(gpu.ecc_uncorrected)}",
                xids,
                "LOST" if gpu.lost else "-",
            )
        )
    return [f"GPUs:            {len(sample.gpus)} ({sample.gpu_source})", *grid(rows)]


def _host(host: HostFacts | None, agent_up: float | None = None) -> list[str]:
    """The host's uptime and the agent's (as of the heartbeat; older agents send none),
    host facts in one line, dependency versions in another (older agents send none)."""
    if host is None:
        return []
    gpu = _opt(host.gpu_utilization_pct, "%", "{:.0f}")
    lines = [f"Host uptime:     {span(host.uptime_s)}"]
    if agent_up is not None:
        lines.append(f"Agent uptime:    {span(agent_up)}")
    lines.append(
        f"Host:            memory {host.memory_used_pct:.0f}% used, "
        f"GPU util {gpu} (mean), {host.storage_path or '-'} {host.storage_used_pct:.0f}% used, "
        f"CPU {host.cpu_model or '-'}"
    )
    if host.dependencies:
        versions = "; ".join(dep.version for dep in host.dependencies)
        lines.append(f"Versions:        {versions}")
    return lines


def _engines(engine: Engine | None) -> list[str]:
    if engine is None or not engine.engines:
        return ["Engines:         none"]
    rows: list[tuple[str, ...]] = [("ENGINE", "URL", "HEALTHY", "IN-FLIGHT", "WAITING", "REASON")]
    rows += [
        (
            e.kind,
            e.url,
            "yes" if e.healthy else "no",
            _opt(e.in_flight),
            _opt(e.waiting),
            e.reason or "-",
        )
        for e in engine.engines
    ]
    return ["Engines:", *grid(rows)]


def _slurm(scheduler: Scheduler) -> list[str]:
    """The node as ``scontrol show node`` and ``squeue`` see it, and its HPC services."""
    if not scheduler.reachable:
        return [f"Slurm:           {scheduler.node_name}: not answering ({scheduler.reason})"]
    reason = f" (reason: {scheduler.state_reason})" if scheduler.state_reason else ""
    jobs, services = scheduler.jobs, scheduler.services
    history = f"{_opt(jobs.completed_24h)} completed, {_opt(jobs.failed_24h)} failed in 24 h" + (
        f" ({jobs.history_reason})" if jobs.history_reason else ""
    )
    runtime = services.container_runtime or "no container runtime"
    if services.container_runtime_version:
        runtime += f" {services.container_runtime_version}"
    return [
        f"Slurm:           {scheduler.node_name} {scheduler.slurm_state}{reason}",
        f"  jobs:          {_opt(jobs.running_count)} running, {_opt(jobs.pending_count)} "
        f"pending; {history}",
        f"  services:      slurmd {'running' if services.slurmd_running else 'NOT running'}"
        f" {services.slurmd_version}, munged "
        f"{'running' if services.munge_running else 'NOT running'}, {runtime}",
    ]


def _latency(latency: Latency | None) -> list[str]:
    if latency is None:
        return ["Latency:         not reported"]
    lines = [
        f"Latency:         nats {_ms(latency.gateway_rtt_us)}, "
        f"peers avg {_ms(latency.avg_peer_rtt_us)}, loss {latency.loss_pct:g}%"
    ]
    if latency.peers:
        lines += grid(
            [("PEER", "RTT", "LOSS")]
            + [(p.target_node_id, _ms(p.rtt_us), f"{p.loss_pct:g}%") for p in latency.peers]
        )
    return lines


def _ms(microseconds: float | None) -> str:
    """A round trip in milliseconds, as ``node-agent status`` writes it."""
    return "-" if microseconds is None else f"{microseconds / 1000:.2f}ms"


def _spot(spot: SpotStatus | None) -> str:
    if spot is None or spot.provider == "none":
        return "not watched"
    notice = spot.notice
    if notice is None:
        return f"{spot.provider}, no notice"
    deadline = f", deadline {clock(notice.deadline)}" if notice.deadline else ""
    return f"{spot.provider}: {notice.kind} notice{deadline} {notice.detail}".rstrip()


def _recent(alerts: list[Entry], results: list[Entry]) -> list[str]:
    lines = [f"Recent alerts ({len(alerts)}):"]
    lines += [f"  {event_line(entry)}" for entry in alerts] or ["  none"]
    lines.append(f"Recent command results ({len(results)}):")
    lines += [f"  {event_line(entry)}" for entry in results] or ["  none"]
    return lines
