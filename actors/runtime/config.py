"""Layered configuration for any process: defaults < TOML file < ``<PREFIX><FIELD>``
environment variables < flags, into one msgspec Struct; values pushed to a running process
(the node's fleet settings) go over the file and under the environment (:class:`Layers`).

Everything is validated by msgspec in one place; a bad value becomes one line that names
the field (``ConfigError``), never a traceback.
"""

from __future__ import annotations

import difflib
import functools
import logging
import os
import re
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Generic, TypeVar

import msgspec
from msgspec import Meta

from actors.runtime.durations import DurationError, parse_duration
from schemas.errors import FleetError
from schemas.file_modes import warn_if_exposed

log = logging.getLogger(__name__)

DEFAULT_SERVER = "nats://127.0.0.1:4222"

DURATION = {"duration": True}
"""The mark of a duration setting (``Meta.extra``): :func:`build` reads ``30``, ``30s``,
``500ms``, ``2m``, ``1h`` or ``1d`` there, as seconds."""
Duration = Annotated[float, Meta(gt=0, extra=DURATION)]
"""Seconds above 0, written as people write them (see :func:`parse_duration`)."""
NonNegativeDuration = Annotated[float, Meta(ge=0, extra=DURATION)]
Positive = Duration
"""Every positive float setting so far is a duration; a new one that is not should use
``Annotated[float, Meta(gt=0)]``."""
Port = Annotated[int, Meta(ge=0, le=65535)]


class ConfigError(FleetError):
    """A configuration value is missing or invalid."""

    def __init__(self, message: str) -> None:
        super().__init__(f"config: {message}")


C = TypeVar("C", bound=msgspec.Struct)


def _is_duration(kind: msgspec.inspect.Type) -> bool:
    if isinstance(kind, msgspec.inspect.UnionType):
        return any(_is_duration(member) for member in kind.types)
    return isinstance(kind, msgspec.inspect.Metadata) and bool((kind.extra or {}).get("duration"))


@functools.cache
def _struct_info(config_type: type[msgspec.Struct]) -> msgspec.inspect.StructType:
    """``config_type``'s fields as msgspec sees them, worked out once per type: a parser
    asks for every flag of every command (node-agent's took 2 s to build without it)."""
    info = msgspec.inspect.type_info(config_type)
    assert isinstance(info, msgspec.inspect.StructType)
    return info


@functools.cache
def duration_fields(config_type: type[msgspec.Struct]) -> frozenset[str]:
    """The settings of ``config_type`` typed :data:`Duration` (or NonNegativeDuration)."""
    return frozenset(
        field.name for field in _struct_info(config_type).fields if _is_duration(field.type)
    )


def _dict_fields(config_type: type[msgspec.Struct]) -> frozenset[str]:
    """Mapping settings (``labels``), bounded (Annotated) or not."""
    return _fields_of_kind(config_type, msgspec.inspect.DictType)


def key_values(name: str, items: list[Any]) -> dict[str, str]:
    """``["k=v", ...]`` (repeated flags, a comma-separated variable) as a mapping."""
    found: dict[str, str] = {}
    for item in items:
        key, sep, value = str(item).partition("=")
        if not sep or not key:
            raise ConfigError(f"{name}: {item!r} is not KEY=VALUE")
        found[key.strip()] = value.strip()
    return found


@functools.cache
def _fields_of_kind(config_type: type[msgspec.Struct], kind: type) -> frozenset[str]:
    """Settings whose type is ``kind`` (a msgspec.inspect type), bounded (Annotated) or
    not, alone or in a union with None; worked out once per type, as :func:`_struct_info`
    (every flag's help asks)."""
    found = set()
    for field in _struct_info(config_type).fields:
        members = (
            field.type.types if isinstance(field.type, msgspec.inspect.UnionType) else (field.type,)
        )
        for member in members:
            if isinstance(member, msgspec.inspect.Metadata):
                member = member.type
            if isinstance(member, kind):
                found.add(field.name)
    return frozenset(found)


