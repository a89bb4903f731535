"""Who may use the dashboard, tried as an attacker would, with plain aiohttp clients and
headless Chromium: with commands on, every request needs a login (a one-time link or a
users-file user), a foreign Host (DNS rebinding), a mismatched Origin and a stale or
reused form token are refused and send nothing; one client's event streams cannot
starve another's page; password guessing is throttled."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from nats.aio.msg import Msg

from actors.fleet.config import AggregatorConfig
from actors.fleet.views.api import exposure
from actors.runtime.http_login import hash_password
from actors.runtime.supervisor import FatalError
from schemas import codec
from schemas.messages import Command, Cordon
from schemas.subjects import Subjects
from tests.support.dashboard import (
    basic,
    client,
    form_token,
    link,
    logged_in,
    start_dashboard,
)
from tests.support.fleet import Fleet, wait_for, wait_record
from tests.support.pki import Pki

PASSWORD = "correct horse battery"


def users_file(tmp_path: Path, *names: str) -> Path:
    """A users file of ``names``, each with PASSWORD (cheap hashes: a test's)."""
    path = tmp_path / "users"
    path.write_text("".join(f"{n}:{hash_password(PASSWORD, iterations=1000)}\n" for n in names))
    return path


async def test_a_users_file_login_in_the_browser_sends_a_cordon(
    fleet: Fleet, browser: Any, tmp_path: Path
) -> None:
    """On loopback with commands on and a users file, the browser's basic-auth login
    opens the node page (a session from then on) and its confirmed cordon takes effect;
    without credentials the page is 401."""
    url, key = await start_dashboard(
        fleet, allow_ui_commands=True, http_users_file=str(users_file(tmp_path, "alice"))
    )
    await fleet.start_agent(fleet.config("n1", trust_operators=[key.public_key]))
    await wait_record(fleet.bus, fleet.prefix, "n1", lambda r: r.state == "active", 30)
    async with client() as anonymous, anonymous.get(url + "/ui/nodes/n1") as refused:
        assert refused.status == 401
    context = await browser.new_context(
        http_credentials={"username": "alice", "password": PASSWORD}
    )
    page = await context.new_page()
    assert (await page.goto(url + "/ui/nodes/n1")).status == 200
    page.on("dialog", lambda dialog: dialog.accept())
    await page.click("button[value=cordon]")
    await page.wait_for_selector("p.notice")
    assert "cordon sent" in await page.inner_text("p.notice")
    record = await wait_record(
        fleet.bus, fleet.prefix, "n1", lambda r: r.schedulability == "cordoned", 20
    )
    assert record.schedulability == "cordoned"
    await context.close()


async def test_refused_requests_send_nothing(fleet: Fleet) -> None:
    """With commands on, on loopback: no login (page and post) is 401; a foreign Host
    (what a DNS-rebinding page sends, with its matching Origin and Sec-Fetch-Site) is 421;
    a mismatched or missing Origin is 403; a stale token and a reused one are 403; none
    of them sends a command: the only commands published are the two legitimate ones."""
    url, key = await start_dashboard(fleet, allow_ui_commands=True)
    await fleet.start_agent(fleet.config("n1", trust_operators=[key.public_key]))
    await wait_record(fleet.bus, fleet.prefix, "n1", lambda r: r.state == "active", 30)
    sent: list[Command] = []

    async def heard(msg: Msg) -> None:
        sent.append(codec.decode(msg.data, Command, msg.subject))

    listener = await fleet.bus.nc.subscribe(Subjects(fleet.prefix).commands(), cb=heard)
    await fleet.bus.nc.flush()
    command = url + "/ui/nodes/n1/command"
    rebind = "rebind.attacker.example"
    async with client() as anonymous, client() as person:
        async with anonymous.get(url + "/") as page:
            assert page.status == 401
        async with anonymous.post(
            command, data={"action": "drain", "token": "x"}, headers={"Origin": url}
        ) as post:
            assert post.status == 401

        await logged_in(person, url, key)
        token = await form_token(person, url, "n1")
        for headers in (
            {"Host": rebind, "Origin": f"http://{rebind}", "Sec-Fetch-Site": "same-origin"},
            {"Host": f"{rebind}:80", "Origin": f"http://{rebind}"},
        ):
            async with person.post(
                command, data={"action": "uncordon", "token": token}, headers=headers
            ) as foreign:
                assert foreign.status == 421, await foreign.text()
        async with person.get(url + "/", headers={"Host": rebind}) as read:
            assert read.status == 421
        for origin in ("http://evil.example", "null", f"http://{rebind}", None):
            headers = {"Origin": origin} if origin else {}
            async with person.post(
                command, data={"action": "drain", "token": token}, headers=headers
            ) as mismatched:
                assert mismatched.status == 403, origin

        # A post that fails after the token check (an unknown action) spends the token.
        async with person.post(
            command, data={"action": "reboot", "token": token}, headers={"Origin": url}
        ) as unknown:
            assert unknown.status == 400
        async with person.post(
            command, data={"action": "drain", "token": token}, headers={"Origin": url}
        ) as stale:
            assert stale.status == 403 and "stale" in await stale.text()

        fresh = await form_token(person, url, "n1")
        async with person.post(
            command,
            data={"action": "cordon", "token": fresh},
            headers={"Origin": url},
            allow_redirects=False,
        ) as good:
            assert good.status == 303
        async with person.post(
            command, data={"action": "uncordon", "token": fresh}, headers={"Origin": url}
        ) as reused:
            assert reused.status == 403
        # The last legitimate post: commands are heard in the order sent, so a refused
        # one that had been sent would be heard before it.
        last = await form_token(person, url, "n1")
        async with person.post(
            command,
            data={"action": "cordon", "token": last, "reason": "last"},
            headers={"Origin": url},
            allow_redirects=False,
        ) as good:
            assert good.status == 303
    await wait_for(lambda: any(c.reason == "last" for c in sent))
    await listener.unsubscribe()
    assert [(c.node_id, type(c.action)) for c in sent] == [("n1", Cordon), ("n1", Cordon)]
    record = await wait_record(
        fleet.bus, fleet.prefix, "n1", lambda r: r.schedulability == "cordoned", 20
    )
    assert record.state != "draining"


async def test_a_read_only_page_refuses_a_foreign_host(fleet: Fleet) -> None:
    """Read-only on loopback needs no login, but a DNS-rebinding page (foreign Host) reads
    nothing: the page, the node list and the streams are 421; localhost is served."""
    url, _ = await start_dashboard(fleet)
    port = url.rsplit(":", 1)[1]
    async with client() as session:
        for path in ("/", "/nodes", "/ui/events", "/metrics"):
            async with session.get(url + path, headers={"Host": "rebind.attacker.example"}) as r:
                assert r.status == 421, path
                assert "http_public_names" in await r.text()
        async with session.get(url + "/", headers={"Host": f"localhost:{port}"}) as page:
            assert page.status == 200
        async with session.get(url + "/") as page:
            assert page.status == 200


async def test_seventy_streams_of_one_client_leave_another_page_live(
    fleet: Fleet, browser: Any
) -> None:
    """One logged-in client opening 70 event streams gets dashboard_streams_per_client of
    them (the rest 429), a client without a login none (401); another person's page stays
    live and shows a node that joins meanwhile."""
    url, key = await start_dashboard(fleet, allow_ui_commands=True)
    await fleet.start_agent(fleet.config("n1"))
    page = await browser.new_page()
    await page.goto(link(url, key))
    await page.wait_for_selector("tr[data-node='n1']", timeout=20_000)
    await page.wait_for_selector("#live.on", timeout=10_000)
    async with client() as hog, client() as anonymous, contextlib.AsyncExitStack() as held:
        await logged_in(hog, url, key)

        async def open_stream(session: aiohttp.ClientSession) -> int:
            response = await held.enter_async_context(session.get(url + "/ui/events"))
            return response.status

        statuses = await asyncio.gather(*(open_stream(hog) for _ in range(70)))
        assert sorted(statuses) == [200] * 4 + [429] * 66
        strangers = await asyncio.gather(*(open_stream(anonymous) for _ in range(70)))
        assert strangers == [401] * 70
        await fleet.start_agent(fleet.config("n2"))
        await page.wait_for_selector("tr[data-node='n2']", timeout=20_000)
        assert await page.inner_text("#live") == "live"


async def test_a_stream_closes_after_its_lifetime(fleet: Fleet) -> None:
    """An event stream ends after dashboard_stream_lifetime, telling the page to open
    another, and its slot is free again."""
    url, key = await start_dashboard(
        fleet, allow_ui_commands=True, dashboard_stream_lifetime=1.0, dashboard_streams_per_client=1
    )
    async with client() as session:
        await logged_in(session, url, key)
        for _ in range(2):  # the second is admitted once the first ended
            async with session.get(url + "/ui/events") as stream:
                assert stream.status == 200
                body = await asyncio.wait_for(stream.text(), timeout=15)
            assert body.endswith("event: reconnect\ndata: \n\n")


async def test_guessing_passwords_gets_429(fleet: Fleet, tmp_path: Path) -> None:
    """With http_login_attempts = 3: a fourth try from an address that failed three times
    is 429 with Retry-After, even with the right password; a user name that failed three
    times (from another address) is 429 from anywhere; another user is let in; of ten
    tries sent at once from a fresh address three are checked, seven refused."""
    url, _ = await start_dashboard(
        fleet,
        http_users_file=str(users_file(tmp_path, "alice", "bob")),
        http_login_attempts=3,
    )

    async def attempt(source: str, user: str, password: str) -> tuple[int, str]:
        connector = aiohttp.TCPConnector(local_addr=(source, 0))
        async with aiohttp.ClientSession(connector=connector) as session:
            headers = {"Authorization": basic(user, password)}
            async with session.get(url + "/nodes", headers=headers) as answer:
                return answer.status, answer.headers.get("Retry-After", "")

    wrong = [await attempt("127.0.0.1", "mallory", f"guess {n}") for n in range(3)]
    assert wrong == [(401, "")] * 3
    status, retry = await attempt("127.0.0.1", "alice", PASSWORD)
    assert status == 429 and 0 < int(retry) <= 60
    assert [await attempt("127.0.0.2", "alice", f"guess {n}") for n in range(3)] == [(401, "")] * 3
    status, retry = await attempt("127.0.0.3", "alice", PASSWORD)
    assert status == 429 and int(retry) > 0
    assert await attempt("127.0.0.3", "bob", PASSWORD) == (200, "")
    burst = await asyncio.gather(*(attempt("127.0.0.4", f"user{n}", "guess") for n in range(10)))
    assert sorted(status for status, _ in burst) == [401] * 3 + [429] * 7


async def test_a_session_ends_with_its_user(fleet: Fleet, tmp_path: Path) -> None:
    """Over TLS beyond loopback, a basic-auth login starts a session whose cookie is
    HttpOnly, SameSite=Strict and Secure, and which lets the client in without its
    password; once the user is removed from the users file the cookie is refused."""
    pki = Pki(tmp_path / "tls")
    users = users_file(tmp_path, "alice", "bob")
    url, _ = await start_dashboard(
        fleet,
        http_host="0.0.0.0",
        http_tls_cert=str(pki.dir / "server.pem"),
        http_tls_key=str(pki.dir / "server-key.pem"),
        http_users_file=str(users),
    )
    https = url.replace("http://", "https://")
    connector = aiohttp.TCPConnector(ssl=pki.client())
    jar = aiohttp.CookieJar(unsafe=True)
    async with aiohttp.ClientSession(connector=connector, cookie_jar=jar) as session:
        async with session.get(
            https + "/nodes", headers={"Authorization": basic("alice", PASSWORD)}
        ) as first:
            assert first.status == 200
            cookie = first.headers["Set-Cookie"]
        assert cookie.startswith("fleet_session_")
        for flag in ("HttpOnly", "SameSite=Strict", "Secure", "Path=/", "Max-Age=43200"):
            assert flag in cookie.split("; "), cookie
        async with session.get(https + "/nodes") as again:
            assert again.status == 200, "the session, without the password"
        users.write_text(users.read_text().split("\n", 1)[1])  # alice's line gone
        async with session.get(https + "/nodes") as removed:
            assert removed.status == 401


def test_a_public_name_that_is_not_a_host_stops_the_start() -> None:
    """http_public_names holding a URL (not a host name) is a one-line fatal error."""
    config = AggregatorConfig(http_public_names=["https://fleet.example.com/"])
    with pytest.raises(FatalError, match="not a host name or address"):
        exposure(config, web.Application())


async def test_a_page_follows_its_streams_across_their_lifetimes(
    fleet: Fleet, browser: Any
) -> None:
    """With streams lasting a second, a page opens one after another by itself and stays
    live: a node that joins after several have ended still shows."""
    url, key = await start_dashboard(
        fleet, allow_ui_commands=True, dashboard_stream_lifetime=1.0, dashboard_streams_per_client=1
    )
    page = await browser.new_page()
    opened: list[str] = []
    page.on("request", lambda r: opened.append(r.url) if "/ui/events" in r.url else None)
    await page.goto(link(url, key))
    await wait_for(lambda: len(opened) >= 4)
    await fleet.start_agent(fleet.config("n1"))
    await page.wait_for_selector("tr[data-node='n1']", timeout=20_000)
    await page.wait_for_selector("#live.on", timeout=10_000)
