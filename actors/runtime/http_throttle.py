"""Failed logins counted per client address and per user name, so a password cannot be
guessed faster than a few tries a minute from one place, or for one user from many.
Once either has had ``limit`` failures within ``WINDOW`` seconds, further tries are
refused (429 with Retry-After) until the oldest of them is ``WINDOW`` old; a refused
try checks no password, so it costs no hash. The table is bounded: beyond ``MAX_KEYS``
counted names and addresses, the one whose last failure is oldest goes first."""

from __future__ import annotations

import ipaddress
import time
from collections import deque
from collections.abc import Callable, Iterable

WINDOW = 60.0
"""Seconds a failed login counts against its address and its user name."""
MAX_KEYS = 10_000
"""Addresses and user names counted at most."""
IPV6_PREFIX = 64
"""An IPv6 client is counted by its /64: one host usually holds the whole prefix."""


def address_key(remote: str | None) -> str:
    """The address a client is counted by: its IPv4 address, its IPv6 /64."""
    try:
        address = ipaddress.ip_address(remote or "")
    except ValueError:
        return f"address {remote}"
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return f"address {address.ipv4_mapped}"
        return f"address {ipaddress.ip_network(f'{address}/{IPV6_PREFIX}', strict=False)}"
    return f"address {address}"


class LoginThrottle:
    """The failures of the last :data:`WINDOW` seconds, by key (an address or a name)."""

    def __init__(self, limit: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.limit = limit
        self.clock = clock
        self._failures: dict[str, deque[float]] = {}

    def wait(self, keys: Iterable[str]) -> float:
        """Seconds until every one of ``keys`` may try again; 0 if all may now."""
        now = self.clock()
        longest = 0.0
        for key in keys:
            failures = self._failures.get(key)
            if failures is not None and len(failures) >= self.limit:
                longest = max(longest, failures[0] + WINDOW - now)
        return max(0.0, longest)

    def tried(self, keys: Iterable[str]) -> None:
        """Count a login try against each of ``keys`` as failed until :meth:`passed` takes
        it back: tries running at once (their hashes take a while) are counted as they
        start, so a burst of them cannot pass the check before any has failed."""
        now = self.clock()
        for key in keys:
            failures = self._failures.pop(key, None)
            if failures is None:
                failures = deque(maxlen=self.limit)
                while len(self._failures) >= MAX_KEYS:
                    del self._failures[next(iter(self._failures))]
            failures.append(now)
            # Re-inserted last: the table stays ordered by last failure, oldest first.
            self._failures[key] = failures

    def passed(self, keys: Iterable[str]) -> None:
        """A try of each of ``keys`` succeeded: it no longer counts."""
        for key in keys:
            failures = self._failures.get(key)
            if failures:
                failures.pop()
