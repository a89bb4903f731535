"""Node events on ``fleet.evt.<node>.<event>``; each one is also a part of the Heartbeat.

Actors publish these on core NATS; the heartbeat actor folds the latest of each into the
next heartbeat, so the heartbeat says exactly what the node's actors last observed.
Every part carries ``ts``, the time it was observed, so a reader can tell fresh from stale.
"""

from __future__ import annotations

from typing import Annotated, Final, Literal

import msgspec
from msgspec import Meta

from schemas import codec
from schemas.base import (
    MAX_CHECKS,
    MAX_COMPONENTS,
    MAX_DEPENDENCIES,
    MAX_ENGINES,
    MAX_GPUS,
    MAX_MODELS,
    MAX_NVLINKS,
    MAX_PEERS,
    MAX_UNREAD,
    MAX_WORKLOADS,
    MAX_XIDS,
    SIGNED_TYPE,
    Bytes,
    CheckStatus,
    Count,
    HealthStatus,
    Hostname,
    Id,
    Name,
    NodeId,
    Percent,
    Schedulability,
    Seconds,
    Text,
    UnixTime,
    Url,
    Wire,
)
from schemas.errors import DecodeError
from schemas.pci import PassthroughGpu
from schemas.settings import Settings
from schemas.subjects import (
    EVENT_CLOUD,
    EVENT_ENGINE,
    EVENT_GATEWAY,
    EVENT_HEALTH,
    EVENT_INJECT,
    EVENT_INTERRUPTION,
    EVENT_LATENCY,
    EVENT_SAMPLE,
    EVENT_SCHEDULER,
    EVENT_SETTINGS,
    EVENT_STATE,
    EVENT_WORKLOAD_ORDER,
    EVENT_WORKLOADS,
    event_kind,
)
from schemas.workloads import WorkloadOrder

HEADER_SESSION_SEQ: Final = "Fleet-Session-Seq"
"""Optional header on node events and heartbeats: the publishing agent process's message
counter, in decimal, strictly increasing over everything that process publishes."""
HEADER_SESSION_TAG: Final = "Fleet-Session-Tag"
"""Optional header beside ``Fleet-Session-Seq``: lower-case hex of HMAC-SHA256, under a
secret the agent process made at its start and never stores or sends, of the subject, a
NUL byte, the counter in decimal, a NUL byte and the body. Only that process can check it,
and its actors act on an event only if it does (or, for ``inject``, if a trusted operator
signed it); every other reader ignores both headers and reads the ``Fleet-Key`` /
``Fleet-Sig`` signature: what the node claims."""


class Capacity(Wire, frozen=True, kw_only=True):
    """What the node has and what is free right now."""

    cpu_cores: Count
    cpu_percent: Percent
    """CPU use over the last sample period (a delta, never since boot)."""
    load_avg_1m: float
    memory_total: Bytes
    memory_available: Bytes
    gpus_total: Count
    gpus_available: Count
    storage_total: Bytes
    storage_available: Bytes
    cpu_cores_available: Count | None = None
    """Cores free for more work: those Slurm has not allocated where Slurm runs, else
    the idle share of ``cpu_cores`` (rounded down); None from agents that predate it."""


class XidCount(Wire, frozen=True, kw_only=True):
    """How often one NVIDIA XID code was seen on one GPU since the agent started."""

    code: Count
    count: Count
    last_at: UnixTime


class RowRemap(Wire, frozen=True, kw_only=True, omit_defaults=True):
    """Row remapping (A100 and later): rows remapped for correctable and uncorrectable
    errors, a remap waiting for a GPU reset, a remap that failed, and the remapper's
    histogram (banks with ``max``/``high``/``partial``/``low``/``none`` spare rows left)."""

    correctable: Count
    uncorrectable: Count
    pending: bool
    failed: bool
    banks_none: Count | None = None
    """Banks with no spare row left (histogram ``none``); None when the histogram is
    not supported."""
    banks_low: Count | None = None


