"""How an actor takes the fleet's live settings: the one place a ``Settings`` event (from
the node's settings actor, on ``fleet.evt.<node>.settings``) becomes the config the actor
runs with. The event holds every live setting's value, so taking it is the same whenever
it comes, and an actor started (or restarted) after a change learns it from the next one.
"""

from __future__ import annotations

import logging

import msgspec

from actors.node.config import AgentConfig
from schemas.settings import Settings

log = logging.getLogger(__name__)


def retuned(config: AgentConfig, event: Settings) -> AgentConfig:
    """``config`` with ``event``'s live values; ``config`` itself when they change nothing
    (so ``is not`` tells an actor to rebuild what it derived from its settings)."""
    current = msgspec.to_builtins(config)
    changes = {
        name: value
        for name, value in event.live.items()
        if name in current and current[name] != value
    }
    if not changes:
        return config
    try:
        return msgspec.convert({**current, **changes}, AgentConfig, strict=False)
    except msgspec.ValidationError as exc:
        # The settings actor judged these values with the same rules; keep running.
        log.error("live settings not taken", extra={"reason": str(exc)})
        return config
