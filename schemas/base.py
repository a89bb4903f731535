"""The one base class of every wire type, and the constrained scalar types they share.

Evolution rule (msgspec schema-evolution): new fields go last with defaults, a field's
type never changes, unknown fields are ignored so old readers accept new writers.

Every string, list and map on the wire is bounded, so a signed but hostile body is refused
at decode instead of crashing whoever stores it. The bounds are in characters; JSON
escaping can make a character take up to six bytes. A heartbeat is also bounded in bytes
(``FLEET_HB``'s ``max_msg_size``, below the largest the bounds allow), and the record
that embeds one in ``fleet_nodes`` has room for any heartbeat the stream stores: the size
test of ``tests/security/test_limits.py`` computes the worst case with such characters.
"""

from __future__ import annotations

from typing import Annotated, Final, Literal

import msgspec
from msgspec import Meta

from schemas.subjects import TOKEN_PATTERN

SIGNED_TYPE = "type"
"""The field naming what an operator- or self-signed body is (``forget``, ``inject``,
``command``, ``enroll_claims``, ``registration``, ``maintenance``): msgspec's struct tag,
so it is written into every such body (and covered by its signature), and a body naming
another type is a DecodeError. A body without it (written by an earlier version) decodes
as before: the field is optional on the wire. So an operator-signed ``inject`` cannot
verify as a ``Forget``, whose fields it has. Heartbeats and node events need none: their
subject says what they are."""


