"""The fleet's state index: KV bucket ``fleet_index``, key ``part.<P>``, one
:class:`PartitionIndex` per partition of FLEET_HB, written by the aggregator holding the
partition when a node's state or health changes (at most once per second) and again
every ``REWRITE_EVERY`` seconds. What a listing reads instead of every record: the
counts by cluster and state, and every node that is not active."""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta

from schemas.base import (
    Cluster,
    Count,
    Name,
    NodeId,
    OpenHealthStatus,
    OpenRecordState,
    UnixTime,
    Wire,
)

MAX_LISTED = 4_000
"""Nodes one partition's index lists by name at most (those not active; 32,000 in a
fleet of the default 8 partitions); past it ``listed_all`` is false and a listing reads
every record."""


class IndexedNode(Wire, frozen=True, kw_only=True):
    """A node the index lists: its cluster, state and health as its record says."""

    cluster: Cluster
    state: OpenRecordState
    health: OpenHealthStatus = ""
    """The record's health status in a state where the last heartbeat says how it is now
    (active, degraded, unhealthy, cordoned, draining, drained); "" in the others."""


class PartitionIndex(Wire, frozen=True, kw_only=True):
    """One partition's nodes, counted, as the aggregator holding it keeps them."""

    partition: Annotated[int, Meta(ge=0)]
    partitions: Annotated[int, Meta(ge=1)]
    """How many partitions FLEET_HB has: a reader needs every one's index."""
    holder: Name
    written: UnixTime
    counts: dict[Cluster, dict[OpenRecordState, Count]]
    """Nodes by cluster and state (deregistered ones included)."""
    health: dict[OpenHealthStatus, Count] = {}
    """Nodes by health status, counted where the state says the heartbeat is current."""
    listed: dict[NodeId, IndexedNode] = {}
    """Every node whose state is not active."""
    listed_all: bool = True
    """False when more than MAX_LISTED nodes were to be listed (then none are)."""
