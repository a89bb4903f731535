"""Who may use the node's gateway, and how often: TLS, API keys, client certificates and a
rate limit per client, for a gateway that listens where others can reach it.

By default the gateway listens on 127.0.0.1 with neither (it is the node's own). Given
``gateway_host`` beyond loopback it needs TLS (``gateway_tls_cert``/``_key``) and a client
check: API keys (``gateway_keys_file``), client certificates signed by
``gateway_tls_client_ca`` (mutual TLS), or both (then both are required). Keys are sent as
``Authorization: Bearer KEY`` (OpenAI's clients do) and stored only as SHA-256 hashes, a
line ``name:sha256$<hex>`` each (``node-agent gateway-key NAME`` makes one): a key is 32
random bytes, so a fast hash suffices and a request costs no key stretching; a key is
looked up by its digest alone (no comparison over the key, so none stops early on a
prefix). The file is read again whenever it changes, so a key is added, rotated or revoked
without a restart.
Each client (its key's name, else its certificate's subject) gets a token bucket of
``gateway_rate_limit`` requests a second, ``gateway_rate_burst`` at once; beyond, 429.

Web pages are kept out (:meth:`Access.browser_guard`, on every gateway): a page the node's
user opens may send requests to 127.0.0.1, and a DNS-rebinding page may even read the
answers as its own site's. So a request a browser marks as another site's
(``Sec-Fetch-Site: cross-site``, or an ``Origin`` other than the request's own host) is
403, and on loopback a ``Host`` other than the bound address, the address the connection
arrived on or ``localhost`` is 421. Programs (OpenAI's clients, curl) send neither header
and are not affected.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import socket
import ssl
import time
from collections import OrderedDict
from pathlib import Path
from typing import Final
from urllib.parse import urlsplit

from aiohttp import hdrs, web
from aiohttp.typedefs import Handler, Middleware

from actors.node.config import AgentConfig
from actors.runtime.config import ConfigError
from actors.runtime.file_stamp import FileStamp
from actors.runtime.http_access import Hosts, host_name
from actors.runtime.http_login import is_loopback
from actors.runtime.tls import server_context

log = logging.getLogger(__name__)

SCHEME: Final = "sha256"
KEY_PREFIX: Final = "nak_"
"""Marks a node-agent gateway key (a secret scanner can look for it)."""
MAX_KEYS: Final = 10_000
"""Lines of a keys file read; the rest are ignored (and logged)."""
MAX_CLIENTS: Final = 10_000
"""Rate-limit buckets kept; the least recently used one goes first."""
WILDCARDS: Final = ("0.0.0.0", "::", "")


class Refusal(Exception):
    """A request the gateway answers itself, in OpenAI's error format."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str,
        code: str,
        retry_after: int | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.code = code
        self.retry_after = retry_after
        self.headers = dict(headers or {})

    def response(self) -> web.Response:
        error = {"message": self.message, "type": self.kind, "param": None, "code": self.code}
        headers = dict(self.headers)
        if self.retry_after:
            headers[hdrs.RETRY_AFTER] = str(self.retry_after)
        return web.json_response({"error": error}, status=self.status, headers=headers or None)


def new_key() -> str:
    """A fresh API key: the prefix and 32 random bytes, URL-safe."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def digest(key: str) -> bytes:
    """The SHA-256 of ``key``'s bytes as they came (a header's bytes that are not UTF-8
    arrive as surrogates: they hash as those bytes, never raise)."""
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


def key_line(name: str, key: str) -> str:
    """The keys file's line for ``key``: its name and hash, never the key."""
    return f"{name}:{SCHEME}${digest(key).hex()}"


def parse_keys(lines: list[str]) -> tuple[dict[bytes, str], list[str]]:
    """A keys file's lines: digest -> name, and what is wrong with the lines left out."""
    names: dict[bytes, str] = {}
    problems: list[str] = []
    for number, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if len(names) >= MAX_KEYS:
            problems.append(f"only the first {MAX_KEYS} keys are read")
            break
        name, _, stored = line.partition(":")
        scheme, _, hexdigest = stored.partition("$")
        try:
            raw = bytes.fromhex(hexdigest)
        except ValueError:
            raw = b""
        if not name or scheme != SCHEME or len(raw) != 32:
            problems.append(f"line {number} is not NAME:sha256$<64 hex>")
            continue
        names[raw] = name
    return names, problems


class ApiKeys:
    """The keys file, by hash, read again whenever it changes (:mod:`.file_stamp`)."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self._file = FileStamp(self.path)
        self._names: dict[bytes, str] = {}
        """SHA-256 digest of a key -> its name: a key is looked up by its digest, so no
        comparison ever runs over the key itself (nor stops early on its prefix)."""
        self._read(at_start=True)

    def _read(self, at_start: bool = False) -> None:
        try:
            stamp = self._file.due()
            if stamp is None:
                return
            lines = self.path.read_text().splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            reason = getattr(exc, "strerror", None) or str(exc)
            if at_start:
                raise ConfigError(f"gateway_keys_file: cannot read {self.path}: {reason}") from None
            # Keep the keys last read: a file being replaced is not a reason to lock out
            # every client, and an unreadable one is said in the log.
            log.error("gateway keys file unreadable", extra={"reason": reason})
            return
        names, problems = parse_keys(lines)
        if self._file.is_new(stamp):  # said once a change, not at every read until settled
            for problem in problems:
                log.error("gateway keys file: %s", problem)
        if at_start:
            log.info("gateway keys read", extra={"keys": len(names)})
        elif names != self._names:
            log.info("gateway keys file changed; read again", extra={"keys": len(names)})
        self._names = names
        self._file.read(stamp)

    def name_of(self, key: str) -> str | None:
        """The name of ``key``, None when it is not (or no longer) in the file."""
        self._read()
        return self._names.get(digest(key))


class RateLimit:
    """A token bucket per client: ``rate`` a second, ``burst`` at once."""

    def __init__(self, rate: float, burst: int) -> None:
        self.rate = rate
        self.burst = burst
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def wait(self, client: str) -> float:
        """0 and one token taken when ``client`` may send now, else the seconds until it may."""
        if self.rate <= 0:
            return 0.0
        now = time.monotonic()
        tokens, then = self._buckets.pop(client, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - then) * self.rate)
        wait = 0.0
        if tokens >= 1:
            tokens -= 1
        else:
            wait = (1 - tokens) / self.rate
        self._buckets[client] = (tokens, now)
        while len(self._buckets) > MAX_CLIENTS:
            self._buckets.popitem(last=False)
        return wait


def _subject(peercert: object) -> str:
    """A client certificate's common name, else its first subjectAltName."""
    if not isinstance(peercert, dict):
        return ""
    for rdn in peercert.get("subject", ()):
        for field, value in rdn:
            if field == "commonName":
                return str(value)
    for _, value in peercert.get("subjectAltName", ()):
        return str(value)
    return ""


