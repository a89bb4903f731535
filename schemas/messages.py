"""Heartbeat, commands, alerts, registration, probes and the KV records.

The events a heartbeat is built from live in :mod:`schemas.events`.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from typing import Annotated, ClassVar, Literal

from msgspec import Meta

from schemas.base import (
    MAX_ENROLL_TOKEN,
    MAX_ENROLLED,
    MAX_GPUS,
    SIGNED_TYPE,
    TOKEN_ID_PATTERN,
    Cluster,
    Count,
    Details,
    Hostname,
    Id,
    Labels,
    Liveness,
    Name,
    NodeId,
    OpenHealthStatus,
    OpenRecordState,
    OpenSchedulability,
    PublicKey,
    Schedulability,
    Seconds,
    Seq,
    Text,
    UnixTime,
    Wire,
)
from schemas.events import (
    Capabilities,
    Engine,
    Gpu,
    Health,
    Jobs,
    Latency,
    Sample,
    Scheduler,
    SpotStatus,
    WorkloadState,
)
from schemas.pci import PassthroughGpu
from schemas.settings import SettingsStatus
from schemas.version import AGENT_VERSION
from schemas.workloads import Deploy, DeployEngine, Port, Stop

MAX_HEARTBEAT_WORKLOADS = 16
"""Workloads a heartbeat lists (and so a node runs): the heartbeat's size budget
(``actors/fleet/storage/streams.py``) leaves room for this many summaries, not for 64 full
``Workload`` events."""


class WorkloadSummary(Wire, frozen=True, kw_only=True):
    """One workload as a heartbeat lists it; the full ``Workload`` is the node's event."""

    name: Name
    engine: DeployEngine
    state: WorkloadState
    since: UnixTime
    port: Port
    gpus: Annotated[list[Annotated[int, Meta(ge=0, lt=MAX_GPUS)]], Meta(max_length=MAX_GPUS)] = []
    model: Name = ""
    restarts: Count = 0
    reason: Name = ""
    container: Name = ""
    """The podman container's id, for a workload deployed with an image."""
    placed: bool = False
    """Deployed by fleet placement (``fleetctl deploy`` without a node)."""


GpuIds = Annotated[list[Name], Meta(max_length=MAX_GPUS)]
"""GPU uuids, sorted: a node's hardware fingerprint."""
MAX_IDENTITY_FACT = 64
IdentityFact = Annotated[str, Meta(max_length=MAX_IDENTITY_FACT)]
"""A cloud fact of an identity, cut to 64 characters (longer ones are cut, not refused):
a 64-GPU node's identity stays within MAX_IDENTITY_BYTES with all of them."""


class NodeIdentity(Wire, frozen=True, kw_only=True):
    """What a machine is: its host name and GPUs. As a node says it (its registration,
    its heartbeats' sample) it is the node's claim; recorded in its trust entry when an
    operator (or an enrollment token) approved it, it is the node's enrolled identity,
    the one the fleet acts on (docs/security.md). Grows with the inventory."""

    hostname: Hostname = ""
    gpus: GpuIds = []
    """The GPUs' uuids, sorted."""
    gpu_product: Name = ""
    """The first GPU's product name (``NVIDIA H100 80GB HBM3``)."""
    gpu_count: Count = 0
    """Every GPU of the machine: those in ``gpus`` and the passthrough ones."""
    gpu_passthrough: Count = 0
    """GPUs bound to ``vfio-pci`` (given to VMs): counted, with no uuid to name them."""
    provider: IdentityFact = ""
    """``aws``, ``gcp`` or ``azure`` (its metadata service), or the operator's
    ``provider`` label; empty when neither says."""
    region: IdentityFact = ""
    instance_type: IdentityFact = ""
    """The cloud's instance type (``p5.48xlarge``), or the ``instance_type`` label."""


MAX_IDENTITY_BYTES = 4096
"""The most bytes an identity is recorded with (encoded): a 64-GPU node's takes about
3 KB. A larger one (only a forger's) is not recorded, so pending records and trust
entries stay small whatever a registration or a heartbeat says."""


