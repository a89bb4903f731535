"""The aggregator's settings: every one a flag of ``fleetctl aggregator``, a
``FLEET_AGGREGATOR_*`` environment variable and a TOML key, merged and validated by the
runtime's layered loader (:mod:`actors.runtime.config`), exactly as the agent's are.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from actors.runtime.config import (
    DEFAULT_SERVER,
    DURATION,
    NonNegativeDuration,
    Positive,
    read_keys,
)
from actors.runtime.logs import LogFormat
from schemas.base import MAX_STALE_AFTER

ENV_PREFIX = "FLEET_AGGREGATOR_"
MIB = 1024 * 1024


class AggregatorConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Every setting of ``fleetctl aggregator``; each is a flag, an env var and a TOML key."""

    def operator_keys(self) -> set[str]:
        """The operator keys trusted to issue enrollment tokens, the file read now."""
        return read_keys(self.trust_operators, self.trust_operators_file)

    server: str = DEFAULT_SERVER
    """NATS URL(s) to connect to, comma-separated (``FLEETCTL_SERVER`` or ``NATS_URL`` also set
    it); ``tls://`` requires TLS."""
    nkey_file: str = ""
    """Authenticate to NATS with this nkey seed (servers configured like deploy/nats/auth.conf)."""
    tls_ca: str = ""
    """PEM file of the CA that signed the NATS server's certificate; empty: the system's
    CAs. Setting any tls_* makes TLS mandatory: a server without TLS is refused."""
    tls_cert: str = ""
    """PEM client certificate presented to the server (mutual TLS); needs tls_key."""
    tls_key: str = ""
    """PEM private key of tls_cert."""
    prefix: str = "fleet"
    """Subject prefix of the fleet (``fleet.hb.*``, ``fleet.cmd.*``): one NATS can host several
    fleets."""
    connect_timeout: Positive = 5.0
    """Seconds each attempt to connect to NATS may take (one server's handshake 2 s at
    most: a frozen server is left for the next of the list)."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """Lowest level logged: debug, info, warning or error."""
    log_format: LogFormat = "auto"
    """Logs on stdout as ``json`` or ``text`` lines; ``auto``: text on a terminal, else JSON."""

    durable: str = "aggregator"
    """The heartbeat consumers' base name: partition P is consumed through ``<durable>-<P>``."""
    replicas: Annotated[int, Meta(ge=1, le=5)] = 1
    """Stream and bucket replicas: 3 in a 3-node cluster."""
    max_skew: Positive = 300.0
    """A heartbeat whose timestamp is further than this from the aggregator's clock is refused."""
    offline_after: Positive = 300.0
    """Seconds a node stays ``stale`` before its record becomes ``offline``."""
    sweep_interval: Positive = 5.0
    """Seconds between two sweeps of this aggregator's own records (stale to offline, refused
    nodes)."""
    full_sweep_interval: Positive = 120.0
    """How often every record is read to find stale nodes another aggregator saw go stale."""
    retire_offline_after: NonNegativeDuration = 0.0
    """Forget a node offline longer than this, as ``fleetctl forget`` does (record
    deregistered by ``retirement``, key revoked, queued commands purged, a ``forgotten``
    alert); 0: never. Counted only while this aggregator watched the node's partition
    and the fleet beat (docs/failure-detection.md, "Automatic retirement")."""
    retire_hold_fraction: Annotated[float, Meta(gt=0, le=1)] = 0.5
    """Retirement holds, and its count starts again, while more than this share of the
    nodes this aggregator owns (of them all, or of one cluster of two or more) are stale
    or offline: a silence that wide is the fleet's (a bus outage, a cut link), not the
    nodes'."""
    max_stale_after: Positive = 600.0
    """The longest silence this aggregator believes a node's claimed ``stale_after`` (or a
    ``Nats-TTL: never``) allows: the full sweep marks a node stale once it sent nothing for
    twice the lesser of the two plus ``full_sweep_interval``. Keep it above every agent's
    ``stale_after``."""

    bus_outage_max: Annotated[float, Meta(ge=1, le=MAX_STALE_AFTER, extra=DURATION)] = 120.0
    """The longest silence of the whole heartbeat stream (a server restarted, the stream
    without a leader) told as one ``bus_outage`` alert and no alert per node: 4 x the
    agents' default ``stale_after``. A longer one is still one ``bus_outage`` (saying so),
    but each node's ``stale``, ``recovered`` and gap alerts are raised as for a node's own
    silence. 1 s to a day."""

    max_seq_jump: Annotated[int, Meta(ge=1)] = 10_000
    """A heartbeat whose seq is more than this above the node's last accepted one is
    refused (an alert ``sequence_gap`` with ``refused``). An agent skips at most one
    reserved block (1,000) per restart, so this allows ten crashes in a row, or ~28 h of
    10 s beats no aggregator saw; beyond it ``fleetctl reset-seq NODE`` lets the node in."""
    checkpoint_interval: Annotated[float, Meta(gt=0, le=240)] = 60.0
    """A node that only keeps beating has its record written to fleet_nodes this often
    (each node on its own schedule, spread); state changes are written at once. At most
    240 s: below FLEET_HB's 300 s duplicate window (docs/failure-detection.md, "Hot path
    and checkpoints")."""
    fetch_batch: Annotated[int, Meta(ge=1, le=4096)] = 256
    """Heartbeats fetched (and acked with one AckAll) at a time, per partition. Caught up,
    a fetch holds what came in ``fetch_linger`` (about 200 per partition at 100,000 nodes
    and 30 s); this bounds what is in flight when behind, as 100,000 nodes' first
    contacts put it: in the 100,000-node bench run, 512 ended at 303 MB of aggregator
    RSS with first contacts' p99 at 22 s, 256 at 285 MB and 16 s."""
    max_lag: Annotated[float, Meta(gt=0)] = 60.0
    """``/healthz`` answers 503 while the owner's oldest unprocessed heartbeat is older
    than this (seconds): an aggregator that falls behind says so."""
    lease_ttl: Annotated[float, Meta(ge=0.5, le=60)] = 6.0
    """Seconds an aggregator's heartbeat lease lasts unrenewed: another takes over after
    this long once the owner is gone (it renews every third of it)."""
    partitions: Annotated[int, Meta(ge=1, le=256)] = 8
    """FLEET_HB is split into this many partitions, each consumed by one aggregator at a
    time; used only when the stream is created (an existing stream keeps its N:
    docs/failure-detection.md, "How partitions work")."""
    fetch_linger: Annotated[float, Meta(ge=0, le=1)] = 0.5
    """Seconds to wait after a fetch that came back short (caught up) before the next,
    so fetches and acks are paid per batch, not per heartbeat; adds at most this much
    to a heartbeat's publish-to-record latency (and to a stale alert's, while caught
    up: a consumer that is behind fetches again at once). A fetch's round trip costs
    the aggregator's process far more than its few lines of Python (the server's answer
    wakes it, and it comes back to caches others used): 0.25 s cost 1.056-1.065 times
    the CPU per heartbeat of 0.5 s, two aggregators side by side under one load
    (``tests/bench/bench_aggregator.py --side``; docs/failure-detection.md, "Hot path and
    checkpoints")."""
    max_deliver: Annotated[int, Meta(ge=1)] = 5
    """Deliveries of one FLEET_HB message before the server gives up on it."""
    max_pending: Annotated[int, Meta(ge=0)] = 1000
    """Registrations of new names are refused while this many nodes wait for approval."""
    max_pending_per_key: Annotated[int, Meta(ge=1)] = 4
    """Pending names one public key, and one NATS login where the server names it, may
    have registered (a node registers one name; a few more allow for renaming): one key
    or login cannot take the room of ``max_pending``."""
    pending_expire_after: Positive = 86_400.0
    """A pending record nobody approved is deleted by the full sweep after this long."""
    registrations_per_minute: Annotated[int, Meta(ge=1)] = 120
    """Registrations one aggregator answers per minute, all keys together."""
    registrations_per_key_per_minute: Annotated[int, Meta(ge=1)] = 6
    """Registrations one aggregator answers per minute for one public key, and for one
    NATS login where the server names it (``Nats-Request-Info``)."""

    dashboard: bool = True
    """Serve the fleet dashboard, a live web page, at ``/`` on the HTTP port."""
    dashboard_history_interval: Annotated[float, Meta(ge=1, le=600)] = 60.0
    """Seconds between two points of the dashboard's charts (each node this aggregator
    holds gets one point per interval)."""
    dashboard_history_points: Annotated[int, Meta(ge=2, le=1440)] = 60
    """Points each node's charts keep (with the interval: how far back they go)."""
    dashboard_streams_per_client: Annotated[int, Meta(ge=1, le=64)] = 4
    """Live-update streams (open pages) one login session holds at once; more are answered
    429. All together hold at most 64 (on a read-only loopback port without logins, where
    no viewer can be told from another, only that bounds them)."""
    dashboard_stream_lifetime: Annotated[float, Meta(ge=1, le=3600)] = 300.0
    """Seconds a page's live-update stream stays open; then the server closes it and the
    page opens another (its login checked again, its slot contended for again), so a
    page left open or a client gone away holds its slot no longer than this."""
    allow_ui_commands: bool = False
    """Let the dashboard send cordon, drain and uncordon, signed with ``ui_key_file``,
    after a confirmation in the browser. Off: the page is read-only. On: every request to
    the HTTP port, from loopback too, needs a login: a one-time link (``fleetctl
    dashboard``) or a user of http_users_file."""
    ui_key_file: str = ""
    """The operator key (nkey seed file) that signs the dashboard's commands, and the
    one-time login links ``fleetctl dashboard`` prints."""
    ui_session_lifetime: Annotated[float, Meta(ge=60, le=7 * 86_400)] = 43_200.0
    """Seconds a dashboard login (its session cookie) lasts at most, however used."""
    ui_session_idle: Annotated[float, Meta(ge=60, le=7 * 86_400)] = 3600.0
    """Seconds a dashboard login lasts without a request (an open page's stream, opened
    again every dashboard_stream_lifetime, counts)."""
    http_tls_cert: str = ""
    """PEM certificate the HTTP port serves TLS with (needs http_tls_key); required,
    with http_users_file, when http_host is not a loopback address."""
    http_tls_key: str = ""
    """PEM private key of http_tls_cert."""
    http_users_file: str = ""
    """Users who may open the HTTP port, one ``name:pbkdf2_sha256$...`` line each
    (``fleetctl ui-user NAME`` writes one); read again when it changes."""
    http_login_attempts: Annotated[int, Meta(ge=1, le=1000)] = 10
    """Failed logins (http_users_file) allowed per minute from one client address (an
    IPv6 /64) and for one user name; beyond, tries are answered 429 with Retry-After."""
    http_host: str = "127.0.0.1"
    """Address the HTTP server (``/nodes``, ``/metrics``, ``/healthz``) listens on."""
    http_public_names: list[str] = []
    """Host names (or addresses) clients reach the HTTP port by, beyond http_host, the
    address a connection arrives on and ``localhost``: a request whose ``Host`` is none
    of these is refused (421), which stops DNS rebinding. Names only, no scheme or port:
    ``fleet.example.com``."""
    http_port: Annotated[int, Meta(ge=-1, le=65535)] = 9092
    """``/nodes``, ``/nodes/<id>`` and ``/metrics``; 0 picks a free port, -1 serves nothing."""

    # Storage budgets: every stream and bucket has a byte budget the server reserves, so a
    # flood on one can never take the store that failure detection (FLEET_HB) needs.
    # Sizing rule (docs/wire-contract.md, "Storage budgets"): the sum of these seven, the
    # heartbeats' twice (FLEET_HB_IN and FLEET_HB: 556 MiB by default), times the prefixes
    # a server hosts, stays below the server's
    # jetstream max_file_store, and every other stream on that server has a max_bytes too.
    heartbeats_max_bytes: Annotated[int, Meta(ge=MIB)] = 128 * MIB
    """FLEET_HB: one heartbeat per node, typically 2-20 KB; 128 MiB holds over 6,000 nodes."""
    records_max_bytes: Annotated[int, Meta(ge=MIB)] = 128 * MIB
    """KV fleet_nodes: one record per node, the heartbeat embedded."""
    commands_max_bytes: Annotated[int, Meta(ge=MIB)] = 32 * MIB
    """FLEET_CMD: the signed commands waiting for their nodes."""
    results_max_bytes: Annotated[int, Meta(ge=MIB)] = 64 * MIB
    """FLEET_EVENTS: the nodes' command results, results_per_node kept per node."""
    alerts_max_bytes: Annotated[int, Meta(ge=MIB)] = 64 * MIB
    """FLEET_ALERTS: the aggregators' alerts, alerts_per_subject kept per kind and node."""
    trust_max_bytes: Annotated[int, Meta(ge=MIB)] = 8 * MIB
    """KV fleet_trust: each node's approved public key."""
    enroll_max_bytes: Annotated[int, Meta(ge=MIB)] = 4 * MIB
    """KV fleet_enroll: one record of about 3 KB per enrollment token, kept 31 days."""
    results_per_node: Annotated[int, Meta(ge=1)] = 1000
    """Command results kept per node: a node flooding its result subject evicts only its
    own oldest results."""
    alerts_per_subject: Annotated[int, Meta(ge=1)] = 1000
    """Alerts kept per kind and node, so one node's alerts never evict another's."""
    trust_operators: list[str] = []
    """Operator public keys whose enrollment tokens this aggregator honours; with none
    (the default) every key is approved by hand."""
    trust_operators_file: str = ""
    """A file of such keys, one a line (# comments), read at each registration."""
    alert_window: Positive = 60.0
    """At most one alert per node and refusal kind in this many seconds; the rest are
    counted and reported in one summary alert when the window closes."""
    alert_repeat: Positive = 300.0
    """Refusals of a node's heartbeats (replay, bad_signature, unknown_node, clock_skew,
    a refused sequence_gap): the first is raised at once, then while they go on one
    summary alert with their count at most once per this many seconds."""
    alertmanager_urls: list[str] = []
    """Alertmanager base URLs (``http://am:9093``) to send every fleet alert to, through
    ``POST /api/v2/alerts``: every instance of an Alertmanager cluster, as Prometheus is
    configured. Empty (the default): nothing is forwarded."""
    alertmanager_ca: str = ""
    """PEM file of the CA that signed Alertmanager's certificate (https URLs); empty: the
    system's CAs."""
    alertmanager_cert: str = ""
    """PEM client certificate presented to Alertmanager (mutual TLS); needs alertmanager_key."""
    alertmanager_key: str = ""
    """PEM private key of alertmanager_cert."""
    alertmanager_username: str = ""
    """HTTP basic auth user for Alertmanager (with alertmanager_password_file)."""
    alertmanager_password_file: str = ""
    """A file whose first line is the basic auth password."""
    alertmanager_timeout: Positive = 5.0
    """Seconds one POST to Alertmanager may take."""
    alertmanager_resend: Annotated[float, Meta(ge=1, le=3600)] = 60.0
    """A firing condition (stale, offline, unhealthy, degraded) is sent again this often,
    its ``endsAt`` four resends ahead."""
    alertmanager_queue: Annotated[int, Meta(ge=1)] = 10_000
    """Alerts waiting for one Alertmanager at most; beyond it the oldest is dropped
    (``fleet_alertmanager_dropped_total{reason="queue_full"}``)."""
    alertmanager_event_hold: Positive = 3600.0
    """An event alert (a sequence gap, a bad signature, an interruption ...) is sent with
    ``endsAt`` this many seconds after it was raised."""
    alertmanager_durable: str = "alertmanager"
    """The durable consumer of FLEET_ALERTS the aggregators share to forward events."""
    refused_note_every: Positive = 30.0
    """A refused node's record notes the refusal kind (for the node to read) at most once
    per this many seconds, and at once when the kind changes."""
    policy_file: str = ""
    """The remediation policy (TOML, docs/remediation.md) this aggregator runs; empty:
    none. Every aggregator may run it: they share its breaker through KV."""
    workloads_key_file: str = ""
    """The operator key (nkey seed file) this aggregator's workload reconciler signs its
    deploys and stops with (nodes must trust its public key); empty: it does not keep
    placed workloads (``fleetctl deploy`` without a node) running. Every aggregator may
    run it: they share each workload's record by compare-and-set."""
    workloads_operators: list[str] = []
    """Operator public keys whose placed workloads (signed by ``fleetctl deploy``) the
    reconciler keeps running, besides its own key's; a workload signed by another key is
    left alone (logged): writing ``fleet_workloads`` is not enough to have it deploy."""
    workloads_interval: Positive = 5.0
    """Seconds between two reconciler rounds."""
    workloads_grace: Positive = 60.0
    """Seconds a node may be stale, offline, stopped or deregistered (and a deploy
    unreported by its node) before its replica is placed elsewhere."""
    workloads_handoff: Positive = 120.0
    """Seconds a draining node's copy of a replica waits for its replacement to be ready
    before it is stopped anyway."""
