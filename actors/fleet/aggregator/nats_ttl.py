"""How long a heartbeat's ``Nats-TTL`` header lets FLEET_HB keep it: the server deletes a
heartbeat (and drops the TTL marker that says its node is gone) once its TTL runs out, so
a TTL that is ``never``, or longer than any node may claim, would keep a dead node alive."""

from __future__ import annotations

import re

_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?)(ns|us|µs|ms|s|m|h)")
_UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def ttl_within(value: str | None, limit: float) -> bool:
    """Whether a heartbeat's ``Nats-TTL`` header lets the server expire it (and drop the TTL
    marker that says the node is gone) within ``limit`` seconds: whole seconds or a Go
    duration (``30s``, ``1m30s``) as nats-server reads them, not ``never``. No header is
    let through (the stream keeps such a heartbeat until the next one: only the full sweep
    finds the node silent, by the aggregator's own bound)."""
    if value is None:
        return True
    value = value.strip()
    if value.isdigit():
        return int(value) <= limit
    parts = _DURATION_PART.findall(value)
    if not parts or "".join(number + unit for number, unit in parts) != value:
        return False  # "never", or nothing nats-server reads as a duration
    return sum(float(number) * _UNIT_SECONDS[unit] for number, unit in parts) <= limit
