"""The remediation policy's decisions, as a pure function of the nodes' current records.

:func:`decide` takes one cluster's node records and its shared :class:`PolicyRecord` and
returns the next record and the commands to send. It never looks at past events, only at
what each record says now, so a breaker reset or an aggregator restart replays nothing.

- A schedulable, reporting node unhealthy for a configured reason class is cordoned (or
  drained) and held by the policy.
- A held node healthy for ``recover_after`` seconds is uncordoned, unless it was
  remediated ``max_remediations`` times within ``window``: then it stays cordoned with
  ``needs_attention`` until an operator clears it.
- The policy only undoes what it did: a held node whose heartbeat says someone else set
  its schedulability (an operator's key, a spot notice, a Slurm admin) is dropped from
  the holds untouched, and nodes it does not hold are never uncordoned.
- Whether the policy cordoned a node is its own record (its holds in ``fleet_policy``):
  a heartbeat naming the policy's key (``schedulability_by``) is the node's claim, read
  only to see that a cordon the policy holds took effect, or that someone else took the
  node over (then the hold is let go); it never makes the policy take a node as its own.
- A held node whose claims name another machine than its enrolled identity (another
  host, a GPU not enrolled: :mod:`actors.fleet.identity`) gets no hook: one
  ``hardware_changed`` alert per claim, and the node stays held until an operator
  confirms the identity (``fleetctl approve --identity``) or clears the hold.
- The breaker: the policy holds at most ``min(breaker_max, breaker_percent % of the
  cluster's nodes)`` at once. Needing more trips it: no action at all, one alert listing
  what it would have done, until ``fleetctl policy reset``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import msgspec

from actors.fleet import identity
from actors.fleet.remediation.hooks import clean
from actors.runtime.config import ConfigError, Positive, build
from schemas.messages import AlertKind, NodeIdentity, NodeRecord
from schemas.remediation import MAX_HISTORY, MAX_WOULD, Hold, PolicyRecord, ReasonClass

GPU_CHECKS = frozenset(
    {"boot", "nvml", "gpu_memory", "gpu_clocks", "gpu_pcie", "gpu_nvlink", "gpu_fabric"}
)
CLASS_ORDER: tuple[ReasonClass, ...] = ("gpu", "xid", "engine", "dependency", "slurm")
REPORTING = frozenset({"active", "degraded", "unhealthy", "cordoned", "draining", "drained"})
"""Record states of a node whose heartbeats arrive (not stale, offline or gone)."""


class PolicyConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The policy file (TOML); every setting is documented in docs/remediation.md."""

    key_file: str
    """Operator seed the policy signs its commands with; nodes must trust its public key."""
    dry_run: bool = True
    clusters: list[str] = []
    """Clusters the policy acts on; empty: every cluster."""
    classes: list[ReasonClass] = msgspec.field(default_factory=lambda: ["gpu", "xid"])
    drain: bool = False
    """Drain (cordon, then wait for work) instead of only cordoning."""
    drain_deadline: Positive = 600.0
    recover_after: Positive = 300.0
    max_remediations: int = 3
    window: Positive = 86400.0
    breaker_percent: float = 10.0
    breaker_max: int = 20
    interval: Positive = 15.0
    grace: Positive = 60.0
    """How long a new hold waits for the node's heartbeat to show the policy's cordon."""
    hooks: dict[str, list[str]] = {}
    """Last-mile hooks by name (GPU reset, reboot, ticket): the command run on the
    aggregator, as a list (no shell), the node's facts in FLEET_* variables."""
    hook_after: dict[ReasonClass, list[str]] = {}
    """Hooks run in order on a node the policy took out for that reason class, once its
    cordon (or drain) took effect; the node is returned only after all succeeded."""
    reboot_hooks: list[str] = []
    """Hooks that reboot the node: done only once it beats with a new boot id."""
    hook_timeout: Positive = 300.0
    """Seconds a hook may run; then its process group is killed and the node needs
    attention."""
    reboot_confirm: Positive = 900.0
    """Seconds a reboot hook's node has to come back with a new boot id."""

    def __post_init__(self) -> None:
        if not 0 <= self.breaker_percent <= 100:
            raise ValueError("breaker_percent must be within 0 to 100")
        if self.breaker_max < 0 or self.max_remediations < 1:
            raise ValueError("breaker_max must be >= 0 and max_remediations >= 1")
        named = {name for names in self.hook_after.values() for name in names}
        unknown = sorted((named | set(self.reboot_hooks)) - set(self.hooks))
        if unknown:
            raise ValueError(f"hooks {', '.join(unknown)} are named but not in [hooks]")
        if any(not argv for argv in self.hooks.values()):
            raise ValueError("a hook's command is a non-empty list")


@dataclass
class Order:
    """One command the policy sends (after its record is written)."""

    node: str
    action: Literal["cordon", "drain", "uncordon"]
    reason: str
    command_id: str


@dataclass
class HookOrder:
    """A last-mile hook to run on one held node (after the aggregator claimed it)."""

    node: str
    hook: str


