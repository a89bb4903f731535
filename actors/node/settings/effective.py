"""What a node runs with, given the fleet's entries it holds: every fleet value judged by
the rules of the node's own config, through the same layered loader.

Precedence, weakest first: defaults and the node's file, the fleet's entries in
:func:`schemas.settings.in_force`'s order (fleet, cluster, selectors), then the node's
environment and flags. A key is refused, and reported with why, when the fleet may not
set it (:mod:`.table`), when the node's flags or environment set it, or when the config
refuses its value, alone (or under the fleet's floor) or beside the rest of the node's
settings (a ``heartbeat_interval`` not below the ``stale_after`` the node's file sets,
say): that key is refused and the rest taken.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import msgspec

from actors.node.config import AgentConfig
from actors.node.gpu.thresholds import parse_gpu_thresholds
from actors.node.settings.table import (
    FLEET_SETTABLE,
    FLOORS,
    ITEMIZED,
    LIVE,
    item_of,
    setting_of,
    why_not,
)
from actors.runtime.config import ConfigError, Layers, did_you_mean, split_items
from schemas.base import MAX_NAME
from schemas.settings import (
    InForce,
    LiveValue,
    SettingsEntry,
    SettingsStatus,
    in_force,
    reaches,
)


class Outcome(NamedTuple):
    """One judgment of the fleet's settings for this node."""

    config: AgentConfig
    """The node's config with every value taken, those for the next start included."""
    status: SettingsStatus
    live: dict[str, LiveValue]
    """The value of each live setting in ``config``."""


def judge(
    layers: Layers[AgentConfig],
    entries: Iterable[tuple[str, SettingsEntry]],
    labels: Mapping[str, str],
    started: AgentConfig | None = None,
) -> Outcome:
    """Judge ``entries`` for a node with these ``layers`` and ``labels``. ``started``:
    the config the agent started with (a value read only at start that differs from it
    waits for the next start); None at the start itself."""
    own = layers.build()
    entries = list(entries)
    reaching = [entry for _, entry in entries if reaches(entry, own.cluster, labels)]
    force = in_force(entries, own.cluster, labels)
    refused: dict[str, str] = {}
    candidates: dict[str, str] = {}
    pinned = layers.pinned()
    for key, found in sorted(force.items()):
        why = why_not(key, pinned)
        if why:
            refused[key] = why
        else:
            candidates[key] = found.value
    taken, not_valid = _valid(layers, own, candidates)
    refused.update(not_valid)
    config = layers.build(pushed(taken, own))
    applied, restart = _in_effect(taken, force, config, started)
    status = SettingsStatus(
        revision=max((entry.revision for entry in reaching), default=0),
        applied=applied,
        restart=restart,
        refused={key: refused[key] for key in sorted(refused)},
    )
    live = {name: msgspec.to_builtins(getattr(config, name)) for name in LIVE}
    return Outcome(config, status, live)


def value_refusal(key: str, value: str) -> str:
    """Why every node refuses ``value`` for ``key`` ("" when a node may take it): the
    fleet may not set it, or the value fails its setting's own type, bounds or items.
    What ``fleetctl settings set`` checks before it signs; a node also checks the value
    against the rest of its config (a ``stale_after`` not above its
    ``heartbeat_interval``)."""
    name = setting_of(key)
    if name not in _FIELDS:
        return "not a setting of node-agent" + did_you_mean(name, FLEET_SETTABLE)
    return why_not(key, frozenset()) or _alone(key, value)


_FIELDS = {field.name: field for field in msgspec.structs.fields(AgentConfig)}


@functools.cache
def _one_setting(name: str) -> Layers[msgspec.Struct]:
    """A config of setting ``name`` alone, made once per setting (the loader keeps what
    it learns of each type)."""
    alone = msgspec.defstruct("FleetValue", [(name, _FIELDS[name].type)], kw_only=True)
    return Layers(alone, {}, {}, {})


@functools.cache
def _defaults() -> AgentConfig:
    return AgentConfig()


