"""A workload placed by the fleet: KV bucket ``fleet_workloads``, key = the workload's name.

``fleetctl deploy NAME`` without a node writes one :class:`PlacedWorkload`: the deploy to
run (its ``gpus`` left empty: each replica names its own), how many replicas, what a node
must offer, and where each replica runs now and why. Aggregators running the workload
reconciler keep it true (they move replicas off lost, drained and failing nodes), and
every change is a compare-and-set on the record's revision, so two aggregators never both
move one replica. Replicas run on distinct nodes, under the workload's own name there.

What to run is signed by the operator who placed it (``spec_sig`` over ``spec``):
a reconciler signs deploys only for a workload an operator it trusts signed, so whoever
can write the bucket cannot have it sign a deploy of their own.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from schemas.base import MAX_GPUS, Bytes, Count, Id, Labels, Name, NodeId, Text, UnixTime, Wire
from schemas.workloads import Deploy

MAX_REPLICAS = 64
"""Replicas one placed workload runs at most."""
MAX_AVOID = 16
"""Nodes one replica remembers it failed on (and is not placed on again)."""
MAX_FAILURES = 32
"""Failures of a workload's replicas remembered (the newest): where not to place it again
for a while."""
MAX_LEFTOVERS = 64
"""Copies of replicas still to stop on nodes they were moved off."""
MAX_SPEC = 192 * 1024
"""Characters of a placed workload's signed spec (a deploy's arguments and environment
at their bounds fit)."""

GpuIndex = Annotated[int, Meta(ge=0, lt=MAX_GPUS)]


class Replica(Wire, frozen=True, kw_only=True):
    """One replica: the node and GPUs it was placed on ("" while no node fits), the deploy
    sent there, and why that node."""

    index: Count
    node: Name = ""
    """The node it runs on; empty while pending (no node fits: ``why`` says what failed)."""
    cluster: Name = ""
    gpus: Annotated[list[GpuIndex], Meta(max_length=MAX_GPUS)] = []
    deployed_at: UnixTime | None = None
    """When the deploy to ``node`` was sent."""
    command_id: Id = ""
    """The id of that deploy command (its results in FLEET_EVENTS name it)."""
    why: Text = ""
    """Why this node: what it offered and which nodes were passed over, and why."""
    moves: Count = 0
    """Times the replica was placed again elsewhere."""
    avoid: Annotated[list[NodeId], Meta(max_length=MAX_AVOID)] = []
    """Nodes the replica failed on (crash loop, refused, not ready): not tried again."""


class Leftover(Wire, frozen=True, kw_only=True):
    """A replica's old copy on a node it was moved off: stopped (a signed Stop) once its
    replacement is ready or ``stop_by`` passes, whenever that node reports it running."""

    node: NodeId
    cluster: Name
    index: Count
    """The replica that moved."""
    since: UnixTime
    stop_by: UnixTime
    reason: Text = ""
    stopped_at: UnixTime | None = None
    """When the last Stop was sent (sent again if the node still lists it a while later)."""
    node_lost: bool = False
    """The replica moved because its node was lost (not reporting, forgotten, deregistered
    or gone): a copy that node reports later kept running while it was away."""


class Failure(Wire, frozen=True, kw_only=True):
    """A replica that failed on a node (crash loop, failed to start, refused, never
    reported): no replica of the workload is placed there again for a while (the
    reconciler's backoff, shown in ``fleetctl deploy --why``)."""

    node: NodeId
    index: Count
    """The replica that failed."""
    at: UnixTime
    reason: Text = ""


class PlacedWorkload(Wire, frozen=True, kw_only=True):
    """A workload the fleet keeps running on ``replicas`` nodes it chooses."""

    name: Name
    deploy: Deploy
    """What each replica's node is sent (with that replica's GPUs)."""
    gpus: Count = 0
    """GPUs each replica needs."""
    gpu_memory: Bytes = 0
    """Free memory each of those GPUs needs (0: not known, not checked)."""
    cluster: Name = ""
    """Only nodes of this cluster ("": any)."""
    selector: Labels = {}
    """Only nodes with all these labels."""
    replicas: Annotated[list[Replica], Meta(max_length=MAX_REPLICAS)] = []
    leftovers: Annotated[list[Leftover], Meta(max_length=MAX_LEFTOVERS)] = []
    created_at: UnixTime
    created_by: Name = ""
    """The operator's public key."""
    updated_at: UnixTime | None = None
    updated_by: Name = ""
    """Who wrote this revision: ``fleetctl`` or the reconciler's public key."""
    spec: Annotated[str, Meta(max_length=MAX_SPEC)] = ""
    """The exact JSON text ``spec_sig`` signs (:func:`spec_body`): what to run, where it
    may run and how many replicas. Kept as signed, so a reader of a newer or older
    version verifies the very bytes, then checks that they say what this record says."""
    spec_sig: Name = ""
    """Base64 Ed25519 signature by ``created_by`` over ``spec``."""
    failures: Annotated[list[Failure], Meta(max_length=MAX_FAILURES)] = []
    """Where its replicas failed lately, newest last (by any replica: a drain moving
    another replica does not send it there either, within the backoff)."""


SpecFields = tuple[str, Deploy, int, int, str, list[tuple[str, str]], int, float, str]


def spec_fields(workload: PlacedWorkload) -> SpecFields:
    """What the signature covers: name, deploy, gpus, gpu_memory, cluster, the selector's
    pairs sorted, the replica count, created_at and created_by (never where replicas run
    now, which reconcilers change)."""
    return (
        workload.name,
        workload.deploy,
        workload.gpus,
        workload.gpu_memory,
        workload.cluster,
        sorted(workload.selector.items()),
        len(workload.replicas),
        workload.created_at,
        workload.created_by,
    )


def spec_body(workload: PlacedWorkload) -> bytes:
    """The bytes ``fleetctl deploy`` signs and stores as ``spec``: :func:`spec_fields` as
    one JSON list."""
    return msgspec.json.encode(spec_fields(workload))


def spec_matches(workload: PlacedWorkload) -> bool:
    """Whether the record's own fields are what its (verified) ``spec`` says."""
    try:
        signed: SpecFields = msgspec.json.decode(workload.spec, type=SpecFields)
    except msgspec.DecodeError:  # ValidationError is one too
        return False
    return signed == spec_fields(workload)
