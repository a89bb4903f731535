"""Fleet settings on the wire: what an operator signs into KV ``fleet_settings``, and what a
node says it made of them (its heartbeat's ``settings``, and the ``settings`` event its
own actors take live values from).

The bucket's keys are scopes: ``fleet`` (every node), ``cluster.<cluster>`` and
``selector.<digest>`` (nodes whose labels hold every pair of the entry's selector; the
digest is of the selector's canonical text, which the entry itself carries). Each value
is one :class:`SettingsEntry`, signed by an operator key (``Fleet-Key``/``Fleet-Sig``
headers over the stored bytes), naming its own scope and a ``revision`` that only grows:
a node takes an entry only when its signer is one of its operator keys, its scope is the
key it is stored under, and its revision is above the one it holds for that key, so an
older entry stored again (a replay) never undoes a newer one.

Precedence, weakest first: the node's own file (and defaults), ``fleet``, its cluster's
entry, matching selectors (one naming more labels over one naming fewer; between equals,
the higher revision), then the node's environment and flags, which the fleet never
overrides (:func:`in_force` orders the fleet's part; the node does the rest).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import Annotated, Final, Literal, NamedTuple

from msgspec import Meta

from schemas.base import (
    MAX_NAME,
    MAX_PEERS,
    SIGNED_TYPE,
    Labels,
    Name,
    Seq,
    Text,
    UnixTime,
    Wire,
)
from schemas.selectors import matches

Scope = Literal["fleet", "cluster", "selector"]
FLEET_KEY: Final = "fleet"
"""The bucket key of the fleet-wide entry."""
MAX_SETTINGS: Final = 64
"""Keys one entry sets, and keys a node reports applied, waiting or refused."""
MAX_SETTING_VALUE: Final = 4096
"""Characters of one value as the operator wrote it (a list comma-separated)."""
SETTING_KEY_PATTERN: Final = r"^[a-z][a-z0-9_]{0,63}(\.[A-Za-z0-9_]{1,64})?$"
"""A setting's name, or ``<list setting>.<item name>`` for one item of a list of
``NAME=VALUE`` items (``gpu_thresholds.temperature``)."""
SettingKey = Annotated[str, Meta(pattern=SETTING_KEY_PATTERN, max_length=129)]
SettingValue = Annotated[str, Meta(max_length=MAX_SETTING_VALUE)]
SourceKey = Annotated[str, Meta(max_length=MAX_NAME)]
"""The bucket key of the entry a value came from (``fleet``, ``cluster.gpu-a``,
``selector.<digest>``)."""
ClusterName = Annotated[str, Meta(pattern=r"^([A-Za-z0-9_-]{1,64})?$")]
"""A cluster, or "" (an entry of another scope)."""
LiveItem = Annotated[str, Meta(max_length=MAX_SETTING_VALUE)]
LiveValue = (
    Annotated[str, Meta(max_length=MAX_SETTING_VALUE)]
    | int
    | float
    | bool
    | Annotated[list[LiveItem], Meta(max_length=MAX_PEERS)]
    | None
)
"""One setting's value as the agent holds it (a number, a flag, a text, a list of texts,
or none)."""


class SettingsEntry(Wire, frozen=True, kw_only=True, tag_field=SIGNED_TYPE, tag="settings"):
    """One scope's settings (``fleetctl settings set``): KV bucket ``fleet_settings``, key
    :func:`entry_key`, signed by an operator key. Values are text as operators write
    them (``10s``, ``88``, ``a,b`` for a list) and are judged by each node with the rules
    of its own config; an entry holds every value of its scope (a change writes the whole
    entry again, at a higher revision)."""

    scope: Scope
    revision: Annotated[int, Meta(ge=1, le=2**63 - 1)]
    """Above every revision the bucket held when it was written; a node takes an entry
    for a key only above the revision it holds for that key."""
    issued_at: UnixTime
    values: Annotated[dict[SettingKey, SettingValue], Meta(max_length=MAX_SETTINGS)] = {}
    cluster: ClusterName = ""
    """The cluster (scope ``cluster``)."""
    selector: Labels = {}
    """Label pairs a node must all hold (scope ``selector``)."""
    reason: Text = ""
    """Why, as the operator said (``--reason``)."""


class SettingsStatus(Wire, frozen=True, kw_only=True):
    """What a node made of the fleet's settings: in its heartbeat (``settings``)."""

    revision: Seq = 0
    """The highest revision among the entries that reach this node (0: none)."""
    applied: Annotated[dict[SettingKey, SourceKey], Meta(max_length=MAX_SETTINGS)] = {}
    """Each key the fleet sets here and the node runs with, and the entry it came from."""
    restart: Annotated[list[SettingKey], Meta(max_length=MAX_SETTINGS)] = []
    """Keys taken but in force only from the agent's next start."""
    refused: Annotated[dict[SettingKey, Name], Meta(max_length=MAX_SETTINGS)] = {}
    """Keys the node does not take, and why (a value its config refuses, a setting the
    fleet may not set, one set on the node by a flag or its environment)."""


