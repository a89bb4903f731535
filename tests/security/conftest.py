"""The shipped accounts' server and node-1's attacker, for every permission test here."""

from tests.security.auth_fleet import attacker, auth, tls_auth

__all__ = ["attacker", "auth", "tls_auth"]