@dataclass
class Plan:
    record: PolicyRecord
    orders: list[Order] = field(default_factory=list)
    hooks: list[HookOrder] = field(default_factory=list)
    notes: list[tuple[AlertKind, str, str]] = field(default_factory=list)
    """(alert kind, node, message) for what was done, or would be in a dry run."""
    tripped: bool = False
    """The breaker tripped at this decision (its alert goes out once)."""


def load_policy(path: Path) -> PolicyConfig:
    """The policy file, checked (durations as in every setting: 300, 5m); ConfigError
    naming the file and what is wrong."""
    try:
        return build(PolicyConfig, "", file=path, env={})
    except ConfigError as exc:
        reason = str(exc).removeprefix("config: ")
        raise ConfigError(f"policy file {path}: {reason}") from None


def classify(record: NodeRecord, classes: list[ReasonClass]) -> tuple[ReasonClass, str] | None:
    """The first configured reason class the node's last heartbeat is unhealthy for."""
    heartbeat = record.heartbeat
    if heartbeat is None:
        return None
    found: dict[ReasonClass, str] = {}
    health = heartbeat.health
    if health is not None:
        for check in health.checks:
            if check.status != "unhealthy":
                continue
            if check.name in GPU_CHECKS:
                found.setdefault("gpu", f"{check.name}: {check.reason}")
            elif check.name == "xid":
                found.setdefault("xid", f"xid: {check.reason}")
            elif check.name == "dependencies":
                found.setdefault("dependency", f"dependencies: {check.reason}")
        engines = [part for part in health.components if part.name == "engine"]
        if engines and engines[0].points == 0:
            found.setdefault("engine", f"engine: {engines[0].reason}")
    scheduler = heartbeat.scheduler
    if scheduler is not None and "down" in scheduler.slurm_state:
        found.setdefault("slurm", f"slurm: node {scheduler.slurm_state}")
    for name in CLASS_ORDER:
        if name in classes and name in found:
            return name, found[name][:512]
    return None


def hook_step(
    config: PolicyConfig,
    hold: Hold,
    record: NodeRecord,
    key: str,
    now: float,
    plan: Plan,
    enrolled: NodeIdentity | None = None,
) -> tuple[Hold, str | None]:
    """Where the hold's last-mile hooks are: the hold as it now stands, and the next hook
    to run (None: none now). Hooks wait for the policy's own cordon to show in the node's
    heartbeat; a reboot is confirmed by a new boot id, or times out into needs_attention;
    the next hook is withheld while the node's claims name another machine than
    ``enrolled`` (:func:`identity_gate`)."""
    beat = record.heartbeat
    if beat is None or beat.schedulability_by != key or beat.schedulability == "schedulable":
        return hold, None
    if hold.rebooting:
        if record.boot_id and record.boot_id != hold.reboot_from:
            message = f"{hold.rebooting}: rebooted (boot {hold.reboot_from} -> {record.boot_id})"
            plan.notes.append(("remediation", record.node_id, message))
            done = [*hold.hooks_done, hold.rebooting]
            hold = msgspec.structs.replace(hold, hooks_done=done, rebooting="", reboot_from="")
            return hold, None
        if now - (hold.hook_started or now) > config.reboot_confirm:
            message = (
                f"{hold.rebooting}: no new boot id within {config.reboot_confirm:g}s: the "
                "reboot is not confirmed; stays cordoned until an operator clears it"
            )
            plan.notes.append(("needs_attention", record.node_id, message))
            return msgspec.structs.replace(hold, needs_attention=True, hook_error=message), None
        return hold, None
    if hold.hook_running:
        # A claim older than the hook's own bound belongs to an aggregator that died.
        if now - (hold.hook_started or now) <= config.hook_timeout + config.interval:
            return hold, None
        hold = msgspec.structs.replace(hold, hook_running="", hook_started=None)
    for name in config.hook_after.get(hold.reason_class, []):
        if name not in hold.hooks_done:
            return identity_gate(hold, record, enrolled, name, plan)
    return hold, None


def identity_gate(
    hold: Hold, record: NodeRecord, enrolled: NodeIdentity | None, hook: str, plan: Plan
) -> tuple[Hold, str | None]:
    """``hook`` if the node's claims name the machine it was enrolled as (or nothing is
    enrolled); else the hook withheld, the claim noted in the hold (``identity_withheld``)
    and, the first time for this claim, a ``hardware_changed`` note."""
    claims = identity.claimed(record)
    found = identity.differences(enrolled, claims)
    if not found:
        if hold.identity_withheld:
            hold = msgspec.structs.replace(hold, identity_withheld="")
        return hold, hook
    withheld = identity.digest(claims)
    if hold.identity_withheld != withheld:
        message = (
            f"hook {hook} withheld: the node claims {'; '.join(found)}; hooks act on the "
            f"enrolled identity only once an operator confirms (fleetctl approve --identity "
            f"{record.node_id}) or clears the hold"
        )
        plan.notes.append(("hardware_changed", record.node_id, clean(message)[:1000]))
        hold = msgspec.structs.replace(hold, identity_withheld=withheld)
    return hold, None


