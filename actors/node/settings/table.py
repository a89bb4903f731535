"""Which of the agent's settings the fleet may set, and how each takes effect.

Only tuning: intervals, timeouts, thresholds, which fleet peers to probe and the log
level. Nothing that says who the node is or how it connects (server, node id, cluster,
keys, TLS), whom it obeys (trusted operator keys, command lifetimes), or what it runs,
reads, fetches or opens (hooks, workload allow-lists, engine URLs, the gateway, HTTP
addresses, files): those stay in the node's own file, so an operator key can tune a node
through the fleet but never make it run, read, reach or trust anything its owner did not
configure.

``live`` settings change while the agent runs (the actors that read them take the
settings event); ``restart`` ones are read once at start and so take effect at the
agent's next start, which the node reports (``SettingsStatus.restart``).
"""

from __future__ import annotations

from typing import Final, Literal

Effect = Literal["live", "restart"]

FLEET_SETTABLE: Final[dict[str, Effect]] = {
    # The heartbeat actor.
    "heartbeat_interval": "live",
    "stale_after": "live",
    # The inventory (and the health actor's freshness of samples).
    "sample_interval": "live",
    # The health actor.
    "health_interval": "live",
    "clear_after_samples": "live",
    "expected_gpus": "live",
    "required_binaries": "live",
    "required_modules": "live",
    "xid_thresholds": "live",
    "gpu_thresholds": "live",
    # The engine prober's timing (not its targets: URLs the node would fetch and report).
    "engine_interval": "live",
    "engine_timeout": "live",
    # The latency prober (probe targets).
    "peers": "live",
    "max_peers": "live",
    "probe_interval": "live",
    "probe_timeout": "live",
    # The spot watcher and the Slurm reader.
    "spot_poll_interval": "live",
    "scheduler_interval": "live",
    "scheduler_timeout": "live",
    # The settings actor itself, and the process's log.
    "settings_interval": "live",
    "log_level": "live",
    # Read once, when the agent starts.
    "nvml_deadline": "restart",
    "spot_safety_margin": "restart",
    "hooks_timeout": "restart",
    "http_max_connections": "restart",
    "http_request_timeout": "restart",
    "shutdown_timeout": "restart",
    "shutdown_drain": "restart",
    "deregister_on_shutdown": "restart",
    "workload_ready_interval": "restart",
}
"""Every setting the fleet may set, and whether it changes live or at the next start."""

FLOORS: Final[dict[str, float]] = {
    "heartbeat_interval": 1.0,
    "sample_interval": 1.0,
    "health_interval": 1.0,
    "engine_interval": 1.0,
    "probe_interval": 1.0,
    "spot_poll_interval": 1.0,
    "scheduler_interval": 5.0,
    "settings_interval": 5.0,
    "workload_ready_interval": 0.1,
}
"""The shortest period the fleet may set, in seconds (a node's own file may set less): a
typo of ``1ms`` for ``1m`` sent to a whole fleet must not have every node beat, sample or
read the bucket a thousand times a second."""

ITEMIZED: Final = frozenset({"gpu_thresholds", "xid_thresholds"})
"""List settings of ``NAME=VALUE`` items the fleet may also set one item at a time
(``gpu_thresholds.temperature=88``): each item over the node's own list, so scopes that
set different items compose."""

LIVE: Final = tuple(name for name, effect in FLEET_SETTABLE.items() if effect == "live")

NOT_SETTABLE = "not settable from the fleet (the node's own file sets it)"
PINNED = "set on this node by a flag or its environment"
NO_ITEMS = "has no items (only gpu_thresholds and xid_thresholds do)"


def setting_of(key: str) -> str:
    """The setting a key names: ``gpu_thresholds`` for ``gpu_thresholds.temperature``."""
    return key.split(".", 1)[0]


def item_of(key: str) -> str:
    """The item a key names ("" for a whole setting)."""
    return key.partition(".")[2]


def why_not(key: str, pinned: frozenset[str]) -> str:
    """Why the fleet may not set ``key`` on a node whose flags and environment set
    ``pinned`` ("" when it may)."""
    name = setting_of(key)
    if name not in FLEET_SETTABLE:
        return NOT_SETTABLE
    if item_of(key) and name not in ITEMIZED:
        return NO_ITEMS
    if name in pinned:
        return PINNED
    return ""