class Access:
    """The gateway's TLS context, client check and rate limit, from the node's config."""

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.keys = ApiKeys(config.gateway_keys_file) if config.gateway_keys_file else None
        self.limit = RateLimit(config.gateway_rate_limit, config.gateway_rate_burst)
        self.tls: ssl.SSLContext | None = None
        if config.gateway_tls_cert:
            self.tls = server_context(
                config.gateway_tls_cert,
                config.gateway_tls_key,
                ("gateway_tls_cert", "gateway_tls_key"),
            )
            if config.gateway_tls_client_ca:
                try:
                    self.tls.load_verify_locations(cafile=config.gateway_tls_client_ca)
                except (OSError, ssl.SSLError) as exc:
                    raise ConfigError(
                        f"gateway_tls_client_ca: {config.gateway_tls_client_ca}: no PEM "
                        f"certificate read ({getattr(exc, 'strerror', None) or exc})"
                    ) from None
                self.tls.verify_mode = ssl.CERT_REQUIRED

    @property
    def checks(self) -> bool:
        return self.keys is not None or bool(self.config.gateway_tls_client_ca)

    def client(self, request: web.Request) -> str:
        """Who sent ``request`` (a key's name, else a certificate's subject); Refusal 401
        when a required key is missing or unknown."""
        who = ""
        if self.config.gateway_tls_client_ca and request.transport is not None:
            # The handshake already refused a client without a certificate of our CA.
            who = "cert:" + _subject(request.transport.get_extra_info("peercert"))
        if self.keys is not None:
            scheme, _, key = request.headers.get(hdrs.AUTHORIZATION, "").partition(" ")
            name = self.keys.name_of(key.strip()) if scheme.lower() == "bearer" else None
            if name is None:
                raise Refusal(
                    401,
                    "a valid API key is required (Authorization: Bearer KEY)",
                    "invalid_request_error",
                    "invalid_api_key",
                    headers={hdrs.WWW_AUTHENTICATE: 'Bearer realm="node-agent gateway"'},
                )
            who = "key:" + name
        return who

    def browser_guard(self) -> Middleware:
        """Refuses what a web page sends (module docstring): 421 for a foreign ``Host`` on
        loopback, 403 for another site's request."""
        loopback = is_loopback(self.config.gateway_host)
        hosts = Hosts(self.config.gateway_host, ())

        @web.middleware
        async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
            host = request.headers.get(hdrs.HOST, "")
            transport = request.transport
            local = transport.get_extra_info("sockname") if transport is not None else None
            arrived_on = str(local[0]) if isinstance(local, tuple) and local else None
            if loopback and not hosts.allows(host, arrived_on):
                return Refusal(
                    421,
                    "the gateway on loopback answers only to its own address or localhost",
                    "invalid_request_error",
                    "misdirected_request",
                ).response()
            origin = request.headers.get(hdrs.ORIGIN)
            cross_site = request.headers.get("Sec-Fetch-Site", "") == "cross-site"
            if cross_site or (
                origin is not None and host_name(urlsplit(origin).netloc) != host_name(host)
            ):
                return Refusal(
                    403,
                    "requests from another site's web page are refused",
                    "invalid_request_error",
                    "cross_site_request",
                ).response()
            return await handler(request)

        return guard

    def middleware(self) -> Middleware:
        """Refuses requests without a valid key (401) or beyond the client's rate (429)."""

        @web.middleware
        async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
            try:
                who = self.client(request)
                wait = self.limit.wait(who) if who else 0.0
                if wait:
                    raise Refusal(
                        429,
                        f"rate limit of {self.config.gateway_rate_limit:g} requests a second "
                        "reached",
                        "rate_limit_error",
                        "rate_limit_exceeded",
                        max(1, round(wait + 0.5)),
                    )
            except Refusal as refusal:
                return refusal.response()
            return await handler(request)

        return check

    def endpoint(self, port: int) -> str:
        """The URL a client outside the node uses ("" while the gateway is the node's own:
        on loopback without TLS, and no URL configured)."""
        if self.config.gateway_advertise_url:
            return self.config.gateway_advertise_url
        host = self.config.gateway_host
        if is_loopback(host) and self.tls is None:
            return ""
        if host in WILDCARDS:
            host = socket.gethostname()  # no DNS lookup on the event loop
        if ":" in host:
            host = f"[{host}]"
        scheme = "https" if self.tls is not None else "http"
        return f"{scheme}://{host}:{port}"
