"""Agent configuration: defaults < TOML file < ``NODE_AGENT_*`` environment < flags.

Everything is validated by msgspec in one place; a bad value becomes one line that names
the field (``ConfigError``), never a traceback.
"""

from __future__ import annotations

import os
import re
import socket
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import Meta

from schemas.base import Cluster, NodeId
from schemas.errors import FleetError
from schemas.subjects import TOKEN_PATTERN, is_token

ENV_PREFIX = "NODE_AGENT_"
DEFAULT_SERVER = "nats://127.0.0.1:4222"

Positive = Annotated[float, Meta(gt=0)]
Port = Annotated[int, Meta(ge=0, le=65535)]
EngineSpec = Annotated[str, Meta(pattern=r"^(vllm|sglang|llamacpp)=https?://\S+$")]
PeerId = Annotated[str, Meta(pattern=TOKEN_PATTERN)]
XID_THRESHOLD_PATTERN = r"^\d+=\d+/\d+(\.\d+)?$"
"""CODE=COUNT/WINDOW_S, e.g. 13=5/600 (read by actors.xid)."""
XidThreshold = Annotated[str, Meta(pattern=XID_THRESHOLD_PATTERN)]


class ConfigError(FleetError):
    """A configuration value is missing or invalid."""

    def __init__(self, message: str) -> None:
        super().__init__(f"config: {message}")


def default_state_dir() -> str:
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return str(Path(base) / "node-agent")


def default_node_id() -> str:
    host = socket.gethostname().split(".")[0]
    cleaned = re.sub(r"[^A-Za-z0-9_-]", "-", host)[:64]
    return cleaned if is_token(cleaned) else "node"


class AgentConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Every setting of ``node-agent start``; each is a flag, an env var and a TOML key."""

    server: str = DEFAULT_SERVER
    node_id: NodeId = msgspec.field(default_factory=default_node_id)
    cluster: Cluster = "default"
    state_dir: str = msgspec.field(default_factory=default_state_dir)
    key_file: str = ""
    """Node nkey seed; empty means ``<state_dir>/node.nk``."""
    nkey_auth: bool = False
    """Authenticate to NATS with the node key (servers configured as in deploy/nats/auth)."""
    prefix: str = "fleet"
    connect_timeout: Positive = 5.0
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    heartbeat_interval: Positive = 10.0
    stale_after: Positive = 30.0
    sample_interval: Positive = 5.0
    health_interval: Positive = 5.0

    fake_gpus: Annotated[int, Meta(ge=0, le=64)] | None = None
    """None: NVML when present, else simulated GPUs. 0: no GPUs."""
    expected_gpus: Annotated[int, Meta(ge=0)] | None = None
    required_binaries: list[str] = []
    required_modules: list[str] = []

    engines: list[EngineSpec] = []
    engine_interval: Positive = 5.0
    engine_timeout: Positive = 2.0

    peers: list[PeerId] = []
    max_peers: Annotated[int, Meta(ge=0)] = 8
    probe_interval: Positive = 10.0
    probe_timeout: Positive = 1.0

    http_host: str = "127.0.0.1"
    http_port: Port = 9091

    trust_operators: list[str] = []
    trust_operators_file: str = ""
    hooks_timeout: Positive = 30.0
    on_cordon: str = ""
    on_drain: str = ""
    on_drained: str = ""
    on_uncordon: str = ""

    spot_provider: Literal["aws", "gcp", "azure", "auto", "none"] = "none"
    metadata_url: str = ""
    spot_poll_interval: Positive = 1.0
    spot_safety_margin: Annotated[float, Meta(ge=0)] = 15.0

    deregister_on_shutdown: bool = False
    shutdown_timeout: Positive = 10.0

    clear_after_samples: Annotated[int, Meta(ge=1)] = 3
    """Good samples in a row before a health condition clears (hysteresis)."""
    xid_thresholds: list[XidThreshold] = []
    """Per-code XID threshold overrides, CODE=COUNT/WINDOW_S: "13=5/600" makes XID 13 a
    finding at 5 occurrences on one GPU within 600 s (defaults in actors/xid.py)."""
    xid_log_path: str = "/dev/kmsg"
    """Kernel log read for XIDs on GPUs whose NVML events are unavailable; "" disables."""

    def __post_init__(self) -> None:
        if self.stale_after <= self.heartbeat_interval:
            raise ValueError(
                f"stale_after ({self.stale_after:g}s) must be longer than "
                f"heartbeat_interval ({self.heartbeat_interval:g}s)"
            )
        if self.stale_after < 1:
            raise ValueError("stale_after must be at least 1 second (Nats-TTL granularity)")

    @property
    def key_path(self) -> Path:
        return Path(self.key_file) if self.key_file else Path(self.state_dir) / "node.nk"


C = TypeVar("C", bound=msgspec.Struct)


def _list_fields(config_type: type[msgspec.Struct]) -> set[str]:
    return {
        field.name
        for field in msgspec.structs.fields(config_type)
        if str(field.type).startswith("list")
    }


def from_env(config_type: type[msgspec.Struct], env: Mapping[str, str]) -> dict[str, Any]:
    """``NODE_AGENT_<FIELD>`` values (lists comma-separated), plus ``NATS_URL`` for server."""
    names = {field.name for field in msgspec.structs.fields(config_type)}
    lists = _list_fields(config_type)
    values: dict[str, Any] = {}
    if "NATS_URL" in env and "server" in names:
        values["server"] = env["NATS_URL"]
    for key, raw in env.items():
        if not key.startswith(ENV_PREFIX):
            continue
        name = key[len(ENV_PREFIX) :].lower()
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
    file: Path | None = None,
    env: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
) -> C:
    """Merge the layers and validate once; raise ConfigError naming the bad field."""
    merged: dict[str, Any] = {}
    if file is not None:
        merged.update(read_toml(file))
    merged.update(from_env(config_type, os.environ if env is None else env))
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
