"""The node agent's settings: every one a flag, a ``NODE_AGENT_*`` environment variable and a
TOML key, merged and validated by the runtime's layered loader (:mod:`actors.runtime.config`).
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
from pathlib import Path
from typing import Annotated, ClassVar, Literal

import msgspec
from msgspec import Meta

from actors.node.gpu.thresholds import GPU_THRESHOLD_PATTERN, parse_gpu_thresholds
from actors.node.gpu.xid import XID_THRESHOLD_PATTERN
from actors.runtime.config import (
    DEFAULT_SERVER,
    NonNegativeDuration,
    Port,
    Positive,
    read_keys,
)
from actors.runtime.logs import LogFormat
from schemas.base import (
    MAX_DEPENDENCIES,
    MAX_ENGINES,
    MAX_ENROLL_TOKEN,
    MAX_PEERS,
    MAX_STALE_AFTER,
    MAX_URL,
    Cluster,
    Labels,
    NodeId,
)
from schemas.subjects import TOKEN_PATTERN, is_token

ENV_PREFIX = "NODE_AGENT_"

EngineSpec = Annotated[
    str, Meta(pattern=r"^(vllm|sglang|llamacpp)=https?://\S+$", max_length=MAX_URL)
]
PeerId = Annotated[str, Meta(pattern=TOKEN_PATTERN)]
XidThreshold = Annotated[str, Meta(pattern=XID_THRESHOLD_PATTERN)]
GpuThreshold = Annotated[str, Meta(pattern=GPU_THRESHOLD_PATTERN)]
WorkloadEngineName = Literal["llamacpp", "vllm", "sglang", "process"]
DEFAULT_WORKLOAD_ENGINES: list[WorkloadEngineName] = ["llamacpp", "vllm", "sglang"]
_ENGINES = "(llamacpp|vllm|sglang|process)"
WorkloadArg = Annotated[
    str, Meta(pattern=rf"^{_ENGINES}=--?[A-Za-z0-9][A-Za-z0-9_-]*$", max_length=128)
]
WorkloadEnv = Annotated[str, Meta(pattern=rf"^{_ENGINES}=[A-Za-z_][A-Za-z0-9_]*$", max_length=160)]


VERSION_PROGRAMS = ("nvidia-smi", "slurmd", "docker", "podman")
"""Programs whose version a sample reports unless version_programs says otherwise."""


def _is_loopback_ip(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


HTTP_PORT_FILE = "http.port"
"""The file in the state dir where the agent writes the port its HTTP API serves on
(``node-agent status`` reads it)."""


def default_state_dir() -> str:
    """``$XDG_STATE_HOME/node-agent`` (``~/.local/state/node-agent``)"""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return str(Path(base) / "node-agent")


def default_node_id() -> str:
    """the short hostname"""
    host = socket.gethostname().split(".")[0]
    cleaned = re.sub(r"[^A-Za-z0-9_-]", "-", host)[:64]
    return cleaned if is_token(cleaned) else "node"


class AgentConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Every setting of ``node-agent start``; each is a flag, an env var and a TOML key."""

    derived_defaults: ClassVar[dict[str, tuple[str, float]]] = {
        "stale_after": ("heartbeat_interval", 3.0)
    }
    """stale_after, unless set, is 3 x heartbeat_interval (read by the runtime's loader)."""

    server: str = DEFAULT_SERVER
    """NATS URL(s) to connect to, comma-separated (``NATS_URL`` also sets it); ``tls://``
    requires TLS."""
    node_id: NodeId = msgspec.field(default_factory=default_node_id)
    """This node's id in the fleet, ``[A-Za-z0-9_-]{1,64}``."""
    cluster: Cluster = "default"
    """The cluster this node belongs to, ``[A-Za-z0-9_-]{1,64}``."""
    state_dir: str = msgspec.field(default_factory=default_state_dir)
    """Where the agent keeps its sequence numbers, command state and key (node.nk)."""
    key_file: str = ""
    """Node nkey seed; empty means ``<state_dir>/node.nk``."""
    nkey_auth: bool = False
    """Authenticate to NATS with the node key (servers configured as in deploy/nats/auth.conf)."""
    prefix: str = "fleet"
    """Subject prefix of the fleet (``fleet.hb.*``, ``fleet.cmd.*``): one NATS can host several
    fleets."""
    js_api_prefix: str = "$JS.API"
    """Where the JetStream API is reached: ``JS.FLEET.API`` under deploy/nats/auth.conf,
    whose nodes live in an account without JetStream and import the fleet's API there.
    With any other than ``$JS.API`` the node does not create its command consumer (it
    may not): it waits for the aggregator to create it."""
    tls_ca: str = ""
    """PEM file of the CA that signed the NATS server's certificate; empty: the system's
    CAs. Setting any tls_* makes TLS mandatory: a server without TLS is refused."""
    tls_cert: str = ""
    """PEM client certificate presented to the server (mutual TLS); needs tls_key."""
    tls_key: str = ""
    """PEM private key of tls_cert."""
    connect_timeout: Positive = 5.0
    """Seconds each attempt to connect to NATS may take (one server's handshake 2 s at
    most: a frozen server is left for the next of the list)."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """Lowest level logged: debug, info, warning or error."""
    log_format: LogFormat = "auto"
    """Logs on stdout as ``json`` or ``text`` lines; ``auto``: text on a terminal, else JSON."""
    enroll_token: Annotated[str, Meta(max_length=MAX_ENROLL_TOKEN)] = ""
    """An operator's enrollment token (``fleetctl enroll-token create``): ``start`` and
    ``register`` present it, so an aggregator that trusts its issuer approves this node's
    key at once. A node already approved spends no use."""
    labels: Labels = {}
    """Placement labels, KEY=VALUE: ``--label`` (repeated, or comma-separated),
    NODE_AGENT_LABELS (comma-separated) or a TOML ``[labels]`` table; they win over the
    automatic ones."""

    heartbeat_interval: Positive = 10.0
    """Seconds between two heartbeats (each jittered by up to 10 %)."""
    stale_after: Positive = 30.0
    """Seconds without a heartbeat before JetStream (the heartbeat's Nats-TTL) marks the node
    stale."""
    sample_interval: Positive = 5.0
    """Seconds between two samples of the GPUs and the host."""
    health_interval: Positive = 5.0
    """Seconds between two health reports (jittered)."""
    settings_interval: Positive = 30.0
    """Seconds between two reads of the fleet's settings (KV fleet_settings: one batched
    direct get; docs/settings.md, "Fleet settings")."""

    fake_gpus: Annotated[int, Meta(ge=0, le=64)] | Literal["auto"] | None = None
    """N: simulate N GPUs (fleetctl up, demos, tests); 0: no GPUs; unset or "auto": NVML,
    never simulated: a failing NVML is reported unhealthy (actors.node.inventory.actor)."""
    expected_gpus: Annotated[int, Meta(ge=0)] | None = None
    """GPUs this node must have: fewer fail the boot and nvml checks; unset: whatever is
    found."""
    required_binaries: list[str] = []
    """Programs that must be on PATH, else the dependencies check fails."""
    required_modules: list[str] = []
    """Kernel modules that must be loaded (/proc/modules, /sys/module), else the dependencies
    check fails."""
    storage_path: str = ""
    """The file system the sample measures (capacity.storage_*, host.storage_*), e.g. where
    models and datasets live; empty: the state dir (or / when it does not exist)."""
    version_programs: Annotated[list[str], Meta(max_length=MAX_DEPENDENCIES)] = msgspec.field(
        default_factory=lambda: list(VERSION_PROGRAMS)
    )
    """Programs whose ``--version`` the sample reports (those present and answering)."""
    version_timeout: Positive = 5.0
    """Seconds each ``--version`` may take."""
    version_refresh: Positive = 3600.0
    """Seconds between two readings of the versions (they are cached in between)."""

    engines: Annotated[list[EngineSpec], Meta(max_length=MAX_ENGINES)] = []
    """Inference engines to probe, KIND=URL with KIND vllm, sglang or llamacpp."""
    engine_interval: Positive = 5.0
    """Seconds between two probes of the engines."""
    engine_timeout: Positive = 2.0
    """Seconds each engine probe may take before the engine counts as unhealthy."""

    peers: Annotated[list[PeerId], Meta(max_length=MAX_PEERS)] = []
    """Node ids whose round trip this node measures; none: up to max_peers live
    nodes of its cluster."""
    max_peers: Annotated[int, Meta(ge=0, le=MAX_PEERS)] = 8
    """Most peers probed when ``peers`` is not given (0: none)."""
    probe_interval: Positive = 10.0
    """Seconds between two rounds of latency probes."""
    probe_timeout: Positive = 1.0
    """Seconds a probe waits for its answer before it counts as lost."""

    http_host: str = "127.0.0.1"
    """Address the HTTP server (/metrics, /healthz, /status) listens on."""
    http_port: Port = 9091
    """Port of the HTTP server; 0 picks a free one (written to <state_dir>/http.port)."""
    http_max_connections: Annotated[int, Meta(ge=1)] = 256
    """Connections the HTTP server holds at once; more are answered 503 and closed."""
    http_request_timeout: Positive = 10.0
    """Seconds an HTTP connection has to send its request and be answered."""

    trust_operators: list[str] = []
    """Operator public keys (U...) whose signed commands and fault injections this node
    obeys."""
    trust_operators_file: str = ""
    """A file of trusted operator keys, one a line (# comments), read at each command."""
    max_command_lifetime: Positive = 86400.0
    """Longest a command may stay valid (expires_at - issued_at): a command id is remembered
    until its command expires, so this bounds the remembered ids, and a captured command
    can be replayed at most this long after it was issued."""
    max_skew: Positive = 300.0
    """How far ahead of this node's clock a command's issued_at may be (clock skew)."""
    hooks_timeout: Positive = 30.0
    """Seconds a hook (on_cordon, on_drain, ...) may run before it is killed."""
    on_cordon: str = ""
    """Shell command run when the node is cordoned (e.g. to tell a load balancer); empty:
    none."""
    on_drain: str = ""
    """Shell command run when a drain starts; empty: none."""
    on_drained: str = ""
    """Shell command run when a drain finished; empty: none."""
    on_uncordon: str = ""
    """Shell command run when the node is uncordoned; empty: none."""

    spot_provider: Literal["aws", "gcp", "azure", "auto", "none"] = "none"
    """Cloud whose spot/preemption notices are watched: aws, gcp, azure, auto (find out) or
    none."""
    metadata_url: str = ""
    """Base URL of the cloud's metadata service; empty: the provider's usual address."""
    spot_poll_interval: Positive = 1.0
    """Seconds between two looks at the metadata service for a notice."""
    spot_safety_margin: NonNegativeDuration = 15.0
    """Seconds before a termination notice's deadline by which the drain must be over."""

    scheduler: Literal["slurm", "none", "auto"] = "auto"
    """Workload manager to report and drain through: ``auto`` uses Slurm when ``scontrol``
    is on PATH and answers for this node (``SLURM_CONF`` is read from the environment)."""
    slurm_node_name: str = ""
    """This node's name in Slurm; empty: the short hostname."""
    scheduler_interval: Positive = 30.0
    """Seconds between looks at Slurm: each asks slurmctld three times (scontrol, squeue
    twice), so a large cluster's controller is spared a shorter period."""
    scheduler_timeout: Positive = 5.0
    """Seconds each Slurm tool (scontrol, squeue, sacct) has to answer before it is killed."""

    deregister_on_shutdown: bool = False
    """SIGTERM also deregisters the node from the fleet (it leaves, rather than going stale)."""
    shutdown_timeout: Positive = 30.0
    """Longest SIGTERM waits for in-flight work (the shutdown drain, or a drain or
    deregistration in progress) before the actors stop."""
    shutdown_drain: bool = True
    """SIGTERM drains: the fleet is told the node is draining and in-flight work gets up to
    shutdown_timeout to finish. Not saved: a restarted agent comes back as it was."""

    clear_after_samples: Annotated[int, Meta(ge=1)] = 3
    """Good samples in a row before a health condition clears (hysteresis)."""
    xid_thresholds: list[XidThreshold] = []
    """Per-code XID threshold overrides, CODE=COUNT/WINDOW_S: "13=5/600" makes XID 13 a
    finding at 5 occurrences on one GPU within 600 s (defaults in schemas/xid_catalog.py)."""
    xid_log_path: str = "/dev/kmsg"
    """Kernel log read for XIDs beside NVML's events (deduplicated; the only source for
    GPUs whose NVML events are unavailable); "" disables."""
    gpu_thresholds: list[GpuThreshold] = []
    """Overrides of the GPU health table, NAME=LIMIT or NAME=off: "pcie_replays_per_min=20"
    raises that limit, "persistence_off=off" drops that finding (table in
    actors/node/gpu/thresholds.py and docs/node.md)."""
    nvml_deadline: Positive = 10.0
    """Seconds one NVML call may take before the nvml check says it hung (and /healthz
    fails); the sample goes out meanwhile with the GPUs' last readings."""
    sysfs_root: str = "/sys"
    """Where sysfs is mounted: its PCI bus is searched for NVIDIA GPUs bound to vfio-pci
    (passthrough GPUs, given to VMs: counted, never health-checked nor given to
    workloads); "" does not search, nor does a node whose fake_gpus is set (simulated
    GPUs, or 0: none)."""
    fabric_manager_process: str = "nv-fabricmanager"
    """Process that must run where GPUs have an NVLink fabric state (NVSwitch systems);
    "" skips the check (a container that cannot see the host's processes)."""

    gateway: Literal["auto", "on", "off"] = "auto"
    """The local OpenAI-compatible gateway on 127.0.0.1:gateway_port: ``on`` listens from
    the start, ``off`` never, ``auto`` while the node runs a workload (and until the
    requests it holds are answered), or from the start with gateway_autostart."""
    gateway_port: Port = 8081
    """Port of the local OpenAI-compatible gateway on 127.0.0.1; 0 picks a free one."""
    gateway_max_in_flight: Annotated[int, Meta(ge=1)] = 4
    """Requests the gateway passes to one workload at once; more wait (up to the
    workload's ``max_pending``), and beyond that are answered 429."""
    gateway_queue_timeout: Positive = 60.0
    """Seconds a request may wait for a busy workload before it is answered 429."""
    gateway_connect_timeout: Positive = 2.0
    """Seconds to connect to a workload."""
    gateway_read_timeout: Positive = 600.0
    """Seconds a workload may stay silent: until its first byte, and between two chunks
    of a stream (a whole non-streamed generation must fit in it)."""
    gateway_request_timeout: Positive = 3600.0
    """Seconds a gateway connection may last, request, wait and answer: a longer stream
    is cut off."""
    gateway_header_timeout: Positive = 10.0
    """Seconds a gateway connection has to send its request line and headers; a client
    that trickles them is cut off then, not at ``gateway_request_timeout``."""
    gateway_max_request_bytes: Annotated[int, Meta(ge=1024)] = 4 * 1024 * 1024
    """Largest request body (a prompt) the gateway takes; larger ones get 413."""
    gateway_max_connections: Annotated[int, Meta(ge=1)] = 256
    """Connections the gateway holds at once; more are answered 503 and closed."""
    gateway_autostart: bool = False
    """Asked for a model no workload serves but model_dir holds, the gateway starts a
    server for it (docs/commands.md, "On-demand servers")."""
    model_dir: str = ""
    """The node's model directory: the files gateway_autostart may serve."""
    gateway_autostart_engine: WorkloadEngineName = "llamacpp"
    """The engine of the servers gateway_autostart starts (listed in workload_engines)."""
    gateway_servers_per_gpu: Annotated[int, Meta(ge=1)] = 1
    """Servers gateway_autostart runs on one GPU at most."""
    gateway_autostart_timeout: Positive = 600.0
    """Seconds such a server has to become ready (and a request to wait for it)."""
    gateway_host: str = "127.0.0.1"
    """Address the gateway listens on (``0.0.0.0`` for every interface). Beyond loopback
    it needs gateway_tls_cert/gateway_tls_key and a client check: gateway_keys_file,
    gateway_tls_client_ca, or both."""
    gateway_tls_cert: str = ""
    """PEM certificate the gateway serves TLS with (needs gateway_tls_key)."""
    gateway_tls_key: str = ""
    """PEM private key of gateway_tls_cert."""
    gateway_tls_client_ca: str = ""
    """PEM CA whose client certificates the gateway requires (mutual TLS)."""
    gateway_keys_file: str = ""
    """API keys the gateway requires (``Authorization: Bearer KEY``), one
    ``name:sha256$<hex>`` line each (``node-agent gateway-key NAME`` adds one); read again
    when it changes, so keys are rotated without a restart."""
    gateway_rate_limit: Annotated[float, Meta(ge=0)] = 20.0
    """Requests a second one client (API key or certificate) may send; 0: no limit."""
    gateway_rate_burst: Annotated[int, Meta(ge=1)] = 40
    """Requests one client may send at once before gateway_rate_limit paces it."""
    gateway_advertise_url: Annotated[
        str, Meta(pattern=r"^(https?://\S+)?$", max_length=MAX_URL)
    ] = ""
    """The gateway's URL as the heartbeat advertises it to dispatchers; default
    ``https://<gateway_host or this host's name>:<port>`` with TLS, none without (for
    0.0.0.0 the host name as ``hostname`` says: set this where dispatchers need a DNS name)."""
    workload_engines: list[WorkloadEngineName] = msgspec.field(
        default_factory=lambda: list(DEFAULT_WORKLOAD_ENGINES)
    )
    """Engines ``fleetctl deploy`` may start here; ``process`` (any argv) is off unless listed."""
    workload_binaries: list[str] = []
    """Executables a ``process`` workload may run (a path, or a name found on PATH), and
    ``ENGINE=PATH`` overrides of an engine's binary (``llamacpp=/opt/llama/llama-server``)."""
    workload_args: list[WorkloadArg] = []
    """Engine flags a deploy may add besides the built-in allow-list
    (actors/node/workloads/launch.py, docs/commands.md), ``ENGINE=FLAG`` by whole name:
    ``vllm=--enable-lora``. ``--host`` and ``--port`` are never allowed."""
    workload_env: list[WorkloadEnv] = []
    """Environment variables a deploy may set besides the built-in allow-list,
    ``ENGINE=NAME``: ``vllm=VLLM_USE_DEEP_GEMM``."""
    workload_images: list[str] = []
    """Container images a deploy may run (``--image``): ``registry/repo`` allows any tag
    or digest of it, ``registry/repo:tag`` that tag only; empty: no containers."""
    workload_podman: str = "podman"
    """The podman executable container workloads run through."""
    workload_image_pull: Literal["missing", "never", "always"] = "missing"
    """Pull a deploy's image when it is not on the node, never, or at every start."""
    workload_pull_timeout: Positive = 1800.0
    """Seconds an image pull may take."""
    workload_switch_grace: Positive = 120.0
    """Seconds a workload switched out for another model's deploy has to answer the
    requests the gateway holds of it (it takes no new ones) before it is stopped."""
    workload_ready_interval: Positive = 0.25
    """Seconds between two readiness probes of a starting workload (its ``/health`` and
    ``/v1/models``, until it serves its model or its ready_timeout passes)."""
    workload_stop_grace: Positive = 10.0
    """Seconds between SIGTERM and SIGKILL of a stopping workload's process group."""
    workload_crash_limit: Annotated[int, Meta(ge=1)] = 5
    """Crashes within workload_crash_window after which a workload is left in ``crashloop``."""
    workload_crash_window: Positive = 300.0
    """A workload that crashes workload_crash_limit times within this many seconds is left
    in ``crashloop`` instead of being restarted again."""
    workload_backoff_max: Positive = 30.0
    """Longest wait before restarting a crashed workload (doubling from 1 s)."""
    workload_log_bytes: Annotated[int, Meta(ge=4096)] = 10 * 1024 * 1024
    """A workload's log file is rotated (one old copy kept) past this size."""

    def __post_init__(self) -> None:
        if self.stale_after <= self.heartbeat_interval:
            raise ValueError(
                f"stale_after ({self.stale_after:g}s) must be longer than "
                f"heartbeat_interval ({self.heartbeat_interval:g}s)"
            )
        if self.stale_after < 1:
            raise ValueError("stale_after must be at least 1 second (Nats-TTL granularity)")
        if self.stale_after > MAX_STALE_AFTER:
            raise ValueError(f"stale_after must be at most {MAX_STALE_AFTER:g} seconds (a day)")
        # Names are checked against the table here, at load, so a typo fails the start
        # and not the health actor.
        parse_gpu_thresholds(self.gpu_thresholds)
        self._check_gateway()

    def _check_gateway(self) -> None:
        """A gateway beyond loopback serves TLS and checks its clients."""
        if bool(self.gateway_tls_cert) != bool(self.gateway_tls_key):
            raise ValueError("gateway_tls_cert and gateway_tls_key go together")
        if self.gateway_tls_client_ca and not self.gateway_tls_cert:
            raise ValueError("gateway_tls_client_ca needs gateway_tls_cert (mutual TLS)")
        host = self.gateway_host
        loopback = host == "localhost" or _is_loopback_ip(host)
        if loopback:
            return
        if not self.gateway_tls_cert:
            raise ValueError(
                f"gateway_host {host} is beyond loopback: set gateway_tls_cert and "
                "gateway_tls_key (the gateway serves TLS there)"
            )
        if not (self.gateway_keys_file or self.gateway_tls_client_ca):
            raise ValueError(
                f"gateway_host {host} is beyond loopback: set gateway_keys_file or "
                "gateway_tls_client_ca (the gateway checks its clients there)"
            )

    @property
    def slurm_node(self) -> str:
        """The node's name in Slurm."""
        return self.slurm_node_name or socket.gethostname().split(".")[0]

    @property
    def key_path(self) -> Path:
        return Path(self.key_file) if self.key_file else Path(self.state_dir) / "node.nk"

    def operator_keys(self) -> set[str]:
        """The trusted operator keys: ``trust_operators`` plus the trust file, read at each
        call so an operator key can be added or removed without a restart."""
        return read_keys(self.trust_operators, self.trust_operators_file)
