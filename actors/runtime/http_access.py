"""Who may use an HTTP port, checked before any handler runs (:class:`Access`):

- **Host.** Every request names in ``Host`` a name the server was configured or started
  with: the address it is bound to, the address the connection arrived on, ``localhost``,
  or one of the configured public names; anything else is 421. A DNS-rebinding page
  reaches the port under its own name, so it is refused even though the browser thinks
  it is on its own site. The port is not compared (proxies and port forwards change it).
- **Origin.** Every request that is not GET, HEAD or OPTIONS carries an ``Origin`` whose
  host is allowed and is the request's own ``Host``; else 403.
- **Login**, where one is needed: a session cookie (:mod:`.http_sessions`), else HTTP basic
  auth against the users file (:mod:`.http_login`; a success starts a session), throttled
  per client address and user name (:mod:`.http_throttle`; 429 with Retry-After). The
  one-time link path (:data:`~.login_links.LOGIN_PATH`) is open: it is the way in.

The session cookie is HttpOnly, SameSite=Strict, Secure over TLS, and named after the
port, so two servers on one host do not overwrite each other's."""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import math
import re
import time
from collections.abc import Iterable
from http.cookies import Morsel
from urllib.parse import urlsplit

from aiohttp import web
from aiohttp.typedefs import Handler

from actors.runtime.config import ConfigError
from actors.runtime.http_login import REALM, Users, credentials
from actors.runtime.http_sessions import Session, Sessions
from actors.runtime.http_throttle import LoginThrottle, address_key
from actors.runtime.login_links import LOGIN_PATH, LinkTokens

log = logging.getLogger(__name__)

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
HASHES_AT_ONCE = 2
"""Password hashes (a few tenths of a second of CPU each) run at once, in threads; more
logins wait their turn, so a flood of them cannot take the process's thread pool."""
_NAME = re.compile(r"[a-z0-9_-]+(\.[a-z0-9_-]+)*")
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def host_name(value: str) -> str:
    """The host of a ``Host`` value or an origin's authority: lowercased, without port,
    brackets or trailing dot; empty if it is not one."""
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        rest = value[end + 1 :]
        if end < 0 or (rest and not (rest[0] == ":" and _digits(rest[1:]))):
            return ""
        return value[1:end]
    name, sep, port = value.rpartition(":")
    if sep:
        if ":" in name or not _digits(port):
            return ""
        value = name
    return value.rstrip(".")


def _digits(text: str) -> bool:
    return text.isascii() and text.isdigit()


def _address(text: str | None) -> IPAddress | None:
    """``text`` as an IP address (an IPv4-mapped IPv6 one as IPv4); None if it is not one."""
    try:
        address = ipaddress.ip_address(text or "")
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


class Hosts:
    """The names a request may give in ``Host`` (module docstring)."""

    def __init__(self, bound: str, public: Iterable[str]) -> None:
        """``bound``: the address (or name) the server listens on; ``public``: the names
        and addresses it is reached by besides (ValueError for one that is neither)."""
        self.names = {"localhost"}
        self.addresses: set[IPAddress] = set()
        for name in public:
            named = _NAME.fullmatch(name.lower().rstrip(".")) is not None
            if not named and _address(name.strip("[]")) is None:
                raise ValueError(f"{name[:100]!r} is not a host name or address")
            self._add(name)
        self._add(bound)

    def _add(self, name: str) -> None:
        address = _address(name.strip("[]"))
        if address is None:
            self.names.add(host_name(name))
        elif not address.is_unspecified:
            self.addresses.add(address)

    def allows(self, host: str, arrived_on: str | None) -> bool:
        """``host`` (a Host value) is allowed on a connection to the address ``arrived_on``."""
        name = host_name(host)
        address = _address(name)
        if address is None:
            return name != "" and name in self.names
        return address in self.addresses or address == _address(arrived_on)


def _local(request: web.Request) -> tuple[str | None, int | None]:
    """The address and port the request's connection arrived on."""
    transport = request.transport
    local = transport.get_extra_info("sockname") if transport is not None else None
    if isinstance(local, tuple) and len(local) >= 2:
        return str(local[0]), int(local[1])
    return None, None


_SESSION = web.RequestKey("session", Session)
_NEW_COOKIE = web.RequestKey("new_cookie", str)


def session_of(request: web.Request) -> Session | None:
    """The session the request was let in with; None where the port needs no login."""
    return request.get(_SESSION)