def identity_of(
    hostname: str,
    gpus: list[Gpu],
    passthrough: list[PassthroughGpu] | None = None,
    labels: Mapping[str, str] | None = None,
) -> NodeIdentity:
    """The identity a host name, GPU readings, passthrough GPUs and the node's labels
    (``provider``, ``region``, ``instance_type``) give: a registration's, a heartbeat's."""
    passthrough = passthrough or []
    labels = labels or {}
    product = gpus[0].name if gpus else (passthrough[0].name if passthrough else "")
    return NodeIdentity(
        hostname=hostname,
        gpus=sorted(gpu.uuid for gpu in gpus),
        gpu_product=product,
        gpu_count=len(gpus) + len(passthrough),
        gpu_passthrough=len(passthrough),
        provider=labels.get("provider", "")[:MAX_IDENTITY_FACT],
        region=labels.get("region", "")[:MAX_IDENTITY_FACT],
        instance_type=labels.get("instance_type", "")[:MAX_IDENTITY_FACT],
    )


class Heartbeat(Wire, frozen=True, kw_only=True):
    """A node's signed liveness report on ``fleet.hb.<cluster>.<node>``."""

    node_id: NodeId
    cluster: Cluster
    seq: Seq
    """Strictly increasing per node, across restarts; at most 2**63-1."""
    boot_id: Name
    """Random per agent start; with seq it forms the ``Nats-Msg-Id``."""
    ts: UnixTime
    agent_version: Name
    interval: Liveness
    """The heartbeat period the sender uses, so readers can judge lateness."""
    stale_after: Liveness
    """Silence after which the node counts as gone; its ``Nats-TTL``, in whole seconds."""
    schedulability: Schedulability = "schedulable"
    sample: Sample | None = None
    health: Health | None = None
    latency: Latency | None = None
    engine: Engine | None = None
    jobs: Jobs | None = None
    spot: SpotStatus | None = None
    schedulability_reason: Text = ""
    deregistering: bool = False
    """The node is leaving the fleet: aggregators mark its record ``deregistered``."""
    workloads: Annotated[list[WorkloadSummary], Meta(max_length=MAX_HEARTBEAT_WORKLOADS)] = []
    """The workloads the node's workload actor runs (``fleetctl deploy``)."""
    labels: Labels = {}
    """Placement labels (operator-given, cloud and engine facts), in every heartbeat."""
    scheduler: Scheduler | None = None
    """The workload manager's view of the node (Slurm state, jobs, services); None when
    the agent runs no scheduler actor."""
    schedulability_by: Name = ""
    """Who made the node what ``schedulability`` says, as the node says it: an operator's
    (or the remediation policy's) public key, ``spot``, ``agent``, or ``slurm`` (a Slurm
    admin's drain); empty when schedulable by default or from agents that predate it. The
    node's claim: views label it so, and the policy knows what it cordoned from its own
    record (``fleet_policy``), never from this."""
    stopping: bool = False
    """The agent is stopping on request (SIGTERM, Ctrl-C): its goodbye, the last heartbeat
    of this boot. Aggregators mark the record ``stopped`` (an ``info`` alert), not
    ``stale`` when its TTL runs out."""
    previous_ts: UnixTime | None = None
    """The ``ts`` of the heartbeat this boot sent before this one (None on a boot's
    first): how long before this one the previous was stored, so an aggregator can tell
    a heartbeat the node lost from one the stream replaced before it was read."""
    endpoint: Text = ""
    """The URL of the node's OpenAI-compatible gateway for clients outside the node
    (``https://host:port``, API key or client certificate required), where a dispatcher
    routes requests for its workloads; empty when the gateway is the node's own (loopback)
    or not listening."""
    capabilities: Capabilities | None = None
    """What the node can run (:data:`Capabilities`: ``llamacpp``, ``vllm``, ``sglang``,
    ``process``, ``container:<engine>``), as its workload actor found at its last look;
    the node's claim, which placement goes by and the node's own checks still decide.
    None: not said (an agent older than this field, or no workload actor)."""
    settings: SettingsStatus | None = None
    """What the node made of the fleet's settings (KV ``fleet_settings``): the revision it
    reached, the keys in force and their entries, those waiting for a restart and those
    refused; None from agents that predate fleet settings."""
    started: UnixTime | None = None
    """When this boot of the agent started (the node's clock): the agent's uptime, beside
    the host's in ``sample.host``. None from agents that predate it."""


class Cordon(Wire, frozen=True, kw_only=True, tag="cordon", tag_field="kind"):
    """Stop being schedulable; with ``ttl`` the node uncordons itself afterwards."""

    ttl: Seconds | None = None


class Drain(Wire, frozen=True, kw_only=True, tag="drain", tag_field="kind"):
    """Cordon, then wait until in-flight work is zero or ``deadline`` seconds pass."""

    deadline: Seconds = 300.0


