"""Serving a bounded aiohttp app (actors.runtime.web)."""

from __future__ import annotations

import aiohttp
from aiohttp import web

from actors.runtime.web import HttpLimits, serving

MAX_CONNECTIONS = 4


async def test_connection_cap_counts_open_connections_not_past_requests() -> None:
    """Many more short requests than max_connections, one after another, are all served:
    only open connections count toward the cap, however long request_timeout is."""

    async def hello(request: web.Request) -> web.Response:
        return web.Response(text="hi")

    app = web.Application()
    app.router.add_get("/", hello)
    limits = HttpLimits(max_connections=MAX_CONNECTIONS, request_timeout=60.0)
    async with (
        serving(app, "127.0.0.1", 0, limits) as port,
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session,
    ):
        statuses = []
        for _ in range(MAX_CONNECTIONS * 5):
            async with session.get(f"http://127.0.0.1:{port}/") as response:
                statuses.append(response.status)
    assert statuses == [200] * (MAX_CONNECTIONS * 5)