class NvLink(Wire, frozen=True, kw_only=True, omit_defaults=True):
    """One NVLink link that answers NVML: active or not, and its error counters."""

    link: Count
    active: bool
    replay_errors: Count | None = None
    recovery_errors: Count | None = None
    crc_errors: Count | None = None


class Fabric(Wire, frozen=True, kw_only=True, omit_defaults=True):
    """The GPU's NVLink fabric registration (nvmlDeviceGetGpuFabricInfoV) where supported:
    ``state`` NOT_STARTED, IN_PROGRESS or COMPLETED, ``status`` NVML's return code of the
    registration (0 success), ``health_mask`` the fabric health bits as NVML gives them."""

    state: Literal["not_started", "in_progress", "completed"]
    status: int
    health_mask: Count = 0


class GpuHealth(Wire, frozen=True, kw_only=True, omit_defaults=True):
    """One GPU's health readings beyond the basics (what DCGM's health checks read).

    Encoded without its defaults: a reading NVML did not give is absent (None), and
    ``unread`` says why. Judged against the GPU health table (docs/node.md)."""

    ecc_corrected_aggregate: Count | None = None
    """ECC errors over the GPU's life (the ``ecc_*`` above count since the driver loaded)."""
    ecc_uncorrected_aggregate: Count | None = None
    retired_pages: Count | None = None
    """Pages retired for single- and double-bit errors (before A100; H100 remaps rows)."""
    retired_pending: bool | None = None
    """A page retirement waits for the next driver reload or GPU reset."""
    remap: RowRemap | None = None
    clock_reasons: Count | None = None
    """Why clocks are held down right now: NVML's clock event reasons bit mask
    (nvmlClocksEventReason*: 0x1 idle, 0x2 application clocks, 0x4 SW power cap, 0x8 HW
    slowdown, 0x10 sync boost, 0x20 SW thermal, 0x40 HW thermal, 0x80 HW power brake)."""
    sm_clock_mhz: Count | None = None
    sm_clock_max_mhz: Count | None = None
    memory_clock_mhz: Count | None = None
    memory_clock_max_mhz: Count | None = None
    pcie_replays: Count | None = None
    """PCIe replay counter (cumulative); its rate is what the pcie check judges."""
    pcie_generation: Count | None = None
    pcie_generation_max: Count | None = None
    """The highest generation the GPU and its slot both support."""
    pcie_width: Count | None = None
    pcie_width_max: Count | None = None
    nvlinks: Annotated[list[NvLink], Meta(max_length=MAX_NVLINKS)] | None = None
    """Links that answer NVML; None when none does (no NVLink visible: not "down")."""
    fabric: Fabric | None = None
    """None where the GPU has no fabric state (state "not supported")."""
    persistence_mode: bool | None = None
    unread: Annotated[dict[Name, Name], Meta(max_length=MAX_UNREAD)] = {}
    """NVML call -> why it gave no answer, for the readings that are None (e.g.
    ``{"nvmlDeviceGetRetiredPages": "Not Supported"}``)."""
    memory_reserved: Bytes | None = None
    """Memory the driver reserves for itself, reported beside the GPU's ``memory_used``,
    which then leaves it out (nvidia-smi's count; ``nvmlDeviceGetMemoryInfo_v2``). None
    where the driver only answers the v1 call, whose ``memory_used`` includes it. Here,
    encoded only when known, so a heartbeat without it weighs no more."""


class Gpu(Wire, frozen=True, kw_only=True):
    """One GPU's identity and readings. Readings are None when the device cannot say."""

    index: Count
    uuid: Name
    name: Name
    pci_bus_id: Name
    memory_total: Bytes
    memory_used: Bytes
    temperature_c: float | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    utilization_pct: Percent | None = None
    ecc_corrected: Count | None = None
    ecc_uncorrected: Count | None = None
    xids: Annotated[list[XidCount], Meta(max_length=MAX_XIDS)] = []
    lost: bool = False
    """True once the device stopped answering (NVML GpuIsLost, or injected)."""
    health: GpuHealth | None = None
    """The deep health readings (NVML only; None for simulated GPUs and lost ones)."""


