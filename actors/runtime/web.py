"""Serving a small aiohttp app for as long as an actor runs, and Prometheus pages."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger(__name__)

CLEANUP_TIMEOUT = 5.0


@asynccontextmanager
async def serving(app: web.Application, host: str, port: int) -> AsyncIterator[int]:
    """Serve ``app`` on host:port (0 picks a free port) and yield the bound port; on the
    way out the server is shut down within ``CLEANUP_TIMEOUT``."""
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=CLEANUP_TIMEOUT / 2)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound = int(runner.addresses[0][1])
        log.info("http listening", extra={"host": host, "port": bound})
        yield bound
    finally:
        try:
            await asyncio.wait_for(runner.cleanup(), CLEANUP_TIMEOUT)
        except TimeoutError:
            log.warning("http server did not shut down in time")


def prometheus_page(registry: CollectorRegistry) -> web.Response:
    response = web.Response(body=generate_latest(registry))
    # CONTENT_TYPE_LATEST carries a charset parameter, which aiohttp's content_type refuses.
    response.headers["Content-Type"] = CONTENT_TYPE_LATEST
    return response
