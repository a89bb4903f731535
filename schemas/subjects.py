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
STREAM_COMMANDS: Final = "FLEET_CMD"
STREAM_EVENTS: Final = "FLEET_EVENTS"
STREAM_ALERTS: Final = "FLEET_ALERTS"
BUCKET_NODES: Final = "fleet_nodes"
BUCKET_TRUST: Final = "fleet_trust"
BUCKET_ENROLL: Final = "fleet_enroll"
"""Enrollment tokens' records (``EnrollRecord``), key = token id: uses and revocation."""
BUCKET_LEASES: Final = "fleet_leases"
"""Which aggregator consumes FLEET_HB now (key ``hb``, an AggregatorLease)."""

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


def check_token(field: str, value: str) -> str:
    """Return ``value`` if it is a safe subject token, else raise ``InvalidToken``."""
    if not isinstance(value, str) or not _TOKEN.fullmatch(value):
        raise InvalidToken(field, str(value))
    return value


def is_token(value: str) -> bool:
    return bool(_TOKEN.fullmatch(value))


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

    def bucket_name(self, base: str) -> str:
        if self.prefix == "fleet":
            return base
        return f"{base}_{self.prefix.replace('.', '_')}"

    def split_heartbeat(self, subject: str) -> tuple[str, str]:
        """(cluster, node) of a heartbeat subject; raises InvalidToken on a foreign subject."""
        return self._tail(subject, "hb")

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
