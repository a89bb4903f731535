"""One-time login links to a dashboard that sends commands: ``<url>/ui/login?t=TOKEN``,
where TOKEN is ``<issued>.<nonce>.<signature>``: the time it was made, a random nonce,
and an Ed25519 signature over both by the key the dashboard signs its commands with
(whoever holds that key may command anyway; nobody else can make a link). A link works
once (its nonce is remembered until it expires) and for :data:`LIFETIME` seconds after it
was made; the dashboard exchanges it for a session cookie. ``fleetctl up`` and
``fleetctl dashboard`` print them."""

from __future__ import annotations

import base64
import binascii
import secrets
from urllib.parse import quote

from schemas import signing
from schemas.errors import SignatureError

LOGIN_PATH = "/ui/login"
"""Where a link is redeemed; the one path of a port needing a login that is open without."""
LIFETIME = 300.0
"""Seconds a link works after it was made."""
CLOCK_SKEW = 60.0
"""Seconds a link may claim to be made in the future (the printer's clock ahead)."""
MAX_TOKEN = 200
"""Characters of a token at most (a real one has about 130)."""
MAX_REMEMBERED = 10_000
"""Redeemed nonces kept at most; beyond it, links are refused until some expire."""
_CONTEXT = b"fleet dashboard login link\n"
"""Signed before the token's text, so no other signed message is a link."""


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def make_token(key: signing.KeyPair, now: float) -> str:
    claim = f"{int(now)}.{_b64(secrets.token_bytes(16))}"
    return f"{claim}.{_b64(key.sign(_CONTEXT + claim.encode()))}"


def login_link(base_url: str, key: signing.KeyPair, now: float) -> str:
    """A one-time login link to the dashboard at ``base_url``, signed with ``key``."""
    return f"{base_url.rstrip('/')}{LOGIN_PATH}?t={quote(make_token(key, now))}"


class LinkTokens:
    """The nonces of redeemed links, each until its link would have expired."""

    def __init__(self) -> None:
        self._redeemed: dict[str, float] = {}
        """Nonce -> when its link expires."""

    def redeem(self, token: str, public_key: str, now: float) -> bool:
        """``token`` was made by ``public_key``'s key, is within its lifetime and was not
        redeemed before: it is redeemed now (True). Anything else is False."""
        self._redeemed = {n: expires for n, expires in self._redeemed.items() if expires > now}
        issued, _, rest = token[: MAX_TOKEN + 1].partition(".")
        nonce, _, signature = rest.partition(".")
        if len(token) > MAX_TOKEN or not (issued.isascii() and issued.isdigit()) or not nonce:
            return False
        if not now - LIFETIME <= int(issued) <= now + CLOCK_SKEW:
            return False
        if nonce in self._redeemed or len(self._redeemed) >= MAX_REMEMBERED:
            return False
        try:
            raw = base64.urlsafe_b64decode(signature + "=" * (-len(signature) % 4))
            headers = {signing.HEADER_SIG: base64.b64encode(raw).decode()}
            body = _CONTEXT + f"{issued}.{nonce}".encode()
            signing.verify_with(signing.verify_key(public_key), public_key, headers, body)
        except (binascii.Error, ValueError, SignatureError):
            return False
        self._redeemed[nonce] = int(issued) + LIFETIME + CLOCK_SKEW
        return True
