"""Bounded memories: a dict that forgets its oldest entry when it is full, for what a
process remembers of messages it has seen (so no flood grows it)."""

from __future__ import annotations

from typing import TypeVar

K = TypeVar("K")
V = TypeVar("V")


def remember(memory: dict[K, V], key: K, value: V, limit: int) -> None:
    """Put ``key`` in ``memory``, forgetting the oldest entry when it holds ``limit``."""
    if key not in memory and len(memory) >= limit:
        del memory[next(iter(memory))]
    memory[key] = value