class Wire(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Base of every message on the wire: immutable, keyword-only, JSON via msgspec.

    ``gc=False``: instances are trees of values (frozen, decoded from JSON or built from
    values), never part of a reference cycle, so the garbage collector need not track
    them. An aggregator holding 100,000 records then pays ~5 µs less per heartbeat (its
    collections no longer walk every record) and 16 bytes less per struct."""


MAX_NAME = 128
"""Characters of a name or identifier: a GPU or check name, a boot id, a version, a nonce."""
MAX_TEXT = 1024
"""Characters of free text: a reason, a message, a detail, a recommended action."""
MAX_ID = 256
"""Characters of an id built from other tokens (an alert id names kind, cluster, node and
event; a command id is chosen by the operator's tool)."""
MAX_URL = 512
MAX_HOSTNAME = 255
"""A fully qualified domain name's limit."""
MAX_GPUS = 64
"""GPUs per node: twice the largest machines sold today (32-GPU nodes)."""
MAX_XIDS = 16
"""Distinct XID codes kept per GPU."""
MAX_NVLINKS = 36
"""NVLink links per GPU (NVML_NVLINK_MAX_LINKS)."""
MAX_UNREAD = 32
"""GPU readings a sample can say it could not read, and why."""
MAX_PEERS = 256
"""Peers a node reports latency to."""
MAX_COMPONENTS = 8
"""Health score components (five today)."""
MAX_CHECKS = 16
"""Health hard checks (five today)."""
MAX_ENGINES = 8
"""Inference engines per node."""
MAX_DETAILS = 8
"""Entries in an alert's details."""
MAX_WORKLOADS: Final = 64
"""Workloads one node runs at most."""

MAX_LABELS = 32
"""Labels per node (given and automatic together)."""
MAX_LABEL_KEY = 63
"""Characters of a label key (Kubernetes' bound for a name)."""
MAX_LABEL_VALUE = 128
"""Characters of a label value: room for a served model's name."""
MAX_MODELS = 16
"""Served model names kept per inference engine."""
LABEL_KEY_PATTERN = r"^[A-Za-z0-9]([A-Za-z0-9._/-]*[A-Za-z0-9])?$"
LABEL_VALUE_PATTERN = r"^[A-Za-z0-9._:/@+-]*$"
"""No spaces, commas or ``=``: a label stays one ``key=value`` word in flags, env lists
and ``?label=`` filters. Several values are joined with ``+`` (served models)."""

MAX_ENROLL_TOKEN = 2048
"""Characters of an enrollment token as presented (base64url claims and signature)."""
MAX_ENROLLED = 64
"""Nodes an enrollment token's record names (the latest); its use count goes on."""
TOKEN_ID_PATTERN = r"^[a-f0-9]{32}$"
MAX_DEPENDENCIES = 8
"""Dependency versions (nvidia-smi, slurmd, docker, podman, ...) one sample reports."""

Name = Annotated[str, Meta(max_length=MAX_NAME)]
Text = Annotated[str, Meta(max_length=MAX_TEXT)]
Id = Annotated[str, Meta(max_length=MAX_ID)]
Url = Annotated[str, Meta(max_length=MAX_URL)]
Hostname = Annotated[str, Meta(max_length=MAX_HOSTNAME)]
Details = Annotated[dict[Name, Text], Meta(max_length=MAX_DETAILS)]
LabelKey = Annotated[str, Meta(min_length=1, max_length=MAX_LABEL_KEY, pattern=LABEL_KEY_PATTERN)]
LabelValue = Annotated[str, Meta(max_length=MAX_LABEL_VALUE, pattern=LABEL_VALUE_PATTERN)]
Labels = Annotated[
    dict[LabelKey, LabelValue],
    Meta(
        max_length=MAX_LABELS,
        description="placement labels: the operator's, then the node's own claims "
        "(gpu.product, gpu.count, gpu.memory, gpu.passthrough, driver, provider, region, "
        "zone, instance_type, lifecycle, model) under keys the operator did not set",
    ),
]
Token = Annotated[str, Meta(pattern=TOKEN_PATTERN, description="subject-safe token")]
NodeId = Annotated[str, Meta(pattern=TOKEN_PATTERN, description="node id")]
Cluster = Annotated[str, Meta(pattern=TOKEN_PATTERN, description="cluster name")]
UnixTime = Annotated[float, Meta(ge=0, description="seconds since the Unix epoch, UTC")]
Seconds = Annotated[float, Meta(ge=0, description="a duration in seconds")]
MAX_STALE_AFTER = 86_400.0
"""A day: the longest ``stale_after`` (and ``Nats-TTL``) a heartbeat may claim. Aggregators
bound what they believe further (``max_stale_after``)."""
Liveness = Annotated[
    float, Meta(ge=0, le=MAX_STALE_AFTER, description="a duration in seconds, at most a day")
]
Percent = Annotated[float, Meta(ge=0, le=100)]
Count = Annotated[int, Meta(ge=0)]
Seq = Annotated[int, Meta(ge=0, le=2**63 - 1, description="a sequence number, 63 bits")]
Bytes = Annotated[int, Meta(ge=0, description="bytes")]
PublicKey = Annotated[
    str, Meta(pattern=r"^U[A-Z2-7]{55}$", description="Ed25519 public key as a NATS user nkey")
]

Schedulability = Literal["schedulable", "cordoned", "draining", "drained"]
HealthStatus = Literal["healthy", "degraded", "unhealthy"]
CheckStatus = Literal["ok", "degraded", "unhealthy", "unknown"]
RecordState = Literal[
    "pending",
    "active",
    "degraded",
    "unhealthy",
    "cordoned",
    "draining",
    "drained",
    "stale",
    "offline",
    "deregistered",
    "stopped",
]
OpenRecordState = Annotated[
    str,
    Meta(
        max_length=32,
        description="pending, active, degraded, unhealthy, cordoned, draining, drained, "
        "stale, offline, deregistered or stopped; readers keep a state they do not know, "
        "as it is",
    ),
]
"""A record's state as read: a bounded string, not the closed :data:`RecordState`, so a
record that a newer aggregator wrote with a state this version does not know is still
read (rolling upgrades). Writers still write a :data:`RecordState`."""
OpenSchedulability = Annotated[
    str,
    Meta(
        max_length=32,
        description="schedulable, cordoned, draining or drained; readers keep a value they "
        "do not know",
    ),
]
OpenHealthStatus = Annotated[
    str,
    Meta(
        max_length=32,
        description="healthy, degraded or unhealthy; readers keep a value they do not know",
    ),
]
