"""A bounded memory forgets its oldest entry, and only when a new key would overflow it."""

from __future__ import annotations

from actors.runtime.bounded import remember


def test_a_full_memory_forgets_its_oldest_entry_for_a_new_key() -> None:
    """At its limit, a new key evicts the oldest; a key already held is updated in place."""
    memory: dict[str, int] = {}
    for n, key in enumerate("abc"):
        remember(memory, key, n, limit=3)
    remember(memory, "a", 10, limit=3)
    assert memory == {"a": 10, "b": 1, "c": 2}
    remember(memory, "d", 3, limit=3)
    assert memory == {"b": 1, "c": 2, "d": 3}