class Dependency(Wire, frozen=True, kw_only=True):
    """A program the node's work depends on and what its ``--version`` said."""

    name: Name
    version: Name
    """The first line of ``NAME --version``, e.g. ``podman version 4.9.3``."""


class HostFacts(Wire, frozen=True, kw_only=True):
    """Facts about the host operators and schedulers place by, beside the capacity."""

    uptime_s: Seconds
    """Seconds since the host booted (not the agent: that is a metric)."""
    memory_used_pct: Percent
    cpu_model: Name = ""
    gpu_utilization_pct: Percent | None = None
    """Mean utilization over the GPUs that report one; None when none does."""
    storage_path: Text = ""
    """The path whose file system ``capacity.storage_*`` measures (setting storage_path)."""
    storage_used_pct: Percent = 0.0
    dependencies: Annotated[list[Dependency], Meta(max_length=MAX_DEPENDENCIES)] = []
    """Versions of the configured programs that answer ``--version`` (checked off the
    sample path, cached); a program absent or silent is left out."""
    gpu_driver_version: Name = ""
    """NVIDIA driver version (nvmlSystemGetDriverVersion); empty without NVML."""
    cuda_driver_version: Name = ""
    """Highest CUDA version the driver supports, e.g. ``13.0``; empty without NVML."""
    fabric_manager_running: bool | None = None
    """Whether the nvidia-fabricmanager process runs; None where no GPU has a fabric state
    (no NVSwitch) or the check is off (setting fabric_manager_process)."""


class Sample(Wire, frozen=True, kw_only=True):
    """Inventory sample, published by the inventory actor every sample period."""

    ts: UnixTime
    capacity: Capacity
    gpus: Annotated[list[Gpu], Meta(max_length=MAX_GPUS)] = []
    gpu_source: Literal["nvml", "fake", "none"] = "none"
    fingerprint: Name = ""
    """SHA-256 (hex) of stable hardware identifiers; changes when hardware changes."""
    hostname: Hostname = ""
    gpu_error: Text = ""
    """Why the GPU source fails, in NVML's words (init, device count or a device's handle);
    empty when it works. The nvml and boot checks are unhealthy while it is set."""
    host: HostFacts | None = None
    """Host uptime, memory use, CPU model, mean GPU utilization, storage, dependency versions."""
    passthrough_gpus: Annotated[list[PassthroughGpu], Meta(max_length=MAX_GPUS)] = []
    """NVIDIA GPUs bound to ``vfio-pci`` (given to VMs), found on the PCI bus: not in
    ``gpus``, never health-checked nor given to workloads (schemas/pci.py)."""


class HealthComponent(Wire, frozen=True, kw_only=True):
    """One scored component: its points out of ``max_points`` and why."""

    name: Name
    points: Count
    max_points: Count
    reason: Text


class HealthCheck(Wire, frozen=True, kw_only=True):
    """One hard check (boot, nvml, xid, dependencies, probe freshness)."""

    name: Name
    status: CheckStatus
    reason: Text
    action: Text = ""
    """Recommended operator action, when the check knows one (e.g. from the XID table)."""
    gpus: Annotated[list[Count], Meta(max_length=MAX_GPUS)] = []
    """Indices of the GPUs the check finds at fault (empty: none named, or not a per-GPU
    finding)."""


class Health(Wire, frozen=True, kw_only=True):
    """Health score 0-100 with every component explained, plus the hard checks."""

    ts: UnixTime
    status: HealthStatus
    score: Count
    components: Annotated[list[HealthComponent], Meta(max_length=MAX_COMPONENTS)] = []
    checks: Annotated[list[HealthCheck], Meta(max_length=MAX_CHECKS)] = []


class PeerLatency(Wire, frozen=True, kw_only=True):
    """Round trip to one peer agent over ``fleet.probe.<node>``."""

    target_node_id: NodeId
    rtt_us: Count | None
    """Latest round trip in microseconds; None when the latest probe got no answer."""
    loss_pct: Percent
    measured_at: UnixTime


