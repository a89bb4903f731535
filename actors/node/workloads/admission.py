"""Whether a node takes a deploy: allowed at all, GPUs it has and no other workload holds
(unless both share), a free name and port; and which workloads a deploy of another model
switches out (those on its GPUs serving a different model, none of them loading)."""

from __future__ import annotations

from dataclasses import dataclass, field

from actors.node.workloads import processes
from actors.node.workloads.running import FINAL_STATES, SWITCHABLE, Running
from schemas.messages import MAX_HEARTBEAT_WORKLOADS
from schemas.workloads import Deploy


@dataclass
class Admission:
    """Why the node refuses a deploy ("" when it takes it), and the workloads the deploy
    replaces (stopped, their requests answered first, before it starts)."""

    refusal: str = ""
    displaced: list[Running] = field(default_factory=list)


def admit(deploy: Deploy, running: dict[str, Running], gpus: set[int] | None) -> Admission:
    """What the node does with ``deploy``, given the workloads it runs and its GPUs."""
    active = [w for w in running.values() if w.state not in FINAL_STATES]
    displaced: list[Running] = []
    existing = running.get(deploy.name)
    if existing is not None and existing.state not in FINAL_STATES:
        if not _switchable(existing, deploy):
            return Admission(
                f"a workload named {deploy.name} already runs ({existing.state}, model "
                f"{existing.deploy.model or '-'}); stop it first"
            )
        displaced.append(existing)
    staying = [w for w in active if w not in displaced]
    if len(staying) >= MAX_HEARTBEAT_WORKLOADS:
        return Admission(f"this node runs at most {MAX_HEARTBEAT_WORKLOADS} workloads")
    if deploy.gpus:
        if gpus is None:
            return Admission("GPU inventory not known yet; send the deploy again")
        missing = sorted(set(deploy.gpus) - gpus)
        if missing:
            have = ",".join(str(i) for i in sorted(gpus)) or "none"
            return Admission(f"no GPU {','.join(map(str, missing))} on this node (it has {have})")
        for other in staying:
            # Sharing takes both: one that asked for a GPU of its own keeps it.
            shared = sorted(set(deploy.gpus) & set(other.deploy.gpus))
            if not shared or (deploy.share and other.deploy.share):
                continue
            if _switchable(other, deploy):
                displaced.append(other)
                continue
            return Admission(
                f"GPU {','.join(map(str, shared))} already used by workload "
                f"{other.deploy.name} ({other.state}, model {other.deploy.model or '-'}; "
                "both must be deployed with --share, or another model switches it once "
                "it is not loading)"
            )
    if deploy.port:
        if any(w.entry.port == deploy.port for w in active if w not in displaced):
            return Admission(f"port {deploy.port} already used by another workload")
        if all(w.entry.port != deploy.port for w in displaced) and processes.port_in_use(
            deploy.port
        ):
            return Admission(f"port {deploy.port} in use on 127.0.0.1")
    return Admission("", displaced)


def _switchable(workload: Running, deploy: Deploy) -> bool:
    """A deploy of another model takes the place of a workload not loading or stopping."""
    return (
        workload.state in SWITCHABLE
        and bool(deploy.model)
        and workload.deploy.model != deploy.model
    )
