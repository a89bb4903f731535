"""The aggregator's settings: every one a flag of ``fleetctl aggregator``, a
``FLEET_AGGREGATOR_*`` environment variable and a TOML key, merged and validated by the
runtime's layered loader (:mod:`actors.runtime.config`), exactly as the agent's are.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from actors.runtime.config import DEFAULT_SERVER, Positive

ENV_PREFIX = "FLEET_AGGREGATOR_"


class AggregatorConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Every setting of ``fleetctl aggregator``; each is a flag, an env var and a TOML key."""

    server: str = DEFAULT_SERVER
    nkey_file: str = ""
    """Authenticate to NATS with this nkey seed (servers configured like deploy/nats/auth.conf)."""
    prefix: str = "fleet"
    connect_timeout: Positive = 5.0
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    durable: str = "aggregator"
    """The heartbeat consumer every aggregator of the fleet shares."""
    replicas: Annotated[int, Meta(ge=1, le=5)] = 1
    """Stream and bucket replicas: 3 in a 3-node cluster."""
    max_skew: Positive = 300.0
    """A heartbeat whose timestamp is further than this from the aggregator's clock is refused."""
    offline_after: Positive = 300.0
    sweep_interval: Positive = 5.0
    full_sweep_interval: Positive = 120.0
    """How often every record is read to find stale nodes another aggregator saw go stale."""

    max_seq_jump: Annotated[int, Meta(ge=1)] = 10_000
    """A heartbeat whose seq is more than this above the node's last accepted one is
    refused (an alert ``sequence_gap`` with ``refused``). An agent skips at most one
    reserved block (1,000) per restart, so this allows ten crashes in a row, or ~28 h of
    10 s beats no aggregator saw; beyond it ``fleetctl reset-seq NODE`` lets the node in."""
    max_deliver: Annotated[int, Meta(ge=1)] = 5
    """Deliveries of one FLEET_HB message before the server gives up on it."""
    max_pending: Annotated[int, Meta(ge=0)] = 1000
    """Registrations are refused while this many nodes wait for approval."""
    pending_expire_after: Positive = 86_400.0
    """A pending record nobody approved is deleted by the full sweep after this long."""
    registrations_per_minute: Annotated[int, Meta(ge=1)] = 120
    """Registrations one aggregator answers per minute, all keys together."""
    registrations_per_key_per_minute: Annotated[int, Meta(ge=1)] = 6
    """Registrations one aggregator answers per minute for one public key."""

    http_host: str = "127.0.0.1"
    http_port: Annotated[int, Meta(ge=-1, le=65535)] = 9092
    """``/nodes``, ``/nodes/<id>`` and ``/metrics``; 0 picks a free port, -1 serves nothing."""
