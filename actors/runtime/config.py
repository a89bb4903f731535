"""Layered configuration for any process: defaults < TOML file < ``<PREFIX><FIELD>``
environment variables < flags, into one msgspec Struct.

Everything is validated by msgspec in one place; a bad value becomes one line that names
the field (``ConfigError``), never a traceback.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, TypeVar

import msgspec
from msgspec import Meta

from schemas.errors import FleetError

DEFAULT_SERVER = "nats://127.0.0.1:4222"

Positive = Annotated[float, Meta(gt=0)]
Port = Annotated[int, Meta(ge=0, le=65535)]


class ConfigError(FleetError):
    """A configuration value is missing or invalid."""

    def __init__(self, message: str) -> None:
        super().__init__(f"config: {message}")


C = TypeVar("C", bound=msgspec.Struct)


def _list_fields(config_type: type[msgspec.Struct]) -> set[str]:
    return {
        field.name
        for field in msgspec.structs.fields(config_type)
        if str(field.type).startswith("list")
    }


def from_env(
    config_type: type[msgspec.Struct], env_prefix: str, env: Mapping[str, str]
) -> dict[str, Any]:
    """``<env_prefix><FIELD>`` values (lists comma-separated), plus ``NATS_URL`` for server."""
    names = {field.name for field in msgspec.structs.fields(config_type)}
    lists = _list_fields(config_type)
    values: dict[str, Any] = {}
    if "NATS_URL" in env and "server" in names:
        values["server"] = env["NATS_URL"]
    for key, raw in env.items():
        if not key.startswith(env_prefix):
            continue
        name = key[len(env_prefix) :].lower()
        if name not in names:
            raise ConfigError(f"unknown environment variable {key}")
        values[name] = [item for item in raw.split(",") if item] if name in lists else raw
    return values


def read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as handle:
            return tomllib.load(handle)
    except FileNotFoundError:
        raise ConfigError(f"file {path} not found") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"file {path} is not valid TOML: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"file {path}: {exc.strerror}") from None


def build(
    config_type: type[C],
    env_prefix: str,
    file: Path | None = None,
    env: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
) -> C:
    """Merge the layers and validate once; raise ConfigError naming the bad field."""
    merged: dict[str, Any] = {}
    if file is not None:
        merged.update(read_toml(file))
    merged.update(from_env(config_type, env_prefix, os.environ if env is None else env))
    merged.update({key: value for key, value in (flags or {}).items() if value is not None})
    try:
        return msgspec.convert(merged, config_type, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(_explain(str(exc))) from None


def _explain(message: str) -> str:
    """msgspec says 'Expected `int`, got `str` - at `$.port`'; say 'port: expected ...'."""
    match = re.match(r"(?s)(.*) - at `\$\.([^`\[]+)(.*)`$", message)
    if match:
        reason, field, rest = match.groups()
        return f"{field}{rest}: {reason[0].lower()}{reason[1:]}"
    if message.startswith("Object contains unknown field"):
        return message.replace("Object contains unknown field", "unknown setting")
    return message
