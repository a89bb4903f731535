"""The agent's local inventory document: ``GET /v1/node/inventory`` on its HTTP port.

What a provisioning tool or a local control plane asks a node for: its GPUs (NVML's or
the stand-in's, and those bound to ``vfio-pci``), capacity, host facts, engines,
workloads and labels, in one read, from the node itself (not through the fleet). Served
on the agent's HTTP address (127.0.0.1 by default), as ``/status`` is.
"""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta

from schemas.base import MAX_WORKLOADS, Cluster, Labels, NodeId, UnixTime, Wire
from schemas.events import Engine, Sample, Workload


class NodeInventory(Wire, frozen=True, kw_only=True):
    """The node as its actors last saw it; every part None (or empty) until first seen."""

    node_id: NodeId
    cluster: Cluster
    ts: UnixTime
    """When this document was made."""
    sample: Sample | None = None
    """The latest sample (its own ``ts``): GPUs, passthrough GPUs, capacity (with the GPUs
    the workloads pin counted as taken), host facts."""
    engine: Engine | None = None
    workloads: Annotated[list[Workload], Meta(max_length=MAX_WORKLOADS)] = []
    labels: Labels = {}
    """The labels the heartbeat carries: the operator's, then the node's own."""
    found_labels: Labels = {}
    """The node's own labels (identity, served models) as found, those the operator's
    override included: its claims about itself."""


__all__ = ["NodeInventory"]