class Uncordon(Wire, frozen=True, kw_only=True, tag="uncordon", tag_field="kind"):
    """Become schedulable again."""


class Deregister(Wire, frozen=True, kw_only=True, tag="deregister", tag_field="kind"):
    """Drain, tell the aggregators, and stop the agent."""

    deadline: Seconds = 300.0


Action = Cordon | Drain | Uncordon | Deregister | Deploy | Stop
CommandStatus = Literal["accepted", "rejected", "in_progress", "done", "failed"]
FINAL_STATUSES: frozenset[CommandStatus] = frozenset({"done", "failed", "rejected"})
"""A command's last result: no other follows it."""
SAFE_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
"""Command ids go into Nats-Msg-Id headers; a node refuses any other as malformed."""
MAX_ACTION_SECONDS = 30 * 86400.0
"""Longest cordon TTL or drain deadline a node takes: past it a time is absurd (and 1e30
overflows when the node formats it), so it is refused before the node acts."""


class Command(Wire, frozen=True, kw_only=True, tag_field=SIGNED_TYPE, tag="command"):
    """An operator's signed order to one node, on ``fleet.cmd.<cluster>.<node>``."""

    id: Id
    node_id: NodeId
    cluster: Cluster
    action: Action
    issued_at: UnixTime
    expires_at: UnixTime
    reason: Text = ""


class CommandResult(Wire, frozen=True, kw_only=True):
    """The node's signed answer to a command, on ``fleet.result.<cluster>.<node>``."""

    command_id: Id
    node_id: NodeId
    cluster: Cluster
    status: CommandStatus
    ts: UnixTime
    detail: Text = ""
    schedulability: Schedulability | None = None
    in_flight: Count | None = None
    command_digest: Name = ""
    """SHA-256 (hex) of the exact command body the node received: a sender matches results
    on it, so a rejection of some other message claiming the same id is not taken for an
    answer. ``command_id`` is empty when the message was unverifiable or unreadable."""
    jobs_running: Count | None = None
    """Batch jobs (Slurm) still running on the node, in a drain's progress and final result;
    None when the node has no scheduler."""
    signer: Name = ""
    """The key that signed the command answered, where its signature verified (for a
    rejection: whose message the node refused, trusted or not)."""
    claimed_id: Id = ""
    """A rejection of a message signed by a key the node does not trust: the id that
    message claims (``command_id`` stays empty: the node names no command it did not
    verify as an operator's). A sender following that id shows it with the signer."""
    placed: Count | None = None
    """Fleet-placed workloads still on the node, in a drain's progress and final result
    (the final one: not moved by the deadline); None when the node runs none."""


def command_digest(body: bytes) -> str:
    """What ``CommandResult.command_digest`` names a command body by."""
    return hashlib.sha256(body).hexdigest()


Severity = Literal["info", "warning", "critical"]

AlertKind = Literal[
    "stale",
    "offline",
    "recovered",
    "anomaly",
    "sequence_gap",
    "replay",
    "bad_signature",
    "unknown_node",
    "clock_skew",
    "health",
    "interruption",
    "deregistered",
    "deregistered_node_beating",
    "hardware_changed",
    "remediation",
    "breaker_tripped",
    "needs_attention",
    "stopped",
    "forgotten",
    "revoked",
    "bus_outage",
]

REFUSALS: frozenset[AlertKind] = frozenset(
    {
        "replay",
        "bad_signature",
        "unknown_node",
        "clock_skew",
        "sequence_gap",
        "revoked",
        "forgotten",
    }
)
"""The kinds an aggregator raises when it refuses a heartbeat (``sequence_gap`` too: a
jump is refused, and raised again at every beat until an operator's ``reset-seq``)."""


class Alert(Wire, frozen=True, kw_only=True):
    """Raised by aggregators on ``fleet.alert.<kind>.<cluster>.<node>``."""

    id: Id
    """Deterministic: the same event yields the same id (and ``Nats-Msg-Id``) everywhere."""
    kind: AlertKind
    node_id: NodeId
    cluster: Cluster
    severity: Severity
    message: Text
    ts: UnixTime
    details: Details = {}