class Latency(Wire, frozen=True, kw_only=True):
    """Latency to peers and to the NATS server, with loss over a sliding window."""

    ts: UnixTime
    peers: Annotated[list[PeerLatency], Meta(max_length=MAX_PEERS)] = []
    gateway_rtt_us: Count | None = None
    """Round trip to the NATS server (a flush) in microseconds."""
    avg_peer_rtt_us: Count | None = None
    loss_pct: Percent = 0.0


class EngineStatus(Wire, frozen=True, kw_only=True):
    """One inference engine's health and load."""

    kind: Literal["vllm", "sglang", "llamacpp"]
    url: Url
    healthy: bool
    in_flight: Count | None = None
    waiting: Count | None = None
    reason: Text = ""
    checked_at: UnixTime = 0.0
    models: Annotated[list[Name], Meta(max_length=MAX_MODELS)] = []
    """Served model names (``/v1/models``), when the engine answers it."""


class Engine(Wire, frozen=True, kw_only=True):
    """All configured inference engines; ``engines`` is empty when none is configured."""

    ts: UnixTime
    engines: Annotated[list[EngineStatus], Meta(max_length=MAX_ENGINES)] = []
    in_flight: Count | None = None
    """Sum of in-flight requests over engines that reported one."""


class Interruption(Wire, frozen=True, kw_only=True):
    """A cloud notice that this instance will be reclaimed or should be moved."""

    ts: UnixTime
    provider: Literal["aws", "gcp", "azure"]
    kind: Literal["terminate", "stop", "hibernate", "preempt", "rebalance", "maintenance"]
    deadline: UnixTime | None = None
    """When the provider will act; None when the provider gives no time."""
    event_id: Name = ""
    detail: Text = ""
    rehearsal: bool = False
    """An operator's ``node-agent inject spot``, not the cloud's: acted on as a real one."""


def notice_key(notice: Interruption) -> str:
    """One spot notice's identity, the same in every heartbeat that carries it: it names the
    node's ``spot:<key>`` action and every aggregator's ``interruption`` alert id alike."""
    mark = notice.event_id or (f"{notice.deadline:.0f}" if notice.deadline else "")
    return f"{notice.provider}:{notice.kind}:{mark}".rstrip(":")


class CloudFacts(Wire, frozen=True, kw_only=True):
    """Where the node runs, as its cloud's metadata service says (spot watcher, once):
    the heartbeat turns these into the labels region, zone, instance_type, lifecycle."""

    ts: UnixTime
    provider: Literal["aws", "gcp", "azure"]
    region: Name = ""
    zone: Name = ""
    instance_type: Name = ""
    lifecycle: Name = ""
    """``spot`` or ``on-demand``."""


class NodeState(Wire, frozen=True, kw_only=True):
    """The node's schedulability, published at once whenever it changes."""

    ts: UnixTime
    schedulability: Schedulability
    reason: Text = ""
    command_id: Id = ""
    until: UnixTime | None = None
    """When a cordon with a TTL lifts by itself."""
    deregistering: bool = False
    by: Name = ""
    """Who set this state: the public key (``U…``) of the operator (or remediation policy)
    whose signed command did, ``spot`` (a cloud notice), ``agent`` (its own shutdown, a
    cordon's TTL running out); empty from agents that predate it."""


class Inject(Wire, frozen=True, kw_only=True, tag_field=SIGNED_TYPE, tag="inject"):
    """A fault to inject into a fake-GPU agent (tests and demos; real GPUs ignore it), or
    a spot notice to rehearse a reclaim on any agent."""

    ts: UnixTime
    node_id: NodeId
    fault: Literal["temp", "util", "xid", "gpu-lost", "clear", "spot"]
    """``spot``: a rehearsal of a cloud's reclaim, taken by the spot watcher (real GPUs
    or not): an ``Interruption`` whose deadline is ``value`` seconds after ``ts``."""
    gpu: Count | None = None
    """GPU index, or None for every GPU."""
    value: float | None = None
    """Temperature in C, utilization in %, the XID code, or a spot notice's seconds."""


