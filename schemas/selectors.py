"""What a label selector means, for every reader of one: ``key=value`` pairs that all have
to hold (AND), where a label holding several values joined with ``+`` (the served models
of a node) holds each of them. The fleet selects nodes by it (``-l``, maintenance
windows); a node judges by it which fleet settings are its own."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

Selector = tuple[str, str]


def matches(labels: Mapping[str, str], selectors: Iterable[Selector]) -> bool:
    """True when every selector matches ``labels``."""
    for key, value in selectors:
        have = labels.get(key)
        if have is None or (have != value and value not in have.split("+")):
            return False
    return True