class Registration(Wire, frozen=True, kw_only=True, tag_field=SIGNED_TYPE, tag="registration"):
    """A node asking the aggregators to admit it (request on ``fleet.register``)."""

    node_id: NodeId
    cluster: Cluster
    public_key: PublicKey
    ts: UnixTime
    hostname: Hostname = ""
    agent_version: Name = AGENT_VERSION
    fingerprint: Name = ""
    enroll_token: Annotated[str, Meta(max_length=MAX_ENROLL_TOKEN)] = ""
    """An operator's enrollment token (``fleetctl enroll-token create``): aggregators
    approve ``public_key`` at once if it is valid for this cluster (docs/security.md)."""
    identity: NodeIdentity | None = None
    """The node's host name and GPUs as it says at registration: recorded as its enrolled
    identity when its key is approved (``fleetctl approve``, an enrollment token)."""


class RegistrationReply(Wire, frozen=True, kw_only=True):
    node_id: NodeId
    status: Literal["pending", "active", "rejected"]
    reason: Text = ""


class Forget(Wire, frozen=True, kw_only=True, tag_field=SIGNED_TYPE, tag="forget"):
    """An operator's request to remove a node from the fleet (``fleetctl forget``), signed
    by the operator key, on ``fleet.forget``: aggregators act on it only if they trust the
    key (``trust_operators``) and its ``ts`` is within their clock skew bound."""

    node_id: NodeId
    ts: UnixTime
    reason: Text = ""


class ForgetReply(Wire, frozen=True, kw_only=True):
    """What the aggregator that took a ``Forget`` did."""

    node_id: NodeId
    status: Literal["forgotten", "already", "rejected"]
    reason: Text = ""
    revoked: bool = False
    """The node's approved key was revoked now."""
    purged: bool = False
    """Commands still queued for the node were purged."""


class Probe(Wire, frozen=True, kw_only=True):
    """Latency probe request on ``fleet.probe.<node>``."""

    from_node: NodeId
    nonce: Name
    sent_at: UnixTime


class ProbeReply(Wire, frozen=True, kw_only=True):
    node_id: NodeId
    nonce: Name
    sent_at: UnixTime
    replied_at: UnixTime


MAX_CANDIDATES = 8
"""Keys one pending node name keeps besides the first registration's."""


class Candidate(Wire, frozen=True, kw_only=True):
    """Another key that registered a pending node name (the first one is the record's
    ``public_key``): an operator approving the name chooses among them."""

    public_key: PublicKey
    cluster: Cluster
    since: UnixTime
    registered_by: Name = ""
    """The NATS login that sent the registration (``ACCOUNT/USER``), where the server
    says it; empty otherwise."""


