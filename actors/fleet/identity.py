"""A node's enrolled identity against what it claims now.

The enrolled identity (host name, GPU uuids and count, cloud and instance type) is in the
node's trust entry, written by an operator's approval or an enrollment token; what a
node's heartbeats say is its claim, and a stolen node key can claim anything. The one
rule here says when the claims name another machine: a host name other than the enrolled
one, a GPU uuid not among the enrolled ones, another provider or instance type. A GPU
gone is not another machine (the ``boot`` check says it is missing), nor is a claim that
names nothing (no sample yet, no cloud facts yet). The remediation policy runs
no hook for such a node, and raises ``hardware_changed`` once per claim, until an
operator confirms (``fleetctl approve --identity``); views show both.
"""

from __future__ import annotations

import hashlib

from schemas import codec
from schemas.messages import MAX_IDENTITY_BYTES, NodeIdentity, NodeRecord, identity_of


def claimed(record: NodeRecord) -> NodeIdentity | None:
    """The identity the record's heartbeat claims; None without a sample."""
    beat = record.heartbeat
    if beat is None or beat.sample is None:
        return None
    sample = beat.sample
    return identity_of(sample.hostname, sample.gpus, sample.passthrough_gpus, beat.labels)


def differences(enrolled: NodeIdentity | None, claims: NodeIdentity | None) -> list[str]:
    """What in ``claims`` names another machine than ``enrolled`` (see the module's
    docstring); empty when nothing is enrolled or claimed."""
    if enrolled is None or claims is None:
        return []
    found = []
    if enrolled.hostname and claims.hostname and claims.hostname != enrolled.hostname:
        found.append(f"host {claims.hostname} (enrolled: {enrolled.hostname})")
    new = sorted(set(claims.gpus) - set(enrolled.gpus))
    if new:
        found.append(f"GPU {', '.join(new)} (not enrolled)")
    for what, was, now in (
        ("provider", enrolled.provider, claims.provider),
        ("instance type", enrolled.instance_type, claims.instance_type),
    ):
        if was and now and now != was:
            found.append(f"{what} {now} (enrolled: {was})")
    return found


def recordable(identity: NodeIdentity | None) -> NodeIdentity | None:
    """``identity`` if it may be recorded (at most MAX_IDENTITY_BYTES encoded), else None."""
    if identity is None or len(codec.encode(identity)) > MAX_IDENTITY_BYTES:
        return None
    return identity


def digest(claims: NodeIdentity | None) -> str:
    """A short name for one set of claims (the same in every aggregator)."""
    body = codec.encode(claims) if claims is not None else b""
    return hashlib.sha256(body).hexdigest()[:16]


def summary(identity: NodeIdentity | None) -> str:
    """``host h1, 2 GPUs (NVIDIA H100), aws p5.48xlarge us-east-1: GPU-a, GPU-b`` (the
    passthrough GPUs among them said so); ``none`` without one."""
    if identity is None:
        return "none"
    product = f" ({identity.gpu_product})" if identity.gpu_product else ""
    passthrough = f", {identity.gpu_passthrough} passthrough" if identity.gpu_passthrough else ""
    cloud = " ".join(
        part for part in (identity.provider, identity.instance_type, identity.region) if part
    )
    where = f", {cloud}" if cloud else ""
    gpus = f": {', '.join(identity.gpus)}" if identity.gpus else ""
    return (
        f"host {identity.hostname or '-'}, {identity.gpu_count} GPUs{product}{passthrough}"
        f"{where}{gpus}"
    )
