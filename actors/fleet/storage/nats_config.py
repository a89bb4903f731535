"""The nats-server authorization blocks of a fleet, generated (``fleetctl nats-config``).

Hand-written permission lists drift from the subjects the code uses and get one node's
entry wrong in a hundred; this renders them from :class:`schemas.subjects.Subjects` for
every approved node. The layout is deploy/nats/auth.conf's (read its comments for why):
nodes live in the account NODES, each allowed only its own subjects, and reach the
provider's account FLEET (streams, buckets, aggregators, operators) only through service
imports, so no reply subject a node names can land in FLEET. Monitors live in MONITORS,
reaching FLEET the same way for direct gets and stream info of the node records only.
Nodes publish to no inbox but the answers to probes addressed to them, and create no
consumer: the aggregator creates each node's command consumer (command_queues.py). The
output is one ``accounts { ... }`` block that a server config includes
(``include fleet-auth.conf``).

A node's identity is its nkey (``identity="nkey"``, the default) or its TLS client
certificate (``identity="cert"``: the server's ``tls { verify_and_map: true }`` maps the
certificate's email SAN ``<node>@nodes`` to the node's user). Aggregators, operators
and monitors always log in with nkeys.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from actors.fleet.storage import registry
from actors.runtime.bus import Bus
from schemas.errors import FleetError
from schemas.subjects import (
    BUCKET_INDEX,
    BUCKET_MAINTENANCE,
    BUCKET_NODES,
    BUCKET_POLICY,
    BUCKET_SETTINGS,
    BUCKET_TRUST,
    PROBE_INBOX,
    STREAM_COMMANDS,
    STREAM_HEARTBEATS,
    Subjects,
    check_token,
    command_consumer,
)

Identity = Literal["nkey", "cert"]
JS_API_PREFIX = "JS.FLEET.API"
"""Where nodes reach FLEET's JetStream API (the agent's ``js_api_prefix``)."""
CERT_DOMAIN = "nodes"
"""A node's certificate carries the email SAN ``<node>@nodes`` under ``identity="cert"``."""


@dataclass(frozen=True)
class NodeUser:
    """One approved node: its id, its cluster (both in its subjects) and its public key."""

    node: str
    cluster: str
    public_key: str

    def __post_init__(self) -> None:
        check_token("node id", self.node)
        check_token("cluster", self.cluster)
        registry.check_public_key(self.public_key)


@dataclass(frozen=True)
class Users:
    """Everyone the generated config lets in. Aggregators and operators are unrestricted
    in FLEET (they provision, approve and send signed commands); monitors may only read
    the node records (direct gets, stream info), alerts and events."""

    nodes: list[NodeUser]
    aggregators: list[str] = field(default_factory=list)
    operators: list[str] = field(default_factory=list)
    monitors: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        for key in [*self.aggregators, *self.operators, *self.monitors]:
            registry.check_public_key(key)
        twice = sorted(
            name for name, count in Counter(user.node for user in self.nodes).items() if count > 1
        )
        if twice:
            raise FleetError(f"nodes listed twice: {', '.join(twice)}")
        # An underscore in an id can make two nodes' consumer names one (cluster a_b's
        # node c and cluster a's node b_c: cmd_a_b_c): each would be allowed the other's
        # consumer, and one's commands would go to the other, which refuses them.
        consumers: dict[str, NodeUser] = {}
        for user in self.nodes:
            name = command_consumer(user.cluster, user.node)
            other = consumers.setdefault(name, user)
            if other is not user:
                raise FleetError(
                    f"{other.node} (cluster {other.cluster}) and {user.node} (cluster "
                    f"{user.cluster}) would share the command consumer {name}: rename one "
                    "of them, or its cluster"
                )


def cert_user(node: str) -> str:
    """The user name ``verify_and_map`` finds in node ``node``'s client certificate."""
    return f"{check_token('node id', node)}@{CERT_DOMAIN}"


