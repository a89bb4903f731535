"""Every NATS subject, stream and bucket name of the wire contract, built in one place.

No other module writes a subject literal: a subject that is wrong here is wrong everywhere
and fixed once. Tokens that could escape their place in a subject (dots, wildcards,
spaces) are refused with :class:`InvalidToken`.
"""

from __future__ import annotations

import re
from typing import Final

from schemas.errors import InvalidToken

TOKEN_PATTERN: Final = r"^[A-Za-z0-9_-]{1,64}$"
_TOKEN = re.compile(TOKEN_PATTERN)

STREAM_HEARTBEATS: Final = "FLEET_HB"
STREAM_HEARTBEAT_INTAKE: Final = "FLEET_HB_IN"
"""Where nodes' heartbeats are stored first: a stream that refuses ``Nats-Rollup`` (one
with TTL delete markers, as FLEET_HB, cannot), which FLEET_HB sources from."""
STREAM_COMMANDS: Final = "FLEET_CMD"
STREAM_EVENTS: Final = "FLEET_EVENTS"
STREAM_ALERTS: Final = "FLEET_ALERTS"
BUCKET_NODES: Final = "fleet_nodes"
BUCKET_TRUST: Final = "fleet_trust"
BUCKET_ENROLL: Final = "fleet_enroll"
"""Enrollment tokens' records (``EnrollRecord``), key = token id: uses and revocation."""
BUCKET_LEASES: Final = "fleet_leases"
"""Which aggregator consumes which partition of FLEET_HB now (keys ``hb.<P>``, each an
AggregatorLease) and which aggregators are alive (keys ``member.<holder>``)."""
BUCKET_MAINTENANCE: Final = "fleet_maintenance"
"""Maintenance windows in force (``MaintenanceWindow``), key = window id."""
BUCKET_POLICY: Final = "fleet_policy"
"""The remediation policy's record per cluster (``PolicyRecord``), key = cluster."""
BUCKET_WORKLOADS: Final = "fleet_workloads"
"""Workloads placed by the fleet (``PlacedWorkload``), key = the workload's name."""
BUCKET_SETTINGS: Final = "fleet_settings"
"""Operators' signed settings (``SettingsEntry``), key = the scope (``fleet``,
``cluster.<cluster>``, ``selector.<digest>``): see :mod:`schemas.settings`."""
BUCKET_INDEX: Final = "fleet_index"
"""The fleet's state index (``PartitionIndex``), key ``part.<P>``: each partition's nodes
counted by cluster and state, and its nodes that are not active (:mod:`schemas.fleet_index`)."""
MAX_PARTITIONS: Final = 256
"""FLEET_HB is split into at most this many partitions (see :func:`partition_of`)."""
_FNV_OFFSET: Final = 0x811C9DC5
_FNV_PRIME: Final = 0x01000193

EVENT_SAMPLE: Final = "sample"
EVENT_HEALTH: Final = "health"
EVENT_INTERRUPTION: Final = "interruption"
EVENT_LATENCY: Final = "latency"
EVENT_ENGINE: Final = "engine"
EVENT_STATE: Final = "state"
EVENT_INJECT: Final = "inject"
EVENT_WORKLOADS: Final = "workloads"
EVENT_GATEWAY: Final = "gateway"
EVENT_WORKLOAD_ORDER: Final = "workload_order"
"""The command executor hands an accepted Deploy or Stop to the workload actor here."""
EVENT_CLOUD: Final = "cloud"
EVENT_SCHEDULER: Final = "scheduler"
EVENT_SETTINGS: Final = "settings"
PROBE_INBOX: Final = "_INBOX"
"""Probe answers go to ``_INBOX.<asker>.probe.<responder>.<token>`` (:func:`probe_reply`)."""
COMMAND_ACK_WAIT: Final = 30.0
"""Seconds a node has to acknowledge a command before FLEET_CMD delivers it again."""
COMMAND_MAX_DELIVER: Final = 5
"""Deliveries of one command at most (a command that keeps failing is not redelivered
forever)."""


def check_token(field: str, value: str) -> str:
    """Return ``value`` if it is a safe subject token, else raise ``InvalidToken``."""
    if not isinstance(value, str) or not _TOKEN.fullmatch(value):
        raise InvalidToken(field, str(value))
    return value


def is_token(value: str) -> bool:
    return bool(_TOKEN.fullmatch(value))


