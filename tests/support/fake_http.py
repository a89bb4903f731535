"""Small local aiohttp servers that stand in for inference engines in tests."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from aiohttp import web

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@asynccontextmanager
async def serve(routes: dict[str, Handler]) -> AsyncIterator[str]:
    """Serve ``routes`` (path -> handler of every method) on a free loopback port; yield the
    base URL."""
    app = web.Application()
    for path, handler in routes.items():
        app.router.add_route("*", path, handler)
    # A hung handler must not hold cleanup for aiohttp's default 60 s.
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


def text(body: str, status: int = 200) -> Handler:
    async def handler(request: web.Request) -> web.Response:
        return web.Response(text=body, status=status)

    return handler


def json_body(body: object, status: int = 200) -> Handler:
    async def handler(request: web.Request) -> web.Response:
        return web.json_response(body, status=status)

    return handler
