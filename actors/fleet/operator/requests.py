"""Operator requests the aggregators carry out (``fleetctl forget``, ``fleetctl
maintenance``): each is signed by an operator key and checked the same way before
anything is done: its signature over the exact body, its type, the signer among the
aggregator's ``trust_operators``, its timestamp within ``max_skew``."""

from __future__ import annotations

import time
from typing import Generic, Protocol, TypeVar

from schemas import codec, signing
from schemas.errors import DecodeError, SignatureError


class Timed(Protocol):
    @property
    def ts(self) -> float: ...


T = TypeVar("T", bound=Timed)

UNTRUSTED = "signed by a key the aggregators do not trust (trust_operators)"


class RequestRefused(Exception, Generic[T]):
    """Why a request is not carried out; ``request`` is None when it did not even decode."""

    def __init__(self, reason: str, request: T | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.request = request


def verified(
    subject: str,
    body: bytes,
    headers: dict[str, str] | None,
    kind: type[T],
    trusted: set[str],
    max_skew: float,
) -> tuple[str, T]:
    """The signer and the request ``body`` carries as ``kind``, or RequestRefused."""
    try:
        signer = signing.verify(headers, body)
        request = codec.decode(body, kind, subject)
    except (SignatureError, DecodeError) as exc:
        raise RequestRefused[T](str(exc)) from None
    if signer not in trusted:
        raise RequestRefused(UNTRUSTED, request)
    off = request.ts - time.time()
    if abs(off) > max_skew:
        raise RequestRefused(f"request is {off:+.0f}s off the aggregator's clock", request)
    return signer, request
