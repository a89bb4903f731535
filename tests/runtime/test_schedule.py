"""The one backoff: doubling from its initial delay up to its cap, jittered, and reset."""

from __future__ import annotations

from actors.runtime.schedule import Backoff, RateLimit


def test_backoff_doubles_up_to_its_cap() -> None:
    """Delays double from ``initial`` and stay at ``maximum`` once they reach it."""
    backoff = Backoff(0.5, 15.0, spread=0.0)
    assert [backoff.next() for _ in range(8)] == [0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 15.0, 15.0]


def test_backoff_initial_above_cap_starts_at_the_cap() -> None:
    """An initial delay larger than the cap is capped from the first try."""
    backoff = Backoff(20.0, 5.0, spread=0.0)
    assert [backoff.next() for _ in range(2)] == [5.0, 5.0]


def test_backoff_reset_starts_again_from_initial() -> None:
    """After reset() the next delay is the initial one again."""
    backoff = Backoff(1.0, 30.0, spread=0.0)
    for _ in range(4):
        backoff.next()
    backoff.reset()
    assert backoff.next() == 1.0


def test_backoff_jitter_stays_within_its_spread() -> None:
    """Each delay is its unjittered value give or take ``spread``, and they vary."""
    delays = []
    for _ in range(50):
        backoff = Backoff(2.0, 30.0, spread=0.2)
        delays.append(backoff.next())
        assert 1.6 <= delays[-1] <= 2.4
        assert 3.2 <= backoff.next() <= 4.8
    assert len(set(delays)) > 1


def test_rate_limit_counts_at_most_max_keys_per_window() -> None:
    """Past max_keys keys in one window a new key is refused, while the keys counted
    keep their own allowance."""
    limit = RateLimit(2, 3600.0, max_keys=3)
    assert [limit.allow(key) for key in "abc"] == [True, True, True]
    assert not limit.allow("d")
    assert [limit.allow("a"), limit.allow("a")] == [True, False]
