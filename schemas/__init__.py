"""The wire contract of nats-node-agent: message types, subjects, codec and signing.

Each name below is loaded from its module when first used (PEP 562), so a program that
needs one module of the contract (``schemas.errors``, ``schemas.subjects``) does not
import them all (every message type, nacl): the tools' start-up
(tests/bench/bench_startup.py).
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES: dict[str, str] = {
    "AGENT_VERSION": "schemas.version",
    **dict.fromkeys(("decode", "encode"), "schemas.codec"),
    **dict.fromkeys(
        ("DecodeError", "FleetError", "InvalidToken", "KeyFileError", "SignatureError"),
        "schemas.errors",
    ),
    **dict.fromkeys(
        (
            "Capacity",
            "Engine",
            "EngineStatus",
            "Gpu",
            "Health",
            "HealthCheck",
            "HealthComponent",
            "Inject",
            "Interruption",
            "Jobs",
            "Latency",
            "NodeState",
            "PeerLatency",
            "Sample",
            "SpotStatus",
            "XidCount",
        ),
        "schemas.events",
    ),
    **dict.fromkeys(
        (
            "Action",
            "Alert",
            "AlertKind",
            "Command",
            "CommandResult",
            "CommandStatus",
            "Cordon",
            "Deregister",
            "Drain",
            "Heartbeat",
            "NodeRecord",
            "Probe",
            "ProbeReply",
            "Registration",
            "RegistrationReply",
            "TrustEntry",
            "Uncordon",
        ),
        "schemas.messages",
    ),
    **dict.fromkeys(("KeyPair", "verify"), "schemas.signing"),
    **dict.fromkeys(("Subjects", "check_token"), "schemas.subjects"),
}
"""Each exported name and the module that defines it (import it from there, typed)."""


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'schemas' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


__all__ = sorted(_HOMES)