class Settings(Wire, frozen=True, kw_only=True):
    """The node's settings as its actors run with them: ``fleet.evt.<node>.settings``,
    published by the settings actor on every read of the bucket."""

    ts: UnixTime
    status: SettingsStatus
    live: Annotated[dict[SettingKey, LiveValue], Meta(max_length=MAX_SETTINGS)] = {}
    """The value of every setting that changes without a restart, from whatever source."""


class InForce(NamedTuple):
    """One key's value as the fleet's entries set it for a node, and where it comes from."""

    value: str
    source: str
    """The entry's bucket key."""
    revision: int


def selector_text(selector: Mapping[str, str]) -> str:
    """The canonical text of a selector: ``k=v`` pairs sorted by key, comma-joined."""
    return ",".join(f"{key}={selector[key]}" for key in sorted(selector))


def cluster_key(cluster: str) -> str:
    return f"cluster.{cluster}"


def selector_key(selector: Mapping[str, str]) -> str:
    """A selector's bucket key: its canonical text's SHA-256, 32 hex digits (label values
    hold characters a key may not)."""
    digest = hashlib.sha256(selector_text(selector).encode()).hexdigest()[:32]
    return f"selector.{digest}"


def entry_key(entry: SettingsEntry) -> str:
    """The key ``entry`` belongs under; ValueError when its scope's field is missing or
    another scope's is set."""
    if entry.scope == "fleet" and not entry.cluster and not entry.selector:
        return FLEET_KEY
    if entry.scope == "cluster" and entry.cluster and not entry.selector:
        return cluster_key(entry.cluster)
    if entry.scope == "selector" and entry.selector and not entry.cluster:
        return selector_key(entry.selector)
    raise ValueError(f"a {entry.scope} entry with cluster={entry.cluster!r} and a selector")


def reaches(entry: SettingsEntry, cluster: str, labels: Mapping[str, str]) -> bool:
    """Whether ``entry`` is for a node of ``cluster`` with ``labels``."""
    if entry.scope == "cluster":
        return entry.cluster == cluster
    if entry.scope == "selector":
        return matches(labels, entry.selector.items())
    return True


def _rank(keyed: tuple[str, SettingsEntry]) -> tuple[int, int, int]:
    entry = keyed[1]
    order = {"fleet": 0, "cluster": 1, "selector": 2}[entry.scope]
    return order, len(entry.selector), entry.revision


def in_force(
    entries: Iterable[tuple[str, SettingsEntry]], cluster: str, labels: Mapping[str, str]
) -> dict[str, InForce]:
    """Every key the ``(bucket key, entry)`` pairs set for a node of ``cluster`` with
    ``labels``, from the strongest entry that sets it."""
    found: dict[str, InForce] = {}
    reaching = [keyed for keyed in entries if reaches(keyed[1], cluster, labels)]
    for key, entry in sorted(reaching, key=_rank):
        for name, value in entry.values.items():
            found[name] = InForce(value, key, entry.revision)
    return found


__all__ = [
    "FLEET_KEY",
    "MAX_SETTINGS",
    "InForce",
    "Scope",
    "Settings",
    "SettingsEntry",
    "SettingsStatus",
    "cluster_key",
    "entry_key",
    "in_force",
    "reaches",
    "selector_key",
    "selector_text",
]
