"""The client side of TLS: one :class:`ssl.SSLContext` from the ``tls_ca``, ``tls_cert`` and
``tls_key`` settings, built once at startup so a bad file is a one-line config error before
any connection is tried, not a failure on every reconnect.
"""

from __future__ import annotations

import ssl
from pathlib import Path

from actors.runtime.config import ConfigError


def client_context(ca: str = "", cert: str = "", key: str = "") -> ssl.SSLContext | None:
    """A context that verifies the server against ``ca`` (the system store when empty) and,
    with ``cert`` and ``key``, presents a client certificate (mutual TLS). None when all
    three are empty: plain ``nats://`` needs no context, and ``tls://`` then gets nats-py's
    default one. Raises ConfigError for an unreadable or mismatched file, or a half pair."""
    if not (ca or cert or key):
        return None
    if bool(cert) != bool(key):
        raise ConfigError("tls_cert and tls_key go together: set both or neither")
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    if ca:
        _check_readable("tls_ca", ca)
        try:
            context.load_verify_locations(cafile=ca)
        except ssl.SSLError:
            raise ConfigError(f"tls_ca: {ca} holds no PEM certificate") from None
    if cert:
        _check_readable("tls_cert", cert)
        _check_readable("tls_key", key)
        try:
            context.load_cert_chain(certfile=cert, keyfile=key)
        except ssl.SSLError:
            raise ConfigError(
                f"tls_cert/tls_key: {cert} and {key} are not a PEM certificate and its private key"
            ) from None
    return context


def _check_readable(setting: str, path: str) -> None:
    """ssl's own errors name neither the file nor the setting (a missing key and a missing
    certificate read the same); opening each file first lets the error say which."""
    try:
        Path(path).open("rb").close()
    except FileNotFoundError:
        raise ConfigError(f"{setting}: file {path} not found") from None
    except OSError as exc:
        raise ConfigError(f"{setting}: cannot read {path}: {exc.strerror}") from None


def server_context(
    cert: str, key: str, settings: tuple[str, str] = ("http_tls_cert", "http_tls_key")
) -> ssl.SSLContext:
    """A context serving TLS with ``cert`` and ``key`` (PEM files); ConfigError for an
    unreadable or mismatched pair, naming ``settings`` (the two settings they come from)."""
    _check_readable(settings[0], cert)
    _check_readable(settings[1], key)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(certfile=cert, keyfile=key)
    except ssl.SSLError:
        raise ConfigError(
            f"{settings[0]}/{settings[1]}: {cert} and {key} are not a PEM certificate and its "
            "private key"
        ) from None
    return context
