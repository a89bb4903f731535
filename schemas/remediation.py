"""The remediation policy's shared record: KV bucket ``fleet_policy``, key ``<cluster>``.

One record per cluster holds everything the policy decides with, so that one
compare-and-set on its revision claims breaker slots, holds and history together: two
aggregators running the policy can never both take the last slot.
"""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta

from schemas.base import MAX_GPUS, Count, Name, NodeId, Text, UnixTime, Wire

MAX_HELD = 4096
"""Nodes one cluster's policy record can hold at once (the breaker caps it far lower)."""
MAX_HISTORY = 64
"""Remediations remembered per node (within the policy's window)."""
MAX_WOULD = 32
"""Would-be actions a tripped breaker lists."""
MAX_HOOKS = 16
"""Last-mile hooks one hold runs at most."""

ReasonClass = Literal["gpu", "xid", "engine", "dependency", "slurm", "hung"]
"""Why a node is unhealthy, as the policy's configuration names it: ``gpu`` (the boot,
nvml and gpu_* checks), ``xid``, ``engine`` (the score's engine component at 0),
``dependency`` (the dependencies check), ``slurm`` (Slurm reports the node down),
``hung`` (no heartbeat for ``hung_after``: the host, not a check, is what failed)."""


class Hold(Wire, frozen=True, kw_only=True):
    """A node the policy took out: why, when, with which command, and since when it has
    been healthy again (None while it is not)."""

    reason_class: ReasonClass
    reason: Text
    action: Literal["cordon", "drain"]
    command_id: Name
    since: UnixTime
    healthy_since: UnixTime | None = None
    needs_attention: bool = False
    """Remediated ``max_remediations`` times within the window: it stays cordoned, and the
    policy leaves it to an operator (``fleetctl policy clear NODE``)."""
    hooks_done: Annotated[list[Name], Meta(max_length=MAX_HOOKS)] = []
    """The last-mile hooks (the policy file's ``hook_after``) that ran and succeeded."""
    hook_running: Name = ""
    """The hook an aggregator claimed (compare-and-set) and runs now, since hook_started."""
    hook_started: UnixTime | None = None
    """When hook_running was claimed; for a reboot hook, when it succeeded."""
    rebooting: Name = ""
    """A reboot hook that succeeded and waits for the node to beat with a new boot id."""
    reboot_from: Name = ""
    """The node's boot id when the reboot hook ran: another one confirms the reboot."""
    hook_error: Text = ""
    """Why the last hook failed (then ``needs_attention``)."""
    identity_withheld: Name = ""
    """The node's claimed identity (a digest) for which its next hook was withheld: it
    names another host, or a GPU not in, its enrolled identity. Its ``hardware_changed``
    alert was raised once; cleared when an operator confirms (``fleetctl approve
    --identity``) or the claims match again."""
    command_digest: Name = ""
    """SHA-256 (hex) of the command body the policy sent: the node's answer names it, also
    a rejection of a message whose id the node would not read (an untrusted signer)."""
    applied: bool = False
    """The node's heartbeat showed the policy's cordon (or drain); until then the hold is
    pending, for at most ``grace`` of the node reporting."""
    refused: Text = ""
    """Why the node never took the policy's command: its signed rejection (with the
    signer), or no cordon and no answer within ``grace``. Such a hold needs attention,
    is not counted by the breaker, and nothing is sent to the node again until an
    operator clears it (``fleetctl policy clear``)."""
    check: Name = ""
    """The check the node's heartbeat named unhealthy (the node's claim)."""
    gpus: Annotated[list[Count], Meta(max_length=MAX_GPUS)] = []
    """Indices of the GPUs that check named (the node's claim)."""
    back_at: UnixTime | None = None
    """``hung``: when the node beat again with another boot id than when it hung
    (``reboot_from``); until then the hold waits for its hooks and the reboot."""


class PolicyRecord(Wire, frozen=True, kw_only=True):
    """One cluster's remediation state, shared by every aggregator through CAS."""

    cluster: Name
    holds: Annotated[dict[NodeId, Hold], Meta(max_length=MAX_HELD)] = {}
    history: Annotated[
        dict[NodeId, Annotated[list[UnixTime], Meta(max_length=MAX_HISTORY)]],
        Meta(max_length=MAX_HELD),
    ] = {}
    """When each node was remediated (cordoned by the policy), within the window."""
    tripped_at: UnixTime | None = None
    """When the breaker tripped; None while closed. Only ``fleetctl policy reset`` closes
    it, and decisions after a reset use the nodes' current state only."""
    would: Annotated[list[Text], Meta(max_length=MAX_WOULD)] = []
    """What the policy would have done when the breaker tripped."""
    limit: Count = 0
    """How many nodes the breaker let the policy hold at the last decision."""
    updated_by: Name = ""
    """The aggregator (its policy key) that wrote this revision."""
    base: Count = 0
    """The cluster's reporting nodes (active, degraded, unhealthy, cordoned, draining,
    drained: not pending, stale or offline) that ``limit`` was taken from."""
    dry: Annotated[dict[NodeId, Text], Meta(max_length=MAX_HELD)] = {}
    """A dry-run policy's would-be actions, per node (``_cluster``: the breaker), as last
    noted: each is alerted once per change, not every round."""
    skipped: Annotated[dict[NodeId, Text], Meta(max_length=MAX_HELD)] = {}
    """Nodes the policy would act on but leaves alone, and why (a maintenance window)."""
