"""The project's exception hierarchy: one root, subclasses that carry their facts."""

from __future__ import annotations


class FleetError(Exception):
    """Root of every error this project raises on purpose."""


class InvalidToken(FleetError):
    """A node id, cluster name or other subject token is not subject-safe."""

    def __init__(self, field: str, value: str) -> None:
        self.field = field
        self.value = value
        super().__init__(f"invalid {field} {value!r}: use 1-64 characters from A-Z a-z 0-9 _ -")


class DecodeError(FleetError):
    """A message body does not match its wire type."""

    def __init__(self, subject: str, type_name: str, reason: str) -> None:
        self.subject = subject
        self.type_name = type_name
        self.reason = reason
        super().__init__(f"cannot decode {type_name} from {subject!r}: {reason}")


class SignatureError(FleetError):
    """A signed message is unsigned, malformed, or its signature does not verify."""

    def __init__(self, reason: str, public_key: str = "") -> None:
        self.reason = reason
        self.public_key = public_key
        super().__init__(f"signature refused: {reason}")


class KeyFileError(FleetError):
    """An nkey seed file is missing, unreadable or not a valid seed."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"key file {path}: {reason}")
