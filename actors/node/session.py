"""This agent process's own word: what its actors publish for each other carries a tag only
this process can make, so a message they act on is known to come from this process.

The node key does not tell: it lives in a file, and whoever copies it (with the node's
client certificate) may publish on the node's subjects from anywhere, signed exactly as
the node signs. So at start the process makes a secret (32 random bytes, never stored,
logged or sent) and tags every message it publishes for its own actors with a counter
that only grows and an HMAC-SHA256 of the subject, the counter and the body under that
secret (headers ``Fleet-Session-Seq`` and ``Fleet-Session-Tag``, schemas/events.py).
A receiver takes a message only if the tag verifies and its counter is above the last one
its subscription took on that subject: messages from one connection reach a subscription
in the order they were published, so a captured message sent again is refused, and a
subscription made later refuses everything published before it existed.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Mapping
from typing import Final

from actors.runtime.bounded import remember
from schemas.events import HEADER_SESSION_SEQ, HEADER_SESSION_TAG

MAX_SEQ_DIGITS: Final = 19
"""A counter is at most 19 decimal digits (it never nears 2**63); a longer one is refused
before it is parsed."""
CHECKED_MEMORY: Final = 16
"""Recently checked tags remembered with their bodies and verdicts: a message reaches up
to nine actors, each through a subscription of its own, and is checked once (16 bodies of
at most 1 MiB each are held)."""


class Replay:
    """One subscription's memory of the last counter it took on each subject (subjects
    are the node's own that verified, so the map stays small); it starts at the process's
    counter when the subscription was made."""

    def __init__(self, floor: int) -> None:
        self.floor = floor
        self.last: dict[str, int] = {}

    def fresh(self, subject: str, seq: int) -> bool:
        """Whether ``seq`` is newer than what this subscription took on ``subject``; if so
        it becomes the last taken."""
        if seq <= self.last.get(subject, self.floor):
            return False
        self.last[subject] = seq
        return True


class Session:
    """The process's secret and counter: tags what it publishes, checks what it receives."""

    def __init__(self) -> None:
        self._secret = secrets.token_bytes(32)
        self._seq = 0
        self._checked: dict[tuple[str, str, str], tuple[bytes, bool]] = {}

    def headers(self, subject: str, body: bytes) -> dict[str, str]:
        """The next counter and its tag for ``body`` on ``subject``: publish them at once
        (nothing awaited in between), so counters go out in the order they were taken."""
        self._seq += 1
        seq = str(self._seq)
        return {HEADER_SESSION_SEQ: seq, HEADER_SESSION_TAG: self._tag(subject, seq, body)}

    def replay_guard(self) -> Replay:
        """A new subscription's replay memory: nothing published before now is fresh."""
        return Replay(self._seq)

    def check(self, subject: str, headers: Mapping[str, str], body: bytes, replay: Replay) -> str:
        """Why ``body`` on ``subject`` is not this process's to take through ``replay``:
        ``no_session`` (no tag), ``bad_session`` (a tag this process did not make),
        ``replayed`` (taken before, or published before the subscription); "" if it is
        (``replay`` then remembers it as taken)."""
        seq, tag = headers.get(HEADER_SESSION_SEQ), headers.get(HEADER_SESSION_TAG)
        if seq is None or tag is None:
            return "no_session"
        if not (0 < len(seq) <= MAX_SEQ_DIGITS and seq.isascii() and seq.isdecimal()):
            return "bad_session"
        if not tag.isascii():  # compare_digest takes ASCII text only
            return "bad_session"
        if not self._verifies(subject, seq, tag, body):
            return "bad_session"
        return "" if replay.fresh(subject, int(seq)) else "replayed"

    def _verifies(self, subject: str, seq: str, tag: str, body: bytes) -> bool:
        """Whether ``tag`` is this session's for the message: computed once per message,
        then read back for the same subject, counter, tag and exact bytes."""
        mark = (subject, seq, tag)
        known = self._checked.get(mark)
        if known is not None and known[0] == body:
            return known[1]
        verdict = hmac.compare_digest(self._tag(subject, seq, body), tag)
        remember(self._checked, mark, (body, verdict), CHECKED_MEMORY)
        return verdict

    def _tag(self, subject: str, seq: str, body: bytes) -> str:
        mac = hmac.new(self._secret, digestmod=hashlib.sha256)
        mac.update(subject.encode())
        mac.update(b"\0")
        mac.update(seq.encode())
        mac.update(b"\0")
        mac.update(body)
        return mac.hexdigest()