def _alone(key: str, value: str) -> str:
    """Why ``value`` fails its setting's own type, bounds or items, whatever the rest of
    the config ("" if it does not)."""
    name = setting_of(key)
    try:
        taken = _one_setting(name).build(pushed({key: value}, _defaults()))
        if name == "gpu_thresholds":
            parse_gpu_thresholds(getattr(taken, name))
    except ConfigError as exc:
        return str(exc).removeprefix("config: ")[:MAX_NAME]
    except ValueError as exc:
        return str(exc)[:MAX_NAME]
    floor = FLOORS.get(name)
    if floor is not None and getattr(taken, name) < floor:
        return f"{name}: below {floor:g}s, the shortest the fleet may set"
    return ""


def pushed(values: Mapping[str, str], own: AgentConfig) -> dict[str, Any]:
    """The fleet's layer of the config from ``values``: whole settings as written, and
    items (``gpu_thresholds.temperature=88``) over the list the node would run with
    otherwise (the fleet's whole list, else its own), replacing the item of that name."""
    layer: dict[str, Any] = {key: value for key, value in values.items() if not item_of(key)}
    for name in ITEMIZED:
        items = {
            item_of(key): value
            for key, value in values.items()
            if setting_of(key) == name and item_of(key)
        }
        if not items:
            continue
        given = layer.get(name)
        base: list[str] = getattr(own, name) if given is None else _items(name, given)
        merged = {item.partition("=")[0]: item for item in base}
        merged.update({item: f"{item}={value}" for item, value in items.items()})
        layer[name] = list(merged.values())
    return layer


def _items(name: str, value: str) -> list[str]:
    return split_items(name, value) if value.strip() else []


def _valid(
    layers: Layers[AgentConfig], own: AgentConfig, candidates: dict[str, str]
) -> tuple[dict[str, str], dict[str, str]]:
    """(taken, refused with why): the values that fail on their own (their type, bounds or
    the fleet's floor, which the config alone would not refuse) never; the rest all
    together if the config takes them so; else added one by one, twice round (a value that
    needs another, ``heartbeat_interval`` a raised ``stale_after``, gets its chance once
    the other is in)."""
    refused = {key: why for key, value in candidates.items() if (why := _alone(key, value))}
    rest = {key: value for key, value in candidates.items() if key not in refused}
    if not _refusal(layers, own, rest):
        return rest, refused
    taken: dict[str, str] = {}
    waiting = list(rest)
    for _ in range(2):
        later = []
        for key in waiting:
            why = _refusal(layers, own, {**taken, key: rest[key]})
            if why:
                later.append(key)
                refused[key] = why
            else:
                taken[key] = rest[key]
                refused.pop(key, None)
        waiting = later
    return taken, refused


def _refusal(layers: Layers[AgentConfig], own: AgentConfig, values: dict[str, str]) -> str:
    """Why the config refuses ``values`` over the node's own ("" if it takes them)."""
    try:
        layers.build(pushed(values, own))
    except ConfigError as exc:
        return str(exc).removeprefix("config: ")[:MAX_NAME]
    return ""


def _in_effect(
    taken: Mapping[str, str],
    force: Mapping[str, InForce],
    config: AgentConfig,
    started: AgentConfig | None,
) -> tuple[dict[str, str], list[str]]:
    """(applied: key -> its entry's bucket key; keys waiting for the next start: taken
    ones whose value differs from the one the agent started with, and settings the fleet
    no longer sets that still run with its value)."""
    applied: dict[str, str] = {}
    restart: list[str] = []

    def waits(name: str) -> bool:
        at_start = FLEET_SETTABLE[name] == "restart" and started is not None
        return at_start and getattr(started, name) != getattr(config, name)

    for key in sorted(taken):
        if waits(setting_of(key)):
            restart.append(key)
        else:
            applied[key] = force[key].source
    names = {setting_of(key) for key in taken}
    restart += [name for name in FLEET_SETTABLE if name not in names and waits(name)]
    return applied, restart