def parse_nodes(text: str) -> list[NodeUser]:
    """``node cluster public_key`` lines (``#`` comments and blank lines skipped)."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        if len(words) != 3:
            raise FleetError(f"line {number}: want 'node cluster public_key', got {line!r}")
        found.append(NodeUser(*words))
    return found


async def approved_nodes(
    bus: Bus, subjects: Subjects, clusters: Mapping[str, str], default_cluster: str = ""
) -> list[NodeUser]:
    """Every node with an approved, unrevoked key in ``fleet_trust``. The cluster (part of
    its subjects) is its record's in ``fleet_nodes`` (``clusters``, by node); a node
    approved before it ever registered has none, and gets ``default_cluster`` or is an
    error."""
    found = []
    for entry in await registry.read_trust(bus, subjects):
        key = registry.approved_key(entry)
        if key is None:
            continue
        cluster = clusters.get(entry.node_id, default_cluster)
        if not cluster:
            raise FleetError(
                f"{entry.node_id} has no record yet, so its cluster is unknown: "
                "pass --cluster or list it with --nodes"
            )
        found.append(NodeUser(entry.node_id, cluster, key))
    return found


def render(subjects: Subjects, users: Users, identity: Identity = "nkey") -> str:
    """The ``accounts`` block for ``users``, as text a nats-server config includes."""
    lines = [
        "# Generated by `fleetctl nats-config`; regenerate rather than edit. Layout and",
        "# reasons: deploy/nats/auth.conf. Include it from a server config.",
        "accounts {",
        "  FLEET {",
        "    jetstream: enabled",
        "    users: [",
    ]
    lines += _keyed("aggregator", users.aggregators)
    lines += _keyed("operator", users.operators)
    lines += ["    ]", "    exports: ["]
    exports = _exports(subjects)
    exports += [e for e in _monitor_exports(subjects) if e not in exports]
    lines += [f"      {_block(export)}" for export in exports]
    lines += [
        "    ]",
        "    imports: [",
        f"      {{ stream: {{ account: NODES, subject: {_q(_all_events(subjects))} }} }}",
        "    ]",
        "  }",
        "  MONITORS {",
        "    imports: [",
    ]
    lines += [f"      {imported}" for imported in _imports(subjects, _monitor_exports(subjects))]
    lines += [
        f"      {{ stream: {{ account: NODES, subject: {_q(_all_events(subjects))} }} }}",
        "    ]",
        "    users: [",
    ]
    lines += _keyed("monitor (read-only)", users.monitors, _monitor_permissions(subjects))
    lines += [
        "    ]",
        "  }",
        "  NODES {",
        "    exports: [",
        f"      {{ stream: {_q(_all_events(subjects))} }}",
        "    ]",
        "    imports: [",
    ]
    lines += [f"      {imported}" for imported in _imports(subjects, _exports(subjects))]
    lines += ["    ]", "    users: ["]
    for user in users.nodes:
        login = (
            f"nkey: {user.public_key}"
            if identity == "nkey"
            else f"user: {_q(cert_user(user.node))}"
        )
        lines += [f"      # {user.node} ({user.cluster})", f"      {{ {login}"]
        lines += [f"        {line}" for line in _permissions(_node_permissions(subjects, user))]
        lines += ["      }"]
    lines += ["    ]", "  }", "}", ""]
    return "\n".join(lines)


Permissions = dict[str, list[str]]
"""``publish`` and ``subscribe`` allow lists."""


def _node_permissions(subjects: Subjects, user: NodeUser) -> Permissions:
    """deploy/nats/auth.conf's node-1 entry for ``user``: its own heartbeats, events,
    results, probes and command consumer (looked up, pulled, acknowledged: never created),
    reads of the fleet's settings (never a write), answers to probes addressed to it and
    no other inbox, its own inboxes to read."""
    node, cluster = user.node, user.cluster
    commands = subjects.stream_name(STREAM_COMMANDS)
    consumer = command_consumer(cluster, node)
    nodes_bucket = f"KV_{subjects.bucket_name(BUCKET_NODES)}"
    settings_bucket = f"KV_{subjects.bucket_name(BUCKET_SETTINGS)}"
    return {
        "publish": [
            subjects.heartbeat(cluster, node),
            subjects.events(node),
            subjects.result(cluster, node),
            subjects.register(),
            f"{subjects.prefix}.probe.*",
            probe_answers(node),
            f"{JS_API_PREFIX}.DIRECT.GET.{nodes_bucket}",
            f"{JS_API_PREFIX}.DIRECT.GET.{settings_bucket}",
            f"{JS_API_PREFIX}.CONSUMER.INFO.{commands}.{consumer}",
            f"{JS_API_PREFIX}.CONSUMER.MSG.NEXT.{commands}.{consumer}",
            f"$JS.ACK.{commands}.{consumer}.>",
        ],
        "subscribe": [
            f"_INBOX.{node}.>",
            subjects.events(node),
            subjects.heartbeat(cluster, node),
            subjects.probe(node),
        ],
    }


def probe_answers(node: str) -> str:
    """Where ``node`` may answer probes: ``_INBOX.<asker>.probe.<node>.<token>`` (see
    :func:`schemas.subjects.probe_reply`), never another inbox."""
    return f"{PROBE_INBOX}.*.probe.{node}.*"


def _monitor_permissions(subjects: Subjects) -> Permissions:
    """Reads only, in MONITORS: the node records (stream info, direct gets through FLEET's
    exports), alerts and events; its own account's inboxes, where nothing but monitors'
    answers arrive. No consumer, no write, and no reply it names can land in FLEET."""
    return {
        "publish": [
            _renamed(export["service"])
            for export in _monitor_exports(subjects)
            if "service" in export
        ],
        "subscribe": ["_INBOX.>", subjects.alerts(), _all_events(subjects)],
    }


def _monitor_exports(subjects: Subjects) -> list[dict[str, str]]:
    """What FLEET lends monitors: stream info and direct gets (one key, or the batched
    scan) of the node records, and what the live views read besides (docs/live-reads.md):
    the latest heartbeats in FLEET_HB, the approved keys they are checked against, the
    partitions' consumer info (what was judged); maintenance windows; the remediation
    policy's holds (``describe`` says whether the policy holds a node); the fleet's settings
    (``fleetctl describe`` shows each node's); and alerts."""
    reads = [
        f"KV_{subjects.bucket_name(BUCKET_NODES)}",
        subjects.stream_name(STREAM_HEARTBEATS),
        f"KV_{subjects.bucket_name(BUCKET_TRUST)}",
        f"KV_{subjects.bucket_name(BUCKET_MAINTENANCE)}",
        f"KV_{subjects.bucket_name(BUCKET_POLICY)}",
        f"KV_{subjects.bucket_name(BUCKET_SETTINGS)}",
        f"KV_{subjects.bucket_name(BUCKET_INDEX)}",
    ]
    exports: list[dict[str, str]] = []
    for stream in reads:
        exports += [
            {"service": f"$JS.API.STREAM.INFO.{stream}"},
            {"service": f"$JS.API.DIRECT.GET.{stream}", "response": "stream"},
            {"service": f"$JS.API.DIRECT.GET.{stream}.>"},
        ]
    heartbeats = subjects.stream_name(STREAM_HEARTBEATS)
    exports += [{"service": f"$JS.API.CONSUMER.INFO.{heartbeats}.*"}, {"stream": subjects.alerts()}]
    return exports


def _all_events(subjects: Subjects) -> str:
    return f"{subjects.prefix}.evt.>"


def _exports(subjects: Subjects) -> list[dict[str, str]]:
    commands = subjects.stream_name(STREAM_COMMANDS)
    nodes_bucket = f"KV_{subjects.bucket_name(BUCKET_NODES)}"
    settings_bucket = f"KV_{subjects.bucket_name(BUCKET_SETTINGS)}"
    return [
        {"service": f"{subjects.prefix}.hb.*.*"},
        {"service": f"{subjects.prefix}.result.*.*"},
        {"service": subjects.register()},
        {"service": f"$JS.API.DIRECT.GET.{nodes_bucket}", "response": "stream"},
        {"service": f"$JS.API.DIRECT.GET.{settings_bucket}", "response": "stream"},
        {"service": f"$JS.API.CONSUMER.INFO.{commands}.*"},
        {"service": f"$JS.API.CONSUMER.MSG.NEXT.{commands}.*", "response": "stream"},
        {"service": f"$JS.ACK.{commands}.>"},
    ]


def _imports(subjects: Subjects, exports: list[dict[str, str]]) -> Iterable[str]:
    """FLEET's ``exports`` imported into another account; JetStream API ones under
    JS_API_PREFIX."""
    for export in exports:
        if "stream" in export:
            yield f"{{ stream: {{ account: FLEET, subject: {_q(export['stream'])} }} }}"
            continue
        subject = export["service"]
        service = f"{{ account: FLEET, subject: {_q(subject)} }}"
        if subject != _renamed(subject):
            yield f"{{ service: {service}, to: {_q(_renamed(subject))} }}"
        elif subject == subjects.register():
            # The server names the sender's login in Nats-Request-Info (replacing any a
            # client sent): aggregators limit registrations per login, not only per key.
            yield f"{{ service: {service}, share: true }}"
        else:
            yield f"{{ service: {service} }}"


def _renamed(subject: str) -> str:
    """Where an importing account reaches FLEET's ``subject``: JetStream's API under
    JS_API_PREFIX (its own ``$JS.API`` answers "not enabled"), anything else as it is."""
    if subject.startswith("$JS.API."):
        return JS_API_PREFIX + subject.removeprefix("$JS.API")
    return subject


def _keyed(role: str, keys: list[str], permissions: Permissions | None = None) -> list[str]:
    lines = []
    for key in keys:
        if permissions is None:
            lines.append(f"      {{ nkey: {key} }}  # {role}")
            continue
        lines += [f"      # {role}", f"      {{ nkey: {key}"]
        lines += [f"        {line}" for line in _permissions(permissions)]
        lines.append("      }")
    return lines


def _permissions(permissions: Permissions) -> list[str]:
    lines = ["permissions: {"]
    for kind, allowed in permissions.items():
        lines.append(f"  {kind}: {{ allow: [")
        lines += [f"    {_q(subject)}" for subject in allowed]
        lines.append("  ] }")
    lines.append("}")
    return lines


def _block(entry: dict[str, str]) -> str:
    """A one-line export: ``{ service: "...", response: stream }`` or ``{ stream: "..." }``."""
    parts = [
        f"{name}: {value if name == 'response' else _q(value)}" for name, value in entry.items()
    ]
    return "{ " + ", ".join(parts) + " }"


def _q(text: str) -> str:
    """A quoted config string: JSON quoting is valid nats-server config quoting."""
    return json.dumps(text)
