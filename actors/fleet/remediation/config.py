"""The remediation policy's file: every setting, checked as it is loaded (docs/remediation.md
says what each does)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import msgspec

from actors.runtime.config import ConfigError, Positive, build
from schemas.remediation import ReasonClass


class PolicyConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The policy file (TOML); every setting is documented in docs/remediation.md."""

    key_file: str
    """Operator seed the policy signs its commands with; nodes must trust its public key."""
    dry_run: bool = True
    clusters: list[str] = []
    """Clusters the policy acts on; empty: every cluster."""
    classes: list[ReasonClass] = msgspec.field(default_factory=lambda: ["gpu", "xid"])
    drain: bool = False
    """Drain (cordon, then wait for work) instead of only cordoning."""
    drain_deadline: Positive = 600.0
    recover_after: Positive = 300.0
    max_remediations: int = 3
    window: Positive = 86400.0
    breaker_percent: float = 10.0
    breaker_max: int = 20
    interval: Positive = 15.0
    grace: Positive = 60.0
    """How long a new hold waits for the node's heartbeat to show the policy's cordon."""
    hooks: dict[str, list[str]] = {}
    """Last-mile hooks by name (GPU reset, reboot, ticket): the command run on the
    aggregator, as a list (no shell), the node's facts in FLEET_* variables."""
    hook_after: dict[ReasonClass, list[str]] = {}
    """Hooks run in order on a node the policy took out for that reason class, once its
    cordon (or drain) took effect; the node is returned only after all succeeded."""
    reboot_hooks: list[str] = []
    """Hooks that reboot the node: done only once it beats with a new boot id."""
    hook_timeout: Positive = 300.0
    """Seconds a hook may run; then its process group is killed and the node needs
    attention."""
    reboot_confirm: Positive = 900.0
    """Seconds a reboot hook's node (or a hung node) has to come back with a new boot id."""
    hung_after: Positive = 600.0
    """With ``hung`` in ``classes``: seconds without a heartbeat after which a node that
    did not say goodbye is a ``hung`` case."""
    maintenance: Literal["skip", "act"] = "skip"
    """Nodes a maintenance window covers: ``skip`` them while it is in force, or ``act``
    on them as on any other (never as ``hung``)."""

    def __post_init__(self) -> None:
        if not 0 <= self.breaker_percent <= 100:
            raise ValueError("breaker_percent must be within 0 to 100")
        if self.breaker_max < 0 or self.max_remediations < 1:
            raise ValueError("breaker_max must be >= 0 and max_remediations >= 1")
        named = {name for names in self.hook_after.values() for name in names}
        unknown = sorted((named | set(self.reboot_hooks)) - set(self.hooks))
        if unknown:
            raise ValueError(f"hooks {', '.join(unknown)} are named but not in [hooks]")
        if any(not argv for argv in self.hooks.values()):
            raise ValueError("a hook's command is a non-empty list")


def load_policy(path: Path) -> PolicyConfig:
    """The policy file, checked (durations as in every setting: 300, 5m); ConfigError
    naming the file and what is wrong."""
    try:
        return build(PolicyConfig, "", file=path, env={})
    except ConfigError as exc:
        reason = str(exc).removeprefix("config: ")
        raise ConfigError(f"policy file {path}: {reason}") from None
