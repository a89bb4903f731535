"""Why a connection to NATS failed, in one line an operator can act on: a URL that is not
a NATS URL (refused before connecting), a port where something else answers (found
beside the connect, :mod:`actors.runtime.sniff`), and TLS failures named with the setting
to look at. :class:`BusError` carries the line to the user."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Coroutine
from typing import Any

import nats.errors

from actors.runtime import sniff
from schemas.errors import FleetError

TLS_NOT_OFFERED = "the server does not offer TLS, which a tls:// URL or a tls_* setting asks for"


class BusError(FleetError):
    """The NATS server could not be reached or refused us."""

    def __init__(self, server: str, reason: str) -> None:
        self.server = server
        self.reason = reason
        super().__init__(f"cannot reach NATS at {server}: {reason}")


NATS_SCHEMES = ("nats", "tls", "ws", "wss")
"""The URL schemes nats-py connects with; a URL without one is taken as nats://."""


def check_urls(server: str) -> None:
    """Refuse a URL list with another scheme (``http://`` pasted from the fleet API line)
    before connecting, saying what a NATS URL looks like."""
    for url in server.split(","):
        scheme, sep, _ = url.strip().partition("://")
        if sep and scheme.lower() not in NATS_SCHEMES:
            raise BusError(
                server,
                f"{scheme}:// is not a NATS URL; NATS URLs are nats://HOST:PORT or "
                "tls://HOST:PORT (ws:// and wss:// for websockets)",
            )


def reason(exc: BaseException, tls: ssl.SSLContext | None = None) -> str:
    """One line naming the cause: TLS failures in words an operator can act on, each with
    the setting to look at; ``tls`` says whether the caller configured TLS at all."""
    text = str(exc).strip()
    if isinstance(exc, ssl.SSLCertVerificationError):
        detail = exc.verify_message or text
        if "mismatch" in detail:  # "Hostname mismatch, ..." or "IP address mismatch, ..."
            return (
                f"TLS: certificate verify failed: {detail.rstrip('.')} (connect with a name "
                "the server's certificate lists)"
            )
        hint = (
            "is tls_ca the CA that signed the server's certificate?"
            if tls is not None
            else "the server requires TLS: set tls_ca to the CA that signed its certificate"
        )
        return f"TLS: certificate verify failed: {detail} ({hint})"
    if isinstance(exc, ssl.SSLError):
        reason = (exc.reason or text).upper()
        if "CERTIFICATE_REQUIRED" in reason:
            return "TLS: the server requires a client certificate (set tls_cert and tls_key)"
        if "BAD_CERTIFICATE" in reason or "UNKNOWN_CA" in reason:
            return (
                "TLS: the server refused our client certificate (is it signed by the CA the "
                "server trusts, and still valid?)"
            )
        return f"TLS: {text}"
    if tls is not None and isinstance(exc, ConnectionResetError | BrokenPipeError):
        # Under TLS 1.3 the client's handshake ends before the server has checked the
        # client certificate, so its alert may be lost and only the closed socket seen.
        return (
            "TLS: the server closed the connection after the handshake; it refuses our "
            "client certificate or requires one (set tls_cert and tls_key)"
        )
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused (is nats-server running and the URL right?)"
    if isinstance(exc, TimeoutError | nats.errors.NoServersError) or not text:
        return "no server answered (is nats-server running and the URL right?)"
    return text


async def unless_not_nats(server: str, connecting: Coroutine[Any, Any, None]) -> None:
    """Await ``connecting``; beside it, for one nats:// or tls:// URL, look at what answers
    there (:mod:`actors.runtime.sniff`): an HTTP port or another service is a
    ConnectionError saying so at once, not a connect timeout later."""
    scheme = server.split("://", 1)[0] if "://" in server else "nats"
    connect = asyncio.ensure_future(connecting)
    if "," in server or scheme not in ("nats", "tls"):
        await connect
        return
    look = asyncio.create_task(sniff.not_nats(server))
    try:
        await asyncio.wait({connect, look}, return_when=asyncio.FIRST_COMPLETED)
        if not connect.done() and (reason := await look) is not None:
            raise ConnectionError(reason)
        await connect
    finally:
        look.cancel()
        # nats-py swallows a cancel that lands while it opens a connection (and tries
        # again): cancel until it has ended. The caller's deadline bounds this too.
        while not connect.done():
            connect.cancel()
            await asyncio.wait({connect}, timeout=0.05)
        await asyncio.gather(connect, look, return_exceptions=True)