class NodeRecord(Wire, frozen=True, kw_only=True):
    """An aggregator's view of one node: KV bucket ``fleet_nodes``, key ``<node>``.

    ``state`` is derived from the other facts by the precedence
    deregistered > offline > stale > stopped > drained > draining > cordoned > unhealthy >
    degraded > active > pending: what an operator did to a node (cordon, drain) outranks
    its health.
    """

    embeds_at: ClassVar[int] = 1
    """``heartbeat`` is the node's accepted heartbeat as the bytes it came in, one level
    into the record (the aggregator splices them in, unknown fields and all): a record may
    nest this much deeper than :data:`schemas.codec.MAX_DEPTH`, so the heartbeat in it is
    held to the bound it was accepted under, and every accepted heartbeat makes a record
    every reader can read."""

    node_id: NodeId
    cluster: Cluster
    state: OpenRecordState
    last_seq: Count
    last_seen: UnixTime
    boot_id: Name = ""
    public_key: Name = ""
    schedulability: OpenSchedulability = "schedulable"
    health_status: OpenHealthStatus | None = None
    """The node's last reported health; a heartbeat without a health report (the first
    ones after an agent starts) leaves it as it was."""
    health_score: Count | None = None
    gpus_total: Count = 0
    stale_since: UnixTime | None = None
    deregistered: bool = False
    agent_version: Name = ""
    heartbeat: Heartbeat | None = None
    """The last accepted heartbeat, whole."""
    offline_since: UnixTime | None = None
    last_stream_seq: Count = 0
    """FLEET_HB stream sequence of the last accepted heartbeat: an older heartbeat delivered
    late (several aggregators) is told apart from a replay published again later."""
    last_stored: UnixTime | None = None
    """When FLEET_HB stored the last accepted heartbeat (server clock): a TTL marker
    earlier than ``stored + stale_after`` cannot be the server's and is ignored."""
    pending_since: UnixTime | None = None
    """When a registration created this pending record; expired by the sweep."""
    seq_reset: bool = False
    """Set by ``fleetctl reset-seq``: the next valid heartbeat is accepted whatever its seq
    (a re-imaged node starting again at 1); cleared by accepting it."""
    created: UnixTime | None = None
    """When an aggregator created this record (a registration or the node's first accepted
    heartbeat): ``fleetctl nodes``' AGE. A record made by an older aggregator gets it at
    its next accepted heartbeat."""
    labels: Labels = {}
    """The labels of the last accepted heartbeat."""
    deregistered_by: Name = ""
    """Who deregistered the node: ``node`` (it said so in a heartbeat) or the public key of
    the operator whose ``fleetctl forget`` did."""
    deregistered_reason: Text = ""
    deregistered_at: UnixTime | None = None
    refused: Name = ""
    """The kind of the last refusal of this node's heartbeats since the last accepted one
    (``unknown_node``, ``replay``, ...); empty while its heartbeats are accepted. The node
    reads its own record to learn it is refused."""
    refused_at: UnixTime | None = None
    """When ``refused`` was last written (writes are rate-limited)."""
    gpu_fingerprint: GpuIds = []
    """The sorted GPU uuids of the last accepted heartbeat with a sample: a change raises
    ``hardware_changed``."""
    candidates: Annotated[list[Candidate], Meta(max_length=MAX_CANDIDATES)] = []
    """While pending: the other keys that registered this name since the first, in order;
    ``fleetctl approve NODE`` lists them all with ``public_key``. Cleared when a heartbeat
    is accepted."""
    registered_by: Name = ""
    """The NATS login (``ACCOUNT/USER``) that sent the registration that made this record,
    where the server says it (``Nats-Request-Info``); empty otherwise."""
    stopped_since: UnixTime | None = None
    """When the node's goodbye heartbeat (``stopping``) was accepted: state ``stopped``,
    neither stale nor offline while it stays away; cleared by its next heartbeat."""
    gpus_seen: bool = False
    """``gpu_fingerprint`` comes from a sample: an empty one means the node reported no
    GPU (NVML failing), not that no sample came yet; so a set that goes from none to some
    raises ``hardware_changed`` too. Records of older aggregators lack it (false)."""
    registered_identity: NodeIdentity | None = None
    """While pending: the identity the registration of ``public_key`` carried (at most
    ``MAX_IDENTITY_BYTES``), which ``fleetctl approve`` records as the node's enrolled
    identity; the candidates' are not kept. Cleared when a heartbeat is accepted."""


EnrollTokenId = Annotated[str, Meta(pattern=TOKEN_ID_PATTERN, description="token id")]


class EnrollClaims(Wire, frozen=True, kw_only=True, tag_field=SIGNED_TYPE, tag="enroll_claims"):
    """What an enrollment token says, signed by an operator key. The token a node is given
    is ``base64url(claims JSON) "." base64url(Ed25519 signature over those bytes)``."""

    id: EnrollTokenId
    issuer: PublicKey
    """The operator key that signed it; aggregators honour only keys they trust."""
    cluster: Annotated[str, Meta(max_length=64)] = ""
    """The one cluster it admits nodes into; "" admits into any cluster."""
    issued_at: UnixTime
    expires_at: UnixTime
    uses: Annotated[int, Meta(ge=1, le=1_000_000)] = 1


class EnrollRecord(Wire, frozen=True, kw_only=True):
    """An enrollment token's state: KV bucket ``fleet_enroll``, key ``<id>``. A token whose
    record is missing (never created, expired away) admits nobody."""

    id: EnrollTokenId
    issuer: PublicKey
    cluster: Annotated[str, Meta(max_length=64)] = ""
    issued_at: UnixTime
    expires_at: UnixTime
    uses: Count
    used: Count = 0
    """Approvals made with it; compare-and-set, so several aggregators never exceed uses."""
    revoked: bool = False
    revoked_at: UnixTime | None = None
    nodes: Annotated[list[NodeId], Meta(max_length=MAX_ENROLLED)] = []
    """The latest nodes it approved."""


class TrustEntry(Wire, frozen=True, kw_only=True):
    """The approved public key of one node: KV bucket ``fleet_trust``, key ``<node>``."""

    node_id: NodeId
    public_key: PublicKey
    approved_at: UnixTime
    approved_by: Name = ""
    revoked: bool = False
    identity: NodeIdentity | None = None
    """The node's enrolled identity: what its registration said when its key was
    approved, or what it claimed when an operator confirmed it (``fleetctl approve
    --identity``). Hooks act on it, never on what the node claims now; a node whose
    claims name another host or a GPU not in it gets no hook until confirmed. None: the
    key was approved without one (``fleetctl approve NODE KEY``, an older registration)."""
    identity_by: Name = ""
    """Who recorded ``identity``: ``fleetctl`` (approve, approve --identity),
    ``enroll:<token id>``."""
    identity_at: UnixTime | None = None
    """When ``identity`` was recorded."""