def partition_of(node: str, partitions: int) -> int:
    """The partition of FLEET_HB a node's heartbeats are stored in: what nats-server's
    ``{{partition(N, 2)}}`` subject transform computes from the node id token, FNV-1a
    32-bit over the token's bytes, modulo N (``tests/fleet/test_partitions.py``
    checks it against a real server). Written once here, so a record key alone says which
    aggregator owns the node."""
    digest = _FNV_OFFSET
    for byte in node.encode():
        digest = ((digest ^ byte) * _FNV_PRIME) & 0xFFFFFFFF
    return digest % partitions


def lease_key(partition: int) -> str:
    """The key of a partition's lease in ``fleet_leases``."""
    return f"hb.{partition}"


def member_key(holder: str) -> str:
    """An aggregator's membership key in ``fleet_leases`` (renewed with its leases)."""
    return f"member.{check_token('holder', holder)}"


def event_kind(subject: str) -> str:
    """The kind of a node event (``sample``, ``state``, ...): the last token of its subject."""
    return subject.rsplit(".", 1)[-1]


class Subjects:
    """Subject builders for one subject prefix (``fleet`` unless configured)."""

    def __init__(self, prefix: str = "fleet") -> None:
        parts = prefix.split(".")
        for part in parts:
            check_token("subject prefix", part)
        self.prefix = prefix
        self.depth = len(parts)

    def heartbeat(self, cluster: str, node: str) -> str:
        return f"{self.prefix}.hb.{check_token('cluster', cluster)}.{check_token('node id', node)}"

    def heartbeats(self) -> str:
        return f"{self.prefix}.hb.>"

    def published_heartbeats(self) -> str:
        """What nodes publish to (``<prefix>.hb.<cluster>.<node>``): FLEET_HB_IN's
        subjects. FLEET_HB has no subjects of its own, so nobody stores into a partition
        subject directly: only its source's transform below does."""
        return f"{self.prefix}.hb.*.*"

    def heartbeat_transform(self, partitions: int) -> tuple[str, str]:
        """The subject transform of FLEET_HB's source (source, destination): each
        heartbeat is stored as ``<prefix>.hb.<P>.<cluster>.<node>``, P the node token's
        partition."""
        return (
            self.published_heartbeats(),
            f"{self.prefix}.hb.{{{{partition({partitions},2)}}}}.{{{{wildcard(1)}}}}"
            ".{{wildcard(2)}}",
        )

    def transform_partitions(self, destination: str) -> int | None:
        """N of a FLEET_HB transform destination made by :meth:`heartbeat_transform`;
        None for any other (or none)."""
        found = re.fullmatch(
            re.escape(f"{self.prefix}.hb.") + r"\{\{\s*partition\(\s*(\d+)\s*,\s*2\s*\)\s*\}\}\..*",
            destination,
        )
        return int(found.group(1)) if found else None

    def stored_heartbeat(self, cluster: str, node: str, partitions: int) -> str:
        """The subject FLEET_HB stores ``heartbeat(cluster, node)`` under, with N
        partitions (what the transform makes of it)."""
        return (
            f"{self.prefix}.hb.{partition_of(node, partitions)}.{check_token('cluster', cluster)}"
            f".{check_token('node id', node)}"
        )

    def partition_heartbeats(self, partition: int) -> str:
        """The stored heartbeats of one partition (a consumer filter)."""
        return f"{self.prefix}.hb.{partition}.*.*"

    def event(self, node: str, event: str) -> str:
        return f"{self.prefix}.evt.{check_token('node id', node)}.{check_token('event', event)}"

    def events(self, node: str = "*") -> str:
        node_token = node if node == "*" else check_token("node id", node)
        return f"{self.prefix}.evt.{node_token}.*"

    def command(self, cluster: str, node: str) -> str:
        return f"{self.prefix}.cmd.{check_token('cluster', cluster)}.{check_token('node id', node)}"

    def commands(self) -> str:
        return f"{self.prefix}.cmd.>"

    def commands_of(self, node: str) -> str:
        """Every command subject of ``node``, whatever its cluster (``fleetctl forget``
        purges them)."""
        return f"{self.prefix}.cmd.*.{check_token('node id', node)}"

    def result(self, cluster: str, node: str) -> str:
        return (
            f"{self.prefix}.result.{check_token('cluster', cluster)}.{check_token('node id', node)}"
        )

    def results(self) -> str:
        return f"{self.prefix}.result.>"

    def alert(self, kind: str, cluster: str, node: str) -> str:
        return (
            f"{self.prefix}.alert.{check_token('alert kind', kind)}."
            f"{check_token('cluster', cluster)}.{check_token('node id', node)}"
        )

    def alerts(self) -> str:
        return f"{self.prefix}.alert.>"

    def forget(self) -> str:
        """``fleetctl forget``'s signed request, answered by an aggregator."""
        return f"{self.prefix}.forget"

    def maintenance(self) -> str:
        """``fleetctl maintenance``'s signed request, answered by an aggregator."""
        return f"{self.prefix}.maintenance"

    def policy(self) -> str:
        """``fleetctl policy reset|clear``'s signed request, answered by an aggregator."""
        return f"{self.prefix}.policy"

    def alerts_of(self, kind: str, cluster: str) -> str:
        """Every node's alerts of one kind in one cluster (a filter, for counting)."""
        return (
            f"{self.prefix}.alert.{check_token('kind', kind)}.{check_token('cluster', cluster)}.*"
        )

    def register(self) -> str:
        return f"{self.prefix}.register"

    def probe(self, node: str) -> str:
        return f"{self.prefix}.probe.{check_token('node id', node)}"

    def stream_name(self, base: str) -> str:
        """Stream names carry the prefix when it is not the default, so prefixes never share."""
        if self.prefix == "fleet":
            return base
        return f"{base}_{self.prefix.replace('.', '_').replace('-', '_').upper()}"

    def partition_consumer(self, durable: str, partition: int) -> str:
        """The durable consumer of one FLEET_HB partition (``<durable>-<P>``)."""
        return f"{self.stream_name(durable)}-{partition}"

    def bucket_name(self, base: str) -> str:
        if self.prefix == "fleet":
            return base
        return f"{base}_{self.prefix.replace('.', '_')}"

    def split_heartbeat(self, subject: str) -> tuple[str, str]:
        """(cluster, node) of a heartbeat subject; raises InvalidToken on a foreign subject."""
        return self._tail(subject, "hb")

    def split_stored_heartbeat(self, subject: str) -> tuple[int, str, str]:
        """(partition, cluster, node) of a heartbeat as FLEET_HB stores it
        (``<prefix>.hb.<P>.<cluster>.<node>``, TTL markers included); raises InvalidToken
        on any other subject (a published one, or one of the old 4-token layout)."""
        head, _, tail = subject.rpartition(".")
        head, _, cluster = head.rpartition(".")
        base, _, partition = head.rpartition(".")
        if base != f"{self.prefix}.hb" or not partition.isdigit() or len(partition) > 3:
            raise InvalidToken("stored heartbeat subject", subject)
        return int(partition), check_token("cluster", cluster), check_token("node id", tail)

    def split_command(self, subject: str) -> tuple[str, str]:
        return self._tail(subject, "cmd")

    def split_result(self, subject: str) -> tuple[str, str]:
        return self._tail(subject, "result")

    def _tail(self, subject: str, kind: str) -> tuple[str, str]:
        parts = subject.split(".")
        head = [*self.prefix.split("."), kind]
        if len(parts) != len(head) + 2 or parts[: len(head)] != head:
            raise InvalidToken(f"{kind} subject", subject)
        return check_token("cluster", parts[-2]), check_token("node id", parts[-1])


def probe_reply(asker: str, responder: str, token: str) -> str:
    """The reply subject of ``asker``'s probe to ``responder``:
    ``_INBOX.<asker>.probe.<responder>.<token>``. Under the shipped permissions a node may
    publish to no inbox but ``_INBOX.*.probe.<itself>.*``, so an answer there is the
    responder's (the server says so), and only ``asker`` may read it."""
    check_token("node id", asker)
    check_token("node id", responder)
    return f"{PROBE_INBOX}.{asker}.probe.{responder}.{check_token('token', token)}"


def probe_reply_responder(reply: str) -> str | None:
    """The responder named by a probe's reply subject, or None when it is not one
    :func:`probe_reply` makes (a prober answers no other)."""
    parts = reply.split(".")
    if len(parts) != 5 or parts[0] != PROBE_INBOX or parts[2] != "probe":
        return None
    if not all(is_token(part) for part in parts[1:]):
        return None
    return parts[3]


def command_consumer(cluster: str, node: str) -> str:
    """The durable consumer of ``node``'s commands on FLEET_CMD; the provider creates it
    (see actors/fleet/aggregator/command_queues.py), the node only reads from it."""
    return f"cmd_{check_token('cluster', cluster)}_{check_token('node id', node)}"