def list_fields(config_type: type[msgspec.Struct]) -> frozenset[str]:
    """Settings given as items: lists, and mappings as ``KEY=VALUE`` items (``labels``).
    A variable or a flag gives them comma-separated, a flag also repeated (a bounded list,
    ``engines``, was missed when this looked at the annotation's text)."""
    return _fields_of_kind(config_type, msgspec.inspect.ListType) | _dict_fields(config_type)


def split_items(name: str, given: str | list[str]) -> list[str]:
    """The items of a list setting as a variable (``a,b``) or a flag gives them (each
    repeat of the flag comma-separated too: ``--peer a,b --peer c``), the one reader of
    both. An empty item (``a,,b``, a trailing comma, ``--peer ''``) is a ConfigError: it
    is a typo, not a value, and dropping it silently would hide which one was meant."""
    items: list[str] = []
    for value in [given] if isinstance(given, str) else given:
        parts = str(value).split(",")
        if not all(part.strip() for part in parts):
            raise ConfigError(
                f"{name}: {value!r} has an empty item; give items comma-separated "
                "(a,b) or repeat the flag"
            )
        items.extend(part.strip() for part in parts)
    return items


def from_env(
    config_type: type[msgspec.Struct], env_prefix: str, env: Mapping[str, str]
) -> dict[str, Any]:
    """``<env_prefix><FIELD>`` values (lists comma-separated), plus ``NATS_URL`` for server."""
    names = {field.name for field in msgspec.structs.fields(config_type)}
    lists = list_fields(config_type)
    values: dict[str, Any] = {}
    if "NATS_URL" in env and "server" in names:
        values["server"] = env["NATS_URL"]
    for key, raw in env.items():
        if not key.startswith(env_prefix):
            continue
        name = key[len(env_prefix) :].lower()
        if name not in names:
            close = difflib.get_close_matches(name, sorted(names), n=1)
            hint = f"; did you mean {env_prefix}{close[0].upper()}?" if close else ""
            raise ConfigError(f"unknown environment variable {key}{hint}")
        if name in lists:
            # An empty variable is an empty list (how a unit file clears a setting).
            values[name] = split_items(key, raw) if raw.strip() else []
        else:
            values[name] = raw
    return values


def read_keys(keys: list[str], file: str) -> set[str]:
    """``keys`` plus the lines of ``file`` (blank lines and ``#`` comments skipped), read
    at each call so a key can be added or removed without a restart; an unreadable file
    is logged and adds nothing."""
    found = set(keys)
    if file:
        try:
            text = Path(file).read_text()
        except OSError as exc:
            log.error("cannot read key file", extra={"file": file, "reason": str(exc)})
            return found
        warn_if_exposed(Path(file), "steering")
        found.update(line.strip() for line in text.splitlines() if line.strip()[:1] not in "#")
    return found


def read_toml(path: Path) -> dict[str, Any]:
    """A TOML file of settings (``--config``, fleetctl's contexts, a policy), warned about
    when group or others may write it (:mod:`schemas.file_modes`)."""
    try:
        with path.open("rb") as handle:
            found = tomllib.load(handle)
    except FileNotFoundError:
        raise ConfigError(f"file {path} not found") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"file {path} is not valid TOML: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"file {path}: {exc.strerror}") from None
    warn_if_exposed(path, "steering")
    return found


def build(
    config_type: type[C],
    env_prefix: str,
    file: Path | None = None,
    env: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
    base: Mapping[str, Any] | None = None,
) -> C:
    """Merge the layers and validate once; raise ConfigError naming the bad field.
    ``base`` lies under the file (fleetctl's context)."""
    return layers(config_type, env_prefix, file, env, flags, base).build()


