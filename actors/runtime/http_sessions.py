"""Logins to an HTTP port kept as sessions: a random cookie value names one, the server
keeps what it stands for. A session ends ``lifetime`` seconds after its login, ``idle``
seconds after its last request, when the user it was made for leaves the users file or
changes password, or when newer sessions push it out: at most :data:`SESSIONS_PER_USER`
per user (a user's ninth login ends that user's oldest session) and :data:`MAX_SESSIONS`
in all (the least recently used goes first). Sessions are kept in memory: a restart
ends them all.

Each session carries the token its pages' forms post (:attr:`Session.form_token`),
replaced after every post, so a form is good for one post and a page of another
session, or an old one, cannot post."""

from __future__ import annotations

import hashlib
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

MAX_SESSIONS = 256
"""Sessions kept at most, all users together."""
SESSIONS_PER_USER = 8
"""Sessions one user (or the one-time links, together) keeps at most."""


def _digest(cookie: str) -> str:
    # Sessions are found by the digest of their cookie, so no comparison runs over the
    # secret itself (and the table holds no usable cookie).
    return hashlib.sha256(cookie.encode()).hexdigest()


@dataclass
class Session:
    """One login: who, since when, and the token its forms carry now."""

    key: str
    """The digest of the session's cookie: names it in logs and counts, never the cookie."""
    user: str
    """The user's name, or ``link`` for a one-time link's session."""
    stored: str | None
    """The user's hash line at login (None for a link): a changed line ends the session."""
    started: float
    used: float
    form_token: str = field(default_factory=lambda: secrets.token_urlsafe(24))

    def take_form_token(self, given: str) -> bool:
        """``given`` is the current form token (compared in constant time); either way
        the token is replaced, so each form posts once."""
        right = secrets.compare_digest(given.encode(), self.form_token.encode())
        self.form_token = secrets.token_urlsafe(24)
        return right


class Sessions:
    """The live sessions, bounded and expiring (module docstring)."""

    def __init__(
        self, lifetime: float, idle: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.lifetime = lifetime
        self.idle = idle
        self.clock = clock
        self._sessions: dict[str, Session] = {}
        """By cookie digest, least recently used first."""

    def __len__(self) -> int:
        return len(self._sessions)

    def start(self, user: str, stored: str | None = None) -> tuple[str, Session]:
        """A new session for ``user``: its cookie value, and the session."""
        now = self.clock()
        mine = [s for s in self._sessions.values() if s.user == user]
        for old in mine[: max(0, len(mine) - SESSIONS_PER_USER + 1)]:
            self.end(old)
        while len(self._sessions) >= MAX_SESSIONS:
            del self._sessions[next(iter(self._sessions))]
        cookie = secrets.token_urlsafe(32)
        session = Session(key=_digest(cookie), user=user, stored=stored, started=now, used=now)
        self._sessions[session.key] = session
        return cookie, session

    def get(self, cookie: str) -> Session | None:
        """The live session ``cookie`` names, marked used now; None if there is none."""
        session = self._sessions.pop(_digest(cookie), None)
        if session is None or not self._fresh(session):
            return None
        session.used = self.clock()
        self._sessions[session.key] = session  # last: the most recently used
        return session

    def alive(self, session: Session) -> bool:
        """``session`` is still kept and not expired (a long request checks as it goes)."""
        if self._sessions.get(session.key) is not session:
            return False
        if not self._fresh(session):
            self.end(session)
            return False
        return True

    def end(self, session: Session) -> None:
        self._sessions.pop(session.key, None)

    def _fresh(self, session: Session) -> bool:
        now = self.clock()
        return now - session.started < self.lifetime and now - session.used < self.idle