def breaker_limit(config: PolicyConfig, nodes: int) -> int:
    """Nodes the policy may hold at once in a cluster of ``nodes``."""
    return min(config.breaker_max, math.floor(nodes * config.breaker_percent / 100))


def decide(
    config: PolicyConfig,
    key: str,
    current: PolicyRecord,
    records: list[NodeRecord],
    now: float,
    new_id: str,
    enrolled: Mapping[str, NodeIdentity | None] | None = None,
) -> Plan:
    """The next record and orders for one cluster; ``key`` is the policy's public key,
    ``new_id`` a fresh prefix for command ids, ``enrolled`` the enrolled identity of the
    held nodes (from their trust entries; a node missing has none)."""
    enrolled = enrolled or {}
    by_node = {record.node_id: record for record in records if not record.deregistered}
    holds = dict(current.holds)
    history = {
        node: [at for at in times if at > now - config.window]
        for node, times in current.history.items()
    }
    history = {node: times[-MAX_HISTORY:] for node, times in history.items() if times}
    plan = Plan(record=current)
    releases: list[Order] = []
    for node, hold in sorted(holds.items()):
        record = by_node.get(node)
        if record is None:
            del holds[node]
            continue
        owner = record.heartbeat.schedulability_by if record.heartbeat else ""
        schedulability = record.heartbeat.schedulability if record.heartbeat else "schedulable"
        if owner != key and (schedulability != "schedulable" or now - hold.since > config.grace):
            # Someone else set the node's state (or it never took ours): not ours to undo.
            del holds[node]
            plan.notes.append(("remediation", node, f"released: set by {owner or 'nobody'}"))
            continue
        if hold.needs_attention or record.state not in REPORTING:
            continue
        hold, hook = hook_step(config, hold, record, key, now, plan, enrolled.get(node))
        holds[node] = hold
        busy = hold.hook_running or hold.rebooting or hold.needs_attention
        if hook is not None or busy or hold.identity_withheld:
            if hook is not None:
                plan.hooks.append(HookOrder(node, hook))
            continue
        if classify(record, config.classes) is not None:
            holds[node] = msgspec.structs.replace(hold, healthy_since=None)
            continue
        healthy_since = hold.healthy_since or now
        holds[node] = msgspec.structs.replace(hold, healthy_since=healthy_since)
        if now - healthy_since < config.recover_after:
            continue
        if len(history.get(node, [])) >= config.max_remediations:
            holds[node] = msgspec.structs.replace(holds[node], needs_attention=True)
            message = (
                f"remediated {len(history[node])} times in {config.window:g}s: stays "
                "cordoned until an operator clears it (fleetctl policy clear)"
            )
            plan.notes.append(("needs_attention", node, message))
            continue
        del holds[node]
        releases.append(Order(node, "uncordon", f"policy: recovered ({hold.reason_class})", ""))
    wanted: list[Order] = []
    classes: dict[str, tuple[ReasonClass, str]] = {}
    for node, record in sorted(by_node.items()):
        if node in holds or record.state not in REPORTING or record.heartbeat is None:
            continue
        if record.heartbeat.schedulability != "schedulable":
            continue
        found = classify(record, config.classes)
        if found is None:
            continue
        classes[node] = found
        action: Literal["cordon", "drain"] = "drain" if config.drain else "cordon"
        wanted.append(Order(node, action, f"policy: {found[0]}: {found[1]}", ""))
    limit = breaker_limit(config, len(by_node))
    if current.tripped_at is not None or len(holds) + len(wanted) > limit:
        would = [f"{order.action} {order.node} ({order.reason})" for order in wanted]
        would += [f"uncordon {order.node}" for order in releases]
        if current.tripped_at is None:
            plan.tripped = True
            plan.notes.append(
                (
                    "breaker_tripped",
                    "_cluster",
                    f"breaker tripped: {len(holds)} held + {len(wanted)} more > limit {limit}; "
                    "no action until fleetctl policy reset",
                )
            )
        plan.hooks = []  # tripped: no action at all, hooks included
        plan.record = msgspec.structs.replace(
            current,
            holds=dict(current.holds),
            tripped_at=current.tripped_at or now,
            would=(would or list(current.would))[:MAX_WOULD],
            limit=limit,
            updated_by=key,
        )
        return plan
    for index, order in enumerate(wanted):
        order.command_id = f"{new_id}-{index}"
        reason_class, reason = classes[order.node]
        holds[order.node] = Hold(
            reason_class=reason_class,
            reason=reason,
            action="drain" if order.action == "drain" else "cordon",
            command_id=order.command_id,
            since=now,
        )
        history.setdefault(order.node, []).append(now)
        plan.notes.append(("remediation", order.node, f"{order.action}: {order.reason}"))
    for index, order in enumerate(releases):
        order.command_id = f"{new_id}-u{index}"
        plan.notes.append(("remediation", order.node, f"uncordon: {order.reason}"))
    plan.orders = wanted + releases
    plan.record = msgspec.structs.replace(
        current,
        holds=holds,
        history={node: times[-MAX_HISTORY:] for node, times in history.items()},
        limit=limit,
        updated_by=key,
    )
    return plan