def layers(
    config_type: type[C],
    env_prefix: str,
    file: Path | None = None,
    env: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
    base: Mapping[str, Any] | None = None,
) -> Layers[C]:
    """The layers :func:`build` merges, the file read (once) and the environment taken
    now, kept to be merged again under pushed values (:meth:`Layers.build`)."""
    below: dict[str, Any] = dict(base or {})
    if file is not None:
        below.update(read_toml(file))
    given_env = from_env(config_type, env_prefix, os.environ if env is None else env)
    lists = list_fields(config_type)
    given_flags = {
        key: split_items(key, value) if key in lists else value
        for key, value in (flags or {}).items()
        if value is not None
    }
    return Layers(config_type, below, given_env, given_flags)


@dataclass(frozen=True)
class Layers(Generic[C]):
    """Where one process's settings come from, weakest first: defaults, ``below`` (the
    context and the file), then values pushed to the process at run time (fleet
    settings), then its environment and its flags. Kept, so pushed values are judged by
    the same rules as the rest and never beat what was set for this process itself."""

    config_type: type[C]
    below: Mapping[str, Any]
    env: Mapping[str, Any]
    """The environment's values, lists already split into items."""
    flags: Mapping[str, Any]
    """The flags given, lists already split into items."""

    @classmethod
    def of(cls, config: C) -> Layers[C]:
        """The layers of a config built in code (tests, ``fleetctl up``): all of it is
        ``below``."""
        return cls(type(config), msgspec.to_builtins(config), {}, {})

    def pinned(self) -> frozenset[str]:
        """Settings the environment or a flag sets: no pushed value changes them."""
        return frozenset(self.env) | frozenset(self.flags)

    def build(self, pushed: Mapping[str, Any] | None = None) -> C:
        """The layers merged, over ``pushed`` values written as text (``10s``, ``a,b``)
        or as the setting's type, and validated once; ConfigError names a bad field."""
        lists = list_fields(self.config_type)
        over = {
            key: (split_items(key, value) if value.strip() else [])
            if key in lists and isinstance(value, str)
            else value
            for key, value in (pushed or {}).items()
        }
        merged: dict[str, Any] = {**self.below, **over, **self.env, **self.flags}
        return _validated(self.config_type, merged)


def _validated(config_type: type[C], merged: dict[str, Any]) -> C:
    """``merged`` as ``config_type``: mappings given as items, durations parsed, derived
    defaults filled where no layer set them, then msgspec's checks; ConfigError names a
    bad field."""
    for name in _dict_fields(config_type):
        if isinstance(merged.get(name), list):
            merged[name] = key_values(name, merged[name])
    for name in duration_fields(config_type) & merged.keys():
        if merged[name] is not None:
            try:
                merged[name] = parse_duration(merged[name])
            except DurationError as exc:
                raise ConfigError(f"{name}: {exc}") from None
    derived: Mapping[str, tuple[str, float]] = getattr(config_type, "derived_defaults", {})
    for name, (source, factor) in derived.items():
        # A default that follows another setting: stale_after is 3 x heartbeat_interval
        # unless set, so --heartbeat-interval 30 alone is valid.
        if name not in merged and isinstance(merged.get(source), int | float):
            merged[name] = merged[source] * factor
    try:
        return msgspec.convert(merged, config_type, strict=False)
    except msgspec.ValidationError as exc:
        message = _explain(str(exc))
        unknown = re.fullmatch(r"unknown setting `(.+)`", message)
        if unknown:
            names = {field.name for field in msgspec.structs.fields(config_type)}
            message += did_you_mean(unknown.group(1), names)
        raise ConfigError(message) from None


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """``"; did you mean 'server'?"`` for the closest of ``choices`` (difflib), else ""."""
    close = difflib.get_close_matches(word, sorted(choices), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def _explain(message: str) -> str:
    """msgspec says 'Expected `int`, got `str` - at `$.port`'; say 'port: expected ...'."""
    match = re.match(r"(?s)(.*) - at `\$\.([^`\[]+)(.*)`$", message)
    if match:
        reason, field, rest = match.groups()
        return f"{field}{rest}: {reason[0].lower()}{reason[1:]}"
    if message.startswith("Object contains unknown field"):
        return message.replace("Object contains unknown field", "unknown setting")
    return message
