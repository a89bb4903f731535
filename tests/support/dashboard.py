"""The dashboard as the tests run it: an aggregator, its fleet API and the dashboard on a
free loopback port, headless Chromium (Debian's ``chromium`` through Playwright's
``executable_path``), the logins a test needs (a one-time link, basic auth), and nodes
that beat once, signed, without an agent (:func:`beat`), and the fleet's facts written
where their writers write them (:func:`put_fact`)."""

from __future__ import annotations

import base64
import shutil
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import msgspec
import pytest

from actors.fleet.metrics import AggregatorMetrics
from actors.fleet.remediation.actor import policy_bucket
from actors.fleet.storage.registry import approve
from actors.fleet.views.api import FleetApiActor
from actors.fleet.views.dashboard.actor import DashboardActor
from actors.fleet.views.dashboard.held_nodes import HeldNodes
from actors.runtime.login_links import login_link
from schemas import codec, signing
from schemas.messages import NodeRecord
from schemas.subjects import BUCKET_POLICY, Subjects
from tests.support.fleet import Fleet, heartbeat, new_aggregator


async def start_dashboard(fleet: Fleet, **settings: Any) -> tuple[str, Any]:
    """An aggregator, its fleet API and the dashboard on it; the page's base URL and,
    with ``allow_ui_commands``, the key it signs commands and login links with."""
    aggregator = new_aggregator(fleet.bus, fleet.prefix, **settings)
    metrics = aggregator.metrics
    assert isinstance(metrics, AggregatorMetrics)
    config = msgspec.structs.replace(aggregator.config, http_port=0)
    api = FleetApiActor(config, fleet.bus, metrics, dict, aggregator.view)
    key = signing.KeyPair.generate() if settings.get("allow_ui_commands") else None
    dashboard = DashboardActor(config, fleet.bus, api, HeldNodes(aggregator.view), key)
    api.routes = dashboard.routes
    await fleet.start_supervisor(aggregator, api, dashboard)
    return f"http://127.0.0.1:{api.port}", key


@asynccontextmanager
async def chromium_at(path: str) -> AsyncIterator[Any]:
    """Headless Chromium at ``path`` (Debian's), driven by Playwright; closed after."""
    from playwright.async_api import async_playwright

    async with async_playwright() as driver:
        launched = await driver.chromium.launch(executable_path=path, args=["--no-sandbox"])
        try:
            yield launched
        finally:
            await launched.close()


def chromium_or_exit() -> str:
    """Chromium's path, for a script: one error line and exit where it is missing."""
    path = shutil.which("chromium")
    if path is None:
        raise SystemExit("error: chromium is not installed (Debian package chromium)")
    return path


@asynccontextmanager
async def launched_browser() -> AsyncIterator[Any]:
    """Headless Chromium, or a skip saying why there is none."""
    path = shutil.which("chromium")
    if path is None:
        pytest.skip("chromium is not installed (Debian package chromium; .ci/run installs it)")
    pytest.importorskip("playwright.async_api", reason="the test extra brings playwright")
    async with chromium_at(path) as launched:
        yield launched


def link(url: str, key: signing.KeyPair) -> str:
    """A fresh one-time login link to the dashboard at ``url``."""
    return login_link(url, key, time.time())


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def client() -> aiohttp.ClientSession:
    """A plain client that keeps cookies of an IP-addressed host (aiohttp's default jar
    drops them), with a bound on each request."""
    return aiohttp.ClientSession(
        cookie_jar=aiohttp.CookieJar(unsafe=True),
        timeout=aiohttp.ClientTimeout(total=30),
        connector=aiohttp.TCPConnector(limit=0),
    )


async def logged_in(session: aiohttp.ClientSession, url: str, key: signing.KeyPair) -> None:
    """``session`` holds a dashboard login: a one-time link redeemed, its cookie kept."""
    async with session.get(link(url, key), allow_redirects=False) as answer:
        assert answer.status == 303, await answer.text()
    assert any(cookie.key.startswith("fleet_session_") for cookie in session.cookie_jar)


async def form_token(session: aiohttp.ClientSession, url: str, node: str) -> str:
    """The command form's token on ``node``'s page, as the session sees it now."""
    async with session.get(f"{url}/ui/nodes/{node}") as page:
        text = await page.text()
        assert page.status == 200, text
    return text.split('name="token" value="', 1)[1].split('"', 1)[0]


async def beat(fleet: Fleet, node: str, seq: int = 1, **changes: Any) -> signing.KeyPair:
    """One signed heartbeat of ``node`` (cluster c1, approved first), as its agent would
    publish it, with ``changes``; its Nats-TTL is its ``stale_after``, so a node that
    beats once goes stale that long after. The node's key."""
    key = fleet.node_key(node)
    await approve(fleet.bus, Subjects(fleet.prefix), node, key.public_key)
    body = codec.encode(heartbeat(node, seq, **changes))
    ttl = f"{float(changes.get('stale_after', 2.0)):.0f}"
    headers = {**key.headers(body), "Nats-Msg-Id": f"{node}:b1:{seq}", "Nats-TTL": ttl}
    await fleet.bus.js.publish(Subjects(fleet.prefix).heartbeat("c1", node), body, headers=headers)
    return key


async def put_fact(fleet: Fleet, bucket: str, key: str, value: Any) -> None:
    """``value`` stored under ``key`` in the fleet's bucket ``bucket`` (maintenance windows,
    placed workloads, ...); the policy's bucket is made as the policy makes it on its
    first write (direct gets on, which the pages' reads use)."""
    subjects = Subjects(fleet.prefix)
    if bucket == BUCKET_POLICY:
        store = await fleet.bus.js.create_key_value(config=policy_bucket(subjects))
    else:
        store = await fleet.bus.kv(subjects.bucket_name(bucket))
    await store.put(key, codec.encode(value))


class CountedView:
    """A fleet view whose records a test sets, counting the passes over every record."""

    def __init__(self, records: dict[str, NodeRecord]) -> None:
        self.records = records
        self.passes = 0
        self.complete = True
        """Whether ``records`` is every node (False: as a live feed catching up)."""

    def current(self) -> dict[str, NodeRecord]:
        self.passes += 1
        return dict(self.records)

    def record(self, node: str) -> NodeRecord | None:
        return self.records.get(node)

    async def live_records(self, records: list[NodeRecord]) -> list[NodeRecord]:
        return records
