"""The one base class of every wire type, and the constrained scalar types they share.

Evolution rule (msgspec schema-evolution): new fields go last with defaults, a field's
type never changes, unknown fields are ignored so old readers accept new writers.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from schemas.subjects import TOKEN_PATTERN


class Wire(msgspec.Struct, frozen=True, kw_only=True):
    """Base of every message on the wire: immutable, keyword-only, JSON via msgspec."""


Token = Annotated[str, Meta(pattern=TOKEN_PATTERN, description="subject-safe token")]
NodeId = Annotated[str, Meta(pattern=TOKEN_PATTERN, description="node id")]
Cluster = Annotated[str, Meta(pattern=TOKEN_PATTERN, description="cluster name")]
UnixTime = Annotated[float, Meta(ge=0, description="seconds since the Unix epoch, UTC")]
Seconds = Annotated[float, Meta(ge=0, description="a duration in seconds")]
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
    "cordoned",
    "draining",
    "drained",
    "stale",
    "offline",
    "deregistered",
]
