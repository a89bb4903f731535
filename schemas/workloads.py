"""What an operator orders a node's workload actor to do: deploy or stop a workload.

``Deploy`` and ``Stop`` are members of the signed ``Command.action`` union
(:mod:`schemas.messages`); ``WorkloadOrder`` is how the node's command executor hands an
accepted one to its workload actor, as an event on ``fleet.evt.<node>.workload_order``
which the workload actor takes only from its own agent process (node actors never import
each other). They live here, not in ``messages``, because ``events`` needs the order and
``messages`` imports ``events``.
"""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta

from schemas.base import (
    MAX_GPUS,
    MAX_NAME,
    Count,
    Id,
    Name,
    Seconds,
    Text,
    UnixTime,
    Wire,
)

MAX_ARGS = 64
"""Extra arguments of one workload's command line."""
MAX_ENV = 32
"""Environment variables one deploy sets."""

WorkloadName = Annotated[
    str,
    Meta(
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$",
        description="workload name: letters, digits, _ and -, at most 63",
    ),
]
"""Names a file in the node's state dir, so it is a safe file name too."""
DeployEngine = Literal["llamacpp", "vllm", "sglang", "process"]
Port = Annotated[int, Meta(ge=0, le=65535, description="TCP port; 0: the node picks one")]
EnvName = Annotated[str, Meta(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,127}$", max_length=MAX_NAME)]


class Deploy(Wire, frozen=True, kw_only=True, tag="deploy", tag_field="kind"):
    """Start a workload on the given GPUs, bound to 127.0.0.1, and report when it is ready."""

    name: WorkloadName
    engine: DeployEngine
    gpus: Annotated[list[Count], Meta(max_length=MAX_GPUS)] = []
    model: Text = ""
    port: Port = 0
    args: Annotated[list[Text], Meta(max_length=MAX_ARGS)] = []
    """For ``process``: the whole argv (``{port}``, ``{gpus}``, ``{model}`` substituted);
    for an engine: extra arguments after its launch template."""
    env: Annotated[dict[EnvName, Text], Meta(max_length=MAX_ENV)] = {}
    ready_timeout: Seconds = 600.0
    max_pending: Count = 8
    share: bool = False
    """Allow GPUs another workload already uses."""
    image: Text = ""
    """Run the workload in this container image (podman) instead of on the host: the
    engine's server command (or, for ``process``, ``args``) inside it."""
    placed: bool = False
    """Sent by fleet placement (``fleetctl deploy`` without a node, or the workload
    reconciler): the fleet moves this workload when the node drains, so a drain waits
    (within its deadline) until it has been stopped here."""


class Stop(Wire, frozen=True, kw_only=True, tag="stop", tag_field="kind"):
    """Stop a workload: SIGTERM to its process group, SIGKILL after a grace period."""

    name: WorkloadName


class WorkloadOrder(Wire, frozen=True, kw_only=True):
    """An accepted Deploy or Stop, handed from the command executor to the workload actor."""

    ts: UnixTime
    command_id: Id
    action: Deploy | Stop
    command_digest: Name = ""
    reason: Text = ""
    """The command's reason (a Stop's final result repeats it)."""
