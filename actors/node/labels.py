"""The labels a node's heartbeat carries: the operator's, then the node's own. A helper of
the heartbeat actor (and of ``/v1/node/inventory`` and ``node-agent register``).

The node's own labels are its claims about itself, found rather than given: its identity
(:data:`IDENTITY_KEYS`: the GPUs from NVML, the stand-in or the PCI bus; the cloud from
its metadata service) and the served models. An operator's label is never overwritten: a
key the operator set keeps the operator's value, and a node label under that key is left
out (the heartbeat actor logs the first such clash of each key). The operator's labels
come first, so when the two together pass MAX_LABELS, node labels are what is left out.

Found values are cleaned to the label charset and bounds (a model name with a space
becomes ``_``; one too long is cut), so a strange answer never costs a heartbeat.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from schemas.base import MAX_LABEL_VALUE, MAX_LABELS
from schemas.events import CloudFacts, Engine, Sample

MODEL = "model"
"""Well-known key: the served models of every engine, sorted, joined with ``+``."""
GPU_PRODUCT = "gpu.product"
GPU_COUNT = "gpu.count"
GPU_MEMORY = "gpu.memory"
GPU_PASSTHROUGH = "gpu.passthrough"
DRIVER = "driver"
IDENTITY_KEYS = (
    GPU_PRODUCT,
    GPU_COUNT,
    GPU_MEMORY,
    GPU_PASSTHROUGH,
    DRIVER,
    "provider",
    "region",
    "zone",
    "instance_type",
    "lifecycle",
)
"""The keys a node fills from what it finds about itself (docs/operations.md, Labels)."""

MIB = 1024 * 1024
_UNSAFE = re.compile(r"[^A-Za-z0-9._:/@+-]")


def clean(value: str) -> str:
    """``value`` in the label charset and bound."""
    return _UNSAFE.sub("_", value)[:MAX_LABEL_VALUE]


def product(name: str) -> str:
    """A GPU's product name as a label value, words joined by ``-`` as NVIDIA's GPU
    feature discovery writes them: ``NVIDIA H100 80GB HBM3`` is ``NVIDIA-H100-80GB-HBM3``."""
    return clean("-".join(name.split()))


def served_models(engine: Engine | None) -> str:
    """The ``model`` label value: every served model name once, sorted, ``+``-joined,
    cut at whole names to the value bound ("" when none is known)."""
    if engine is None:
        return ""
    names = sorted({clean(name).replace("+", "_") for e in engine.engines for name in e.models})
    value = ""
    for name in names:
        joined = f"{value}+{name}" if value else name
        if len(joined) > MAX_LABEL_VALUE:
            break
        value = joined
    return value


def gpu_labels(sample: Sample | None) -> dict[str, str]:
    """What a sample says of the GPUs: ``gpu.product`` (the first GPU's, NVML's or a
    passthrough one's), ``gpu.count`` (every GPU, passthrough ones included),
    ``gpu.memory`` (the first NVML GPU's total, in MiB), ``gpu.passthrough`` (when any
    are bound to vfio-pci) and ``driver`` (the NVIDIA driver's version). Nothing before
    the first sample, nor while the GPU source fails without reading a GPU: a count of 0
    then would be a wrong claim, not a CPU node."""
    if sample is None or (sample.gpu_error and not sample.gpus):
        return {}
    passthrough = sample.passthrough_gpus
    found = {GPU_COUNT: str(len(sample.gpus) + len(passthrough))}
    names = [gpu.name for gpu in sample.gpus] + [gpu.name for gpu in passthrough]
    first = next((name for name in names if name), "")
    if first:
        found[GPU_PRODUCT] = product(first)
    if sample.gpus:
        found[GPU_MEMORY] = str(sample.gpus[0].memory_total // MIB)
    if passthrough:
        found[GPU_PASSTHROUGH] = str(len(passthrough))
    if sample.host is not None and sample.host.gpu_driver_version:
        found[DRIVER] = clean(sample.host.gpu_driver_version)
    return found


def cloud_labels(facts: CloudFacts) -> dict[str, str]:
    """The well-known labels of a node's cloud facts (empty ones left out)."""
    found = {
        "provider": facts.provider,
        "region": facts.region,
        "zone": facts.zone,
        "instance_type": facts.instance_type,
        "lifecycle": facts.lifecycle,
    }
    return {key: clean(value) for key, value in found.items() if value}


def found_labels(
    sample: Sample | None, cloud: Mapping[str, str], engine: Engine | None = None
) -> dict[str, str]:
    """The node's own labels: its identity (GPUs, cloud) and its served models."""
    labels = {**gpu_labels(sample), **cloud}
    models = served_models(engine)
    if models:
        labels[MODEL] = models
    return labels


def node_labels(given: Mapping[str, str], found: Mapping[str, str]) -> dict[str, str]:
    """The operator's labels, then the node's own under keys the operator did not set,
    at most MAX_LABELS (the operator's first)."""
    labels = dict(given)
    for key, value in found.items():
        if len(labels) >= MAX_LABELS:
            break
        labels.setdefault(key, value)
    return labels


def clashes(given: Mapping[str, str], found: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    """Keys the operator set whose value differs from what the node found:
    key -> (the operator's value, kept; the node's, left out)."""
    return {
        key: (given[key], value)
        for key, value in found.items()
        if key in given and given[key] != value
    }