class Jobs(Wire, frozen=True, kw_only=True):
    """Work running on the node, as far as the agent can see it."""

    running: Count = 0
    waiting: Count = 0


class SpotStatus(Wire, frozen=True, kw_only=True):
    """Which cloud the spot watcher watches, and the notice if there is one."""

    provider: Literal["aws", "gcp", "azure", "none"] = "none"
    notice: Interruption | None = None


WorkloadEngine = Literal["llamacpp", "vllm", "sglang", "process"]
WorkloadState = Literal["starting", "ready", "failed", "crashloop", "stopping", "stopped"]


class Workload(Wire, frozen=True, kw_only=True):
    """One workload the node's workload actor runs (an inference engine or any process)."""

    name: Name
    engine: WorkloadEngine
    state: WorkloadState
    since: UnixTime
    """When it entered ``state``."""
    port: Count
    """Loopback port it serves on (127.0.0.1)."""
    gpus: Annotated[list[Count], Meta(max_length=MAX_GPUS)] = []
    model: Text = ""
    restarts: Count = 0
    reason: Text = ""
    max_pending: Count = 8
    """Requests the node's gateway lets wait for it beyond those in flight."""
    container: Name = ""
    """The podman container's id, for a workload deployed with an image."""
    placed: bool = False
    """Deployed by fleet placement (``Deploy.placed``): a drain waits until it is stopped."""


MAX_CAPABILITIES = 16
"""What a heartbeat (or the workload event) says a node can run, at most: an entry per
engine on the host and per engine in a container."""
Capabilities = Annotated[list[Name], Meta(max_length=MAX_CAPABILITIES)]
"""What a node can run (``Heartbeat.capabilities``): ``<engine>`` for an engine it
allows and finds the binary of on the host, ``container:<engine>`` for one it allows in a
container (an image allowed, the container runtime found). Plain names, not a closed
set: a newer agent's engine is a new value older aggregators pass through."""


class Workloads(Wire, frozen=True, kw_only=True):
    """Every workload the node runs, published whenever one changes state."""

    ts: UnixTime
    workloads: Annotated[list[Workload], Meta(max_length=MAX_WORKLOADS)] = []
    capabilities: Capabilities | None = None
    """What the node can run (:data:`Capabilities`), as the workload actor found it when
    it published this; None from an agent older than this field."""


class Gateway(Wire, frozen=True, kw_only=True):
    """The node's OpenAI-compatible gateway: the requests it holds right now. Published
    whenever they change (and periodically), so a drain waits for them too."""

    ts: UnixTime
    serving: bool = False
    """True while the gateway listens."""
    in_flight: Count = 0
    """Requests passed to a workload and not yet answered in full (streams included)."""
    waiting: Count = 0
    """Requests accepted and queued for a busy workload."""
    held_by_port: Annotated[dict[Count, Count], Meta(max_length=MAX_WORKLOADS)] = {}
    """Requests held (in flight or waiting) per workload port, where any: a model switch
    stops a workload once the gateway holds none of its requests."""
    endpoint: Text = ""
    """The gateway's URL for clients outside the node (``https://host:port``); empty while
    it listens on loopback only or not at all."""


class SchedulerJobs(Wire, frozen=True, kw_only=True):
    """Batch jobs on this node as the workload manager counts them (the HPC seed agent's
    ``jobs`` block). A count is None when the scheduler could not say; ``history_reason``
    says why the 24 h counts are None (e.g. no accounting), never a made-up 0."""

    running_count: Count | None = None
    pending_count: Count | None = None
    """Jobs pending in a partition this node belongs to."""
    completed_24h: Count | None = None
    failed_24h: Count | None = None
    """Jobs that ended FAILED, TIMEOUT, NODE_FAIL or OUT_OF_MEMORY in the last 24 h."""
    history_reason: Text = ""


