"""Passing one request to a workload and its answer back, chunk by chunk as it comes
(server-sent events are never buffered); what goes wrong upstream becomes the gateway's
own OpenAI-format answer (502, 504) while nothing was sent, and a cut-short stream after."""

from __future__ import annotations

import logging
from typing import Final

import aiohttp
from aiohttp import hdrs, web

from actors.node.gateway.access import Refusal
from schemas.events import Workload

log = logging.getLogger(__name__)

WORKLOAD_HOST: Final = "127.0.0.1"
"""Where every workload listens (the node binds them there, or publishes a container's
port there)."""
PASSED_HEADERS: Final = (hdrs.CONTENT_TYPE, hdrs.AUTHORIZATION, hdrs.ACCEPT)
"""Request headers passed to the workload (an engine started with an API key wants it)."""


async def pass_through(
    session: aiohttp.ClientSession,
    request: web.Request,
    workload: Workload,
    body: bytes,
    *,
    keep_authorization: bool,
    read_timeout: float,
) -> web.StreamResponse:
    """Send ``body`` to the workload and its answer back, chunk by chunk as it comes;
    ``Authorization`` is passed only with ``keep_authorization``."""
    url = f"http://{WORKLOAD_HOST}:{workload.port}{request.path}"
    passed = [n for n in PASSED_HEADERS if keep_authorization or n != hdrs.AUTHORIZATION]
    headers = {name: request.headers[name] for name in passed if name in request.headers}
    response = web.StreamResponse()
    # One request per connection (runtime.web), said in the headers before they are
    # sent: a client that kept the connection would find it closed under its next one.
    response.force_close()
    try:
        async with session.post(url, data=body, headers=headers) as upstream:
            response.set_status(upstream.status, upstream.reason)
            if hdrs.CONTENT_TYPE in upstream.headers:
                response.headers[hdrs.CONTENT_TYPE] = upstream.headers[hdrs.CONTENT_TYPE]
            response.headers[hdrs.CACHE_CONTROL] = "no-cache"
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response
    except aiohttp.ClientConnectorError as exc:
        if not response.prepared:
            raise Refusal(
                502,
                f"workload {workload.name!r} cannot be reached: {exc.os_error.strerror or exc}",
                "server_error",
                "upstream_unreachable",
            ) from None
        reason = str(exc)
    except TimeoutError:
        if not response.prepared:
            raise Refusal(
                504,
                f"workload {workload.name!r} did not answer within {read_timeout:g}s",
                "server_error",
                "upstream_timeout",
            ) from None
        reason = f"silent for {read_timeout:g}s"
    except ConnectionResetError:
        # The client left; leaving the upstream context closes its connection, which
        # stops the engine's generation too.
        reason = "client disconnected"
    except aiohttp.ClientError as exc:
        if not response.prepared:
            raise Refusal(
                502,
                f"workload {workload.name!r} failed: {type(exc).__name__}",
                "server_error",
                "upstream_error",
            ) from None
        reason = f"{type(exc).__name__}: {exc}"
    log.warning(
        "gateway answer cut short",
        extra={"workload": workload.name, "path": request.path, "reason": reason},
    )
    return response