MAX_MAINTENANCE_NODES = 1_000
"""Nodes one maintenance window may name (a selector names any number)."""


class Maintenance(Wire, frozen=True, kw_only=True, tag_field=SIGNED_TYPE, tag="maintenance"):
    """An operator's request to start or end a maintenance window (``fleetctl
    maintenance``), signed by the operator key, on ``fleet.maintenance``: aggregators act
    on it only if they trust the key (``trust_operators``) and its ``ts`` is within their
    clock skew bound. A window covers the nodes whose labels hold every pair of
    ``selector``, in ``cluster`` when set, or named in ``nodes``."""

    action: Literal["start", "end"]
    id: Id
    """The window (``start``: chosen by the sender; ``end``: the window to end)."""
    ts: UnixTime
    selector: Labels = {}
    cluster: Name = ""
    nodes: Annotated[list[NodeId], Meta(max_length=MAX_MAINTENANCE_NODES)] = []
    until: UnixTime = 0.0
    """When the window ends by itself (``start``)."""
    reason: Text = ""
    drain: bool = False
    """Move the placed replicas off the nodes it covers, as a drain does (``start
    --drain``): each replica is placed elsewhere at once and its copy stopped once the new
    one is ready. Without it, placement only stops choosing those nodes."""


class MaintenanceWindow(Wire, frozen=True, kw_only=True):
    """A maintenance window in force: KV bucket ``fleet_maintenance``, key ``<id>``. Alerts
    of the nodes it covers are recorded in ``FLEET_ALERTS`` but not forwarded to
    Alertmanager; views show the nodes as in ``maintenance``. Ended by ``until`` passing;
    ``fleetctl maintenance end`` sets ``until`` to its time (the window is kept, so a
    replayed start finds its id taken)."""

    id: Id
    since: UnixTime
    until: UnixTime
    by: Name
    """The operator public key that started it."""
    selector: Labels = {}
    cluster: Name = ""
    nodes: Annotated[list[NodeId], Meta(max_length=MAX_MAINTENANCE_NODES)] = []
    reason: Text = ""
    drain: bool = False
    """The placed replicas on the nodes it covers are moved off them, as by a drain."""


class MaintenanceReply(Wire, frozen=True, kw_only=True):
    """What the aggregator that took a ``Maintenance`` did."""

    id: Id
    status: Literal["started", "ended", "rejected"]
    reason: Text = ""


class PolicyRequest(Wire, frozen=True, kw_only=True, tag_field=SIGNED_TYPE, tag="policy_request"):
    """An operator's request to the remediation policy (``fleetctl policy reset|clear``),
    signed by the operator key, on ``fleet.policy``: aggregators act on it only if they
    trust the key (``trust_operators``) and its ``ts`` is within their clock skew bound.
    It names the state it acts on (the trip it closes, the hold it clears), so a copy
    replayed after the policy moved on changes nothing."""

    action: Literal["reset", "clear"]
    cluster: Cluster
    ts: UnixTime
    tripped_at: UnixTime | None = None
    """``reset``: when the breaker it closes tripped (``PolicyRecord.tripped_at``)."""
    node: NodeId | None = None
    """``clear``: the node whose hold and history the policy forgets."""
    since: UnixTime | None = None
    """``clear``: the hold's ``since`` (None: the node has no hold, only history)."""


class PolicyReply(Wire, frozen=True, kw_only=True):
    """What the aggregator that took a ``PolicyRequest`` did."""

    status: Literal["done", "rejected"]
    reason: Text = ""


class AggregatorLease(Wire, frozen=True, kw_only=True):
    """KV ``fleet_leases``, key ``hb.<P>``: which aggregator consumes partition P of
    ``FLEET_HB`` now, held by compare-and-set on the key's revision; key
    ``member.<holder>``: an aggregator that is alive (see docs/failure-detection.md, "How
    partitions work")."""

    holder: Name
    """The holding aggregator's id (host and a random suffix per start)."""
    ttl: Seconds
    """Another aggregator takes the lease over once its revision has not changed for this long."""
    renewed: UnixTime
    """The holder's clock at its last renewal (for operators; no decision reads it)."""