class SchedulerServices(Wire, frozen=True, kw_only=True):
    """The node's HPC services (the HPC seed agent's ``services`` block)."""

    slurmd_running: bool = False
    slurmd_version: Name = ""
    munge_running: bool = False
    munge_version: Name = ""
    container_runtime: Name = ""
    """apptainer, singularity, enroot, podman or docker: the first one found; "" if none."""
    container_runtime_version: Name = ""


class Scheduler(Wire, frozen=True, kw_only=True):
    """The node as its workload manager (Slurm) sees it, published by the scheduler actor."""

    ts: UnixTime
    kind: Literal["slurm", "none"] = "none"
    """``none``: no scheduler on this node (or ``--scheduler none``)."""
    node_name: Name = ""
    """The node's name in Slurm (default: the short hostname)."""
    reachable: bool = False
    """Slurm answered for this node; when False, ``reason`` says why."""
    reason: Text = ""
    slurm_state: Name = ""
    """Slurm's node state as ``scontrol show node`` prints it, lower case (``mixed+drain``)."""
    state_reason: Text = ""
    """Slurm's reason for the node's state (a drain's reason), without its [user@time] tail."""
    drain: bool = False
    """Slurm has the node drained or draining (by anyone)."""
    ours: bool = False
    """The drain carries the fleet marker (``fleet: ...``): this agent set it."""
    jobs: SchedulerJobs = msgspec.field(default_factory=SchedulerJobs)
    services: SchedulerServices = msgspec.field(default_factory=SchedulerServices)
    cpus_total: Count | None = None
    """``CPUTot`` of ``scontrol show node``: the CPUs Slurm schedules here."""
    cpus_allocated: Count | None = None
    """``CPUAlloc``: those its jobs hold now (the heartbeat's ``cpu_cores_available``)."""


Event = (
    Sample
    | Health
    | Interruption
    | Latency
    | Engine
    | NodeState
    | Inject
    | Workloads
    | WorkloadOrder
    | Gateway
    | CloudFacts
    | Scheduler
    | Settings
)
"""Any message published on ``fleet.evt.<node>.<event>``."""

EVENT_TYPES: Final[dict[str, type[Event]]] = {
    EVENT_SAMPLE: Sample,
    EVENT_HEALTH: Health,
    EVENT_INTERRUPTION: Interruption,
    EVENT_LATENCY: Latency,
    EVENT_ENGINE: Engine,
    EVENT_STATE: NodeState,
    EVENT_INJECT: Inject,
    EVENT_WORKLOADS: Workloads,
    EVENT_WORKLOAD_ORDER: WorkloadOrder,
    EVENT_GATEWAY: Gateway,
    EVENT_CLOUD: CloudFacts,
    EVENT_SCHEDULER: Scheduler,
    EVENT_SETTINGS: Settings,
}
"""The one place that says which Struct each event kind carries."""


def decode_event(subject: str, data: bytes) -> Event:
    """Decode a node event by the kind its subject names, so every reader agrees on the
    type; an unknown kind is a DecodeError like a malformed body."""
    kind = event_kind(subject)
    event_type = EVENT_TYPES.get(kind)
    if event_type is None:
        raise DecodeError(subject, "node event", f"unknown event kind {kind!r}")
    return codec.decode(data, event_type, subject)


__all__ = [
    "EVENT_TYPES",
    "HEADER_SESSION_SEQ",
    "HEADER_SESSION_TAG",
    "Capacity",
    "CloudFacts",
    "Dependency",
    "Engine",
    "EngineStatus",
    "Event",
    "Gateway",
    "Gpu",
    "Health",
    "HealthCheck",
    "HealthComponent",
    "HostFacts",
    "Inject",
    "Interruption",
    "Jobs",
    "Latency",
    "NodeState",
    "PassthroughGpu",
    "PeerLatency",
    "Sample",
    "Scheduler",
    "SchedulerJobs",
    "SchedulerServices",
    "Settings",
    "SpotStatus",
    "Workload",
    "WorkloadOrder",
    "Workloads",
    "XidCount",
    "decode_event",
    "notice_key",
]
