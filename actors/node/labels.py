"""The labels a node's heartbeat carries: the operator's, over the automatic ones (the
cloud's facts, the engines' served models). A helper of the heartbeat actor.

Automatic values are cleaned to the label charset and bounds (a model name with a space
becomes ``_``; one too long is cut), so a strange engine answer never costs a heartbeat.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from schemas.base import MAX_LABEL_VALUE, MAX_LABELS
from schemas.events import CloudFacts, Engine

MODEL = "model"
"""Well-known key: the served models of every engine, sorted, joined with ``+``."""
WELL_KNOWN = ("region", "zone", "instance_type", "lifecycle", MODEL)

_UNSAFE = re.compile(r"[^A-Za-z0-9._:/@+-]")


def clean(value: str) -> str:
    """``value`` in the label charset and bound."""
    return _UNSAFE.sub("_", value)[:MAX_LABEL_VALUE]


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


def cloud_labels(facts: CloudFacts) -> dict[str, str]:
    """The well-known labels of a node's cloud facts (empty ones left out)."""
    found = {
        "region": facts.region,
        "zone": facts.zone,
        "instance_type": facts.instance_type,
        "lifecycle": facts.lifecycle,
    }
    return {key: value for key, value in found.items() if value}


def node_labels(
    given: Mapping[str, str], engine: Engine | None, cloud: Mapping[str, str] | None = None
) -> dict[str, str]:
    """Automatic labels, then the operator's (which win), at most MAX_LABELS."""
    labels = {key: clean(value) for key, value in (cloud or {}).items() if value}
    models = served_models(engine)
    if models:
        labels[MODEL] = models
    labels.update(given)
    return dict(list(labels.items())[:MAX_LABELS])