class Access:
    """The checks of the module docstring, as one middleware; :meth:`install` adds it."""

    def __init__(
        self,
        hosts: Hosts,
        sessions: Sessions | None,
        users: Users | None,
        throttle: LoginThrottle,
        secure: bool,
    ) -> None:
        self.hosts = hosts
        self.sessions = sessions
        """None: the port needs no login."""
        self.users = users
        self.throttle = throttle
        self.secure = secure
        self.links = LinkTokens()
        self._hashing = asyncio.Semaphore(HASHES_AT_ONCE)

    def install(self, app: web.Application) -> None:
        app.middlewares.insert(0, self.middleware)
        app.on_response_prepare.append(self._set_cookie)
        app[ACCESS] = self

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        arrived_on, _ = _local(request)
        host = request.headers.get("Host", "")
        if not self.hosts.allows(host, arrived_on):
            raise web.HTTPMisdirectedRequest(
                text=f"Host {host[:100]!r} is not a name of this server (http_public_names)\n"
            )
        if request.method not in SAFE_METHODS:
            origin = request.headers.get("Origin", "")
            parts = urlsplit(origin)
            same = host_name(parts.netloc) == host_name(host) and parts.scheme in ("http", "https")
            if not same or not self.hosts.allows(parts.netloc, arrived_on):
                raise web.HTTPForbidden(text=f"Origin {origin[:100]!r} is not this server\n")
        if self.sessions is not None and request.path != LOGIN_PATH:
            request[_SESSION] = await self._session(request, self.sessions)
        return await handler(request)

    async def _session(self, request: web.Request, sessions: Sessions) -> Session:
        """The request's live session, or a new one from its basic-auth login; else the
        refusal (401, 429)."""
        session = sessions.get(request.cookies.get(self._cookie_name(request), ""))
        try:
            if session is not None and session.stored is not None and self.users is not None:
                now = self.users.stored(session.user) or ""
                if not hmac.compare_digest(now.encode(), session.stored.encode()):
                    sessions.end(session)  # the user was removed or changed password
                    session = None
            if session is None:
                name = await self._basic_login(request)
                assert self.users is not None  # a basic-auth login needs the users file
                cookie, session = sessions.start(name, self.users.stored(name))
                request[_NEW_COOKIE] = cookie
        except ConfigError as exc:
            raise web.HTTPServiceUnavailable(text=f"{exc}\n") from None
        return session

    async def _basic_login(self, request: web.Request) -> str:
        """The user the request's basic auth names, its password right; else the refusal."""
        if self.users is None:
            raise web.HTTPUnauthorized(
                text="log in with the one-time link 'fleetctl dashboard' prints\n"
            )
        given = credentials(request.headers.get("Authorization", ""))
        if given is None:
            raise web.HTTPUnauthorized(headers={"WWW-Authenticate": REALM}, text="log in\n")
        name, password = given
        keys = (address_key(request.remote), f"user {name}")
        wait = self.throttle.wait(keys)
        if wait > 0:
            seconds = math.ceil(wait)
            raise web.HTTPTooManyRequests(
                headers={"Retry-After": str(seconds)},
                text=f"too many failed logins: try again in {seconds} s\n",
            )
        self.throttle.tried(keys)
        async with self._hashing:
            right = await asyncio.to_thread(self.users.check, name, password)
        if right:
            self.throttle.passed(keys)
        else:
            log.warning(
                "http login refused",
                extra={"user": name[:64], "client": address_key(request.remote)},
            )
            raise web.HTTPUnauthorized(headers={"WWW-Authenticate": REALM}, text="log in\n")
        return name

    def alive(self, session: Session) -> bool:
        """``session`` is still live (a long answer, an event stream, checks as it goes)."""
        return self.sessions is not None and self.sessions.alive(session)

    def log_in_with_link(self, request: web.Request, public_key: str) -> bool:
        """Redeem the one-time link token of ``request`` (``?t=``), made with
        ``public_key``'s key: a new session for it (its cookie set on the answer), True;
        False if the token is not good (used, expired, forged)."""
        if self.sessions is None:
            return False
        if not self.links.redeem(request.query.get("t", ""), public_key, time.time()):
            return False
        cookie, _ = self.sessions.start("link")
        request[_NEW_COOKIE] = cookie
        log.info("dashboard login by one-time link", extra={"client": address_key(request.remote)})
        return True

    def _cookie_name(self, request: web.Request) -> str:
        _, port = _local(request)
        return f"fleet_session_{port}" if port is not None else "fleet_session"

    async def _set_cookie(self, request: web.Request, response: web.StreamResponse) -> None:
        # A header, not response.set_cookie: aiohttp renders cookies before this hook.
        cookie = request.get(_NEW_COOKIE)
        if cookie is None or self.sessions is None:
            return
        morsel: Morsel[str] = Morsel()
        morsel.set(self._cookie_name(request), cookie, cookie)
        morsel.update({"path": "/", "max-age": str(int(self.sessions.lifetime))})
        # Morsel writes a flag for a non-empty value.
        morsel.update(
            {"httponly": "yes", "samesite": "Strict", "secure": "yes" if self.secure else ""}
        )
        response.headers.add("Set-Cookie", morsel.OutputString())


ACCESS = web.AppKey("access", Access)
"""The app's :class:`Access`, for handlers that start sessions (the one-time link)."""
