"""Who may log in to an HTTP port with a password (the aggregator's): users in a file,
each a line ``name:pbkdf2_sha256$<iterations>$<salt>$<hash>`` (``fleetctl ui-user NAME``
writes one), checked by HTTP basic auth. The file is read again when it changes, so a
user is added or removed without a restart. Passwords are never stored, only
PBKDF2-SHA256 hashes (hashlib), compared in constant time; a name that is not in the
file is hashed against a dummy line of the same cost, so the answer's timing does not
say whether the user exists. Failed logins are counted by :mod:`.http_throttle`."""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import ipaddress
import secrets
from pathlib import Path

from actors.runtime.config import ConfigError
from actors.runtime.file_stamp import FileStamp

ITERATIONS = 600_000
"""OWASP's figure for PBKDF2-HMAC-SHA256 (2023)."""
SCHEME = "pbkdf2_sha256"
REALM = 'Basic realm="fleet", charset="UTF-8"'
_DUMMY_SALT = secrets.token_hex(16)


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


def credentials(header: str) -> tuple[str, str] | None:
    """(name, password) of a ``Basic`` Authorization value; None for anything else."""
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        name, sep, password = base64.b64decode(value, validate=True).decode().partition(":")
    except (binascii.Error, UnicodeDecodeError):
        return None
    return (name, password) if sep and name else None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Users:
    """The users file, read again whenever it changes (:mod:`.file_stamp`)."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self._file = FileStamp(self.path)
        self._users: dict[str, str] = {}
        self._dummy = f"{SCHEME}${ITERATIONS}${_DUMMY_SALT}${'00' * 32}"
        """Checked for a name not in the file: the cost of the file's first user's hash."""
        self._read()

    def _read(self) -> None:
        try:
            stamp = self._file.due()
            if stamp is None:
                return
            lines = self.path.read_text().splitlines()
        except OSError as exc:
            raise ConfigError(f"http_users_file: cannot read {self.path}: {exc.strerror}") from None
        users = {}
        for line in lines:
            name, sep, stored = line.strip().partition(":")
            if sep and name and not name.startswith("#"):
                users[name] = stored
        iterations = next(
            (s.split("$")[1] for s in users.values() if s.count("$") == 3), str(ITERATIONS)
        )
        self._dummy = f"{SCHEME}${iterations}${_DUMMY_SALT}${'00' * 32}"
        self._users = users
        self._file.read(stamp)

    def stored(self, name: str) -> str | None:
        """``name``'s hash line as the file says now; None if it names no user."""
        self._read()
        return self._users.get(name)

    def check(self, name: str, password: str) -> bool:
        """``name`` is a user and ``password`` is theirs. Takes one PBKDF2 hash whether
        the user exists or not (blocking: call it in a thread)."""
        stored = self.stored(name)
        right = check_password(password, self._dummy if stored is None else stored)
        return stored is not None and right
