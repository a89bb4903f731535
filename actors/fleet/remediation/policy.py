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
- A command the node never took (its signed rejection, or no cordon and no answer
  within ``grace`` of it reporting) leaves a *refused* hold: needs attention, one alert,
  not counted by the breaker, nothing sent again until an operator clears it.
- The breaker: the policy holds at most ``min(breaker_max, breaker_percent % of the
  cluster's reporting nodes)`` at once (refused holds not counted). Needing more trips
  it: no command and no hook, one alert listing what it would have done, until
  ``fleetctl policy reset``; what it learns meanwhile (a cordon shown, a refusal, a node
  someone else took over) is still recorded, once.
- ``hung`` (opt-in, in ``classes``): a node silent for ``hung_after`` that did not say
  goodbye is cordoned (the command waits in its queue), its ``hung`` hooks run while it
  stays silent (a BMC power cycle), and it is returned only after it beats with a new
  boot id, or needs attention after ``reboot_confirm``.
- Maintenance: with ``maintenance = "skip"`` (the default) a node a window covers is
  neither cordoned nor uncordoned, and gets no hook, while the window is in force; it is
  listed as skipped. A hung node in maintenance is never a case.
- A dry run records what it would do per node and notes each once per change
  (:func:`dry_run`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

import msgspec

from actors.fleet import identity
from actors.fleet.remediation.config import PolicyConfig
from actors.fleet.remediation.findings import REPORTING, Finding, classify, hung
from actors.fleet.remediation.hooks import clean
from schemas.base import MAX_TEXT
from schemas.messages import AlertKind, NodeIdentity, NodeRecord
from schemas.remediation import MAX_HELD, MAX_HISTORY, MAX_WOULD, Hold, PolicyRecord

DRY_SEPARATOR = " | "
"""Between the would-be actions of one node in a dry run's record."""
CLUSTER = "_cluster"
"""The node name of what concerns a whole cluster (the breaker)."""


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


def claim_alive(config: PolicyConfig, hold: Hold, now: float) -> bool:
    """A hook is claimed and within its own bound (an older claim's aggregator died)."""
    started = hold.hook_started or now
    return bool(hold.hook_running) and now - started <= config.hook_timeout + config.interval


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
    ``enrolled`` (:func:`identity_gate`). A ``hung`` hold's hooks ran while the node was
    silent (:func:`hung_step`): none run once it is back."""
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
        if claim_alive(config, hold, now):
            return hold, None
        hold = msgspec.structs.replace(hold, hook_running="", hook_started=None)
    names = [] if hold.reason_class == "hung" else config.hook_after.get(hold.reason_class, [])
    for name in names:
        if name not in hold.hooks_done:
            return identity_gate(hold, record, enrolled, name, plan)
    return hold, None


def hung_step(
    config: PolicyConfig,
    hold: Hold,
    record: NodeRecord,
    now: float,
    plan: Plan,
    enrolled: NodeIdentity | None = None,
) -> tuple[Hold, str | None]:
    """A ``hung`` hold until its node beats with another boot id than the one it hung in
    (``reboot_from``): then ``back_at`` is set and the hold goes on as any other (its
    queued cordon shown, healthy for ``recover_after``, uncordoned). Until then its
    ``hung`` hooks run in order while the node stays silent (none for a node that beats
    again with its old boot id: it was not rebooted, and it needs attention once
    ``reboot_confirm`` has passed since the hold or the reboot hook)."""
    node = record.node_id
    if record.state in REPORTING and record.boot_id and record.boot_id != hold.reboot_from:
        done = [*hold.hooks_done, hold.rebooting] if hold.rebooting else hold.hooks_done
        message = f"hung: back with a new boot id ({hold.reboot_from or '?'} -> {record.boot_id})"
        plan.notes.append(("remediation", node, message))
        back = msgspec.structs.replace(
            hold, back_at=now, rebooting="", reboot_from="", hooks_done=done
        )
        return back, None
    if hold.needs_attention or claim_alive(config, hold, now):
        return hold, None
    if hold.hook_running:
        hold = msgspec.structs.replace(hold, hook_running="", hook_started=None)
    if not hold.rebooting and record.state not in REPORTING:
        for name in config.hook_after.get("hung", []):
            if name not in hold.hooks_done:
                return identity_gate(hold, record, enrolled, name, plan)
    if now - (hold.hook_started or hold.since) > config.reboot_confirm:
        message = (
            f"hung: no new boot id within {config.reboot_confirm:g}s (still boot "
            f"{hold.reboot_from or '?'}); stays cordoned until an operator clears it"
        )
        plan.notes.append(("needs_attention", node, message))
        return msgspec.structs.replace(hold, needs_attention=True, hook_error=message), None
    return hold, None


def pending_step(
    config: PolicyConfig, hold: Hold, record: NodeRecord, key: str, now: float, plan: Plan,
    refusal: str,
) -> Hold | None:  # fmt: skip
    """Whether the node took the policy's command. The hold is ``applied`` once the
    node's heartbeat shows the policy's cordon; ``refused`` (needs attention, noted once)
    on the node's signed ``refusal``, or once it reported for ``grace`` without showing
    the cordon or answering; None: let go (noted once), because someone else set the
    node's state (an operator, a spot notice, Slurm) or it lost the policy's cordon."""
    node = record.node_id
    beat = record.heartbeat
    owner = beat.schedulability_by if beat is not None else ""
    schedulability = beat.schedulability if beat is not None else "schedulable"
    if owner == key and schedulability != "schedulable":
        if hold.refused:
            plan.notes.append(("remediation", node, f"{hold.action} took effect after all"))
            return msgspec.structs.replace(hold, applied=True, refused="", needs_attention=False)
        return hold if hold.applied else msgspec.structs.replace(hold, applied=True)
    if hold.refused:
        return hold
    if hold.applied or schedulability != "schedulable":
        plan.notes.append(("remediation", node, f"released: set by {owner or 'nobody'}"))
        return None
    if refusal:
        why = refusal
    elif now - (hold.back_at or hold.since) > config.grace:
        why = f"no {hold.action} shown and no answer within {config.grace:g}s"
    else:
        return hold
    message = (
        f"{hold.action} not taken: {why}; nothing more is sent to it and the breaker does not "
        f"count it until an operator clears it (fleetctl policy clear {node} "
        f"--cluster {record.cluster})"
    )
    plan.notes.append(("needs_attention", node, clean(message)[:MAX_TEXT]))
    return msgspec.structs.replace(hold, refused=clean(why)[:MAX_TEXT], needs_attention=True)


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
    """Nodes the policy may hold at once in a cluster of ``nodes`` reporting nodes."""
    return min(config.breaker_max, math.floor(nodes * config.breaker_percent / 100))


def decide(
    config: PolicyConfig,
    key: str,
    current: PolicyRecord,
    records: list[NodeRecord],
    now: float,
    new_id: str,
    enrolled: Mapping[str, NodeIdentity | None] | None = None,
    *,
    refusals: Mapping[str, str] | None = None,
    maintenance: Mapping[str, str] | None = None,
    base: int | None = None,
) -> Plan:
    """The next record and orders for one cluster; ``key`` is the policy's public key,
    ``new_id`` a fresh prefix for command ids, ``enrolled`` the enrolled identity of the
    held nodes (from their trust entries; a node missing has none), ``refusals`` why a
    held node refused the policy's command (its signed answer), ``maintenance`` the
    window covering each node in maintenance, ``base`` the cluster's reporting nodes
    when ``records`` are only those the policy may act on (else counted in them)."""
    enrolled = enrolled or {}
    refusals = refusals or {}
    covered = maintenance or {}
    skip = covered if config.maintenance == "skip" else {}
    by_node = {record.node_id: record for record in records if not record.deregistered}
    holds = dict(current.holds)
    history = {
        node: [at for at in times if at > now - config.window]
        for node, times in current.history.items()
    }
    history = {node: times[-MAX_HISTORY:] for node, times in history.items() if times}
    plan = Plan(record=current)
    skipped: dict[str, str] = {}
    releases: list[Order] = []
    for node, hold in sorted(holds.items()):
        record = by_node.get(node)
        if record is None:
            del holds[node]
            continue
        if node in skip:
            skipped[node] = f"held; in maintenance window {skip[node]}: left as it is"
            continue
        if hold.reason_class == "hung" and hold.back_at is None:
            hold, hook = hung_step(config, hold, record, now, plan, enrolled.get(node))
            holds[node] = hold
            if hook is not None:
                plan.hooks.append(HookOrder(node, hook))
            continue
        if record.state not in REPORTING:
            continue
        updated = pending_step(config, hold, record, key, now, plan, refusals.get(node, ""))
        if updated is None:
            del holds[node]
            continue
        hold = holds[node] = updated
        if hold.needs_attention or not hold.applied:
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
    findings: dict[str, Finding] = {}
    for node, record in sorted(by_node.items()):
        if node in holds:
            continue
        finding = hung(record, config, now) if node not in covered else None
        beat = record.heartbeat
        if finding is None and record.state in REPORTING and beat is not None:
            if beat.schedulability == "schedulable":
                finding = classify(record, config.classes)
        if finding is None:
            continue
        action: Literal["cordon", "drain"] = "drain" if config.drain else "cordon"
        if node in skip:
            skipped[node] = (
                f"would {action} ({finding.reason_class}): in maintenance window {skip[node]}"
            )
            continue
        findings[node] = finding
        wanted.append(Order(node, action, f"policy: {finding.reason_class}: {finding.detail}", ""))
    if base is None:
        base = sum(1 for record in by_node.values() if record.state in REPORTING)
    limit = breaker_limit(config, base)
    counted = sum(1 for hold in holds.values() if not hold.refused)
    kept = {node: text[:MAX_TEXT] for node, text in sorted(skipped.items())[:MAX_HELD]}
    if current.tripped_at is not None or counted + len(wanted) > limit:
        would = [f"{order.action} {order.node} ({order.reason})" for order in wanted]
        would += [f"uncordon {order.node}" for order in releases]
        if current.tripped_at is None:
            plan.tripped = True
            plan.notes.append(
                (
                    "breaker_tripped",
                    CLUSTER,
                    f"breaker tripped: {counted} held + {len(wanted)} more > limit {limit} "
                    f"(of {base} reporting nodes); no action until fleetctl policy reset",
                )
            )
        plan.hooks = []  # tripped: no command and no hook; what was learnt is kept
        unreleased = {order.node: current.holds[order.node] for order in releases}
        plan.record = msgspec.structs.replace(
            current,
            holds={**holds, **unreleased},
            history=history,
            tripped_at=current.tripped_at or now,
            would=(would or list(current.would))[:MAX_WOULD],
            limit=limit,
            base=base,
            dry={},
            skipped=kept,
            updated_by=key,
        )
        return plan
    for index, order in enumerate(wanted):
        order.command_id = f"{new_id}-{index}"
        finding = findings[order.node]
        holds[order.node] = Hold(
            reason_class=finding.reason_class,
            reason=finding.detail,
            action="drain" if order.action == "drain" else "cordon",
            command_id=order.command_id,
            since=now,
            check=finding.check,
            gpus=list(finding.gpus),
            reboot_from=by_node[order.node].boot_id if finding.reason_class == "hung" else "",
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
        base=base,
        dry={},
        skipped=kept,
        updated_by=key,
    )
    return plan


def gist(text: str) -> tuple[str, ...]:
    """What a dry run's would-be text decides, without the node's changing detail (an XID
    count, a temperature): the first three fields of each part (``cordon: policy: xid``)."""
    return tuple(":".join(part.split(":")[:3]) for part in text.split(DRY_SEPARATOR) if part)


def dry_run(current: PolicyRecord, plan: Plan) -> Plan:
    """What a dry-run policy keeps of ``plan`` (decided from ``current``): its would-be
    actions per node (``PolicyRecord.dry``), each noted only when it is new or changed
    (:func:`gist`), not every round; no command, no hook, no hold."""
    would: dict[str, list[str]] = {}
    for _, node, message in plan.notes:
        would.setdefault(node, []).append(message)
    for order in plan.hooks:
        would.setdefault(order.node, []).append(f"run hook {order.hook}")
    dry = {
        node: DRY_SEPARATOR.join(texts)[:MAX_TEXT]
        for node, texts in sorted(would.items())[:MAX_HELD]
    }
    notes: list[tuple[AlertKind, str, str]] = [
        ("remediation", node, text)
        for node, text in dry.items()
        if gist(text) != gist(current.dry.get(node, ""))
    ]
    record = msgspec.structs.replace(
        current,
        dry=dry,
        limit=plan.record.limit,
        base=plan.record.base,
        skipped=plan.record.skipped,
        updated_by=plan.record.updated_by,
    )
    return Plan(record=record, notes=notes)
