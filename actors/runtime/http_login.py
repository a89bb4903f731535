"""Who may open an HTTP port exposed beyond loopback (the aggregator's): users in a file,
each a line ``name:pbkdf2_sha256$<iterations>$<salt>$<hash>`` (``fleetctl ui-user NAME``
writes one), checked by HTTP basic auth over TLS. The file is read again when it
changes, so a user is added or removed without a restart. Passwords are never stored,
only PBKDF2-SHA256 hashes (hashlib), compared in constant time."""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import ipaddress
import os
import secrets
from pathlib import Path

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from actors.runtime.config import ConfigError

ITERATIONS = 600_000
"""OWASP's figure for PBKDF2-HMAC-SHA256 (2023)."""
SCHEME = "pbkdf2_sha256"
REALM = 'Basic realm="fleet", charset="UTF-8"'


def hash_password(password: str, iterations: int = ITERATIONS) -> str:
    salt = secrets.token_bytes(16)
    digest = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, iterations)
    return f"{SCHEME}${iterations}${salt.hex()}${digest.hex()}"


def check_password(password: str, stored: str) -> bool:
    try:
        scheme, iterations, salt, digest = stored.split("$")
        if scheme != SCHEME or not 1 <= int(iterations) <= 10_000_000:
            return False
        expected = bytes.fromhex(digest)
        got = hashlib.pbkdf2_hmac("sha256", password.encode(), bytes.fromhex(salt), int(iterations))
    except ValueError:
        return False
    return hmac.compare_digest(got, expected)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Users:
    """The users file, read again whenever its modification time changes."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self._stamp: int | None = None
        self._users: dict[str, str] = {}
        self._read()

    def _read(self) -> None:
        try:
            stamp = os.stat(self.path).st_mtime_ns
            if stamp == self._stamp:
                return
            lines = self.path.read_text().splitlines()
        except OSError as exc:
            raise ConfigError(f"http_users_file: cannot read {self.path}: {exc.strerror}") from None
        users = {}
        for line in lines:
            name, sep, stored = line.strip().partition(":")
            if sep and name and not name.startswith("#"):
                users[name] = stored
        self._users, self._stamp = users, stamp

    def allows(self, header: str) -> bool:
        """``header`` (an Authorization value) names a user with the right password."""
        self._read()
        scheme, _, value = header.partition(" ")
        if scheme.lower() != "basic":
            return False
        try:
            name, _, password = base64.b64decode(value, validate=True).decode().partition(":")
        except (binascii.Error, UnicodeDecodeError):
            return False
        stored = self._users.get(name)
        return stored is not None and check_password(password, stored)


def login_required(users: Users) -> Middleware:
    """A middleware answering 401 (with the realm, so browsers ask) without a user's login."""

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if not users.allows(request.headers.get("Authorization", "")):
            raise web.HTTPUnauthorized(headers={"WWW-Authenticate": REALM})
        return await handler(request)

    return check
