"""A stand-in for llama.cpp's ``llama-server``, run as a real process by the workload tests:
``python -m tests.support.llamacpp_standin --host 127.0.0.1 --port 8080 -m model.gguf``.

It behaves as llama.cpp's server README documents (ggml-org/llama.cpp,
``tools/server/README.md``): it listens on ``--host``/``--port`` and serves the model of
``-m``; ``GET /health`` answers 503 ``{"error": {"code": 503, "message": "Loading model",
"type": "unavailable_error"}}`` while the model loads and then 200 ``{"status": "ok"}``;
``GET /v1/models`` lists the model (its id is the ``-m`` path, or ``--alias``);
``POST /v1/chat/completions`` and ``POST /v1/completions`` answer in OpenAI's format, and
with ``"stream": true`` as server-sent events (``data: {...}`` chunks, then
``data: [DONE]``); ``GET /metrics`` has the gauges ``llamacpp:requests_processing`` and
``llamacpp:requests_deferred``. What the tests need besides, each a flag or an environment
variable: how long loading takes (``--load-time``/``STANDIN_LOAD_TIME``), a delay between
stream chunks (``--chunk-delay``/``STANDIN_CHUNK_DELAY``), exiting with code 3 after some
seconds (``--crash-after``/``STANDIN_CRASH_AFTER``), never finishing loading
(``--hang``/``STANDIN_HANG=1``), and a child process in its group (``--spawn-child``/
``STANDIN_SPAWN_CHILD=1``), so a stop that kills only the leader leaves an orphan.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from typing import Any

from aiohttp import web

WORDS = ["Hello", " from", " the", " stand", "-in", "."]


class Standin:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.model = args.alias or args.model
        self.started = time.monotonic()
        self.processing = 0
        self.deferred = 0

    def loading(self) -> bool:
        return bool(self.args.hang) or time.monotonic() - self.started < self.args.load_time

    async def health(self, _: web.Request) -> web.Response:
        if self.loading():
            error = {"code": 503, "message": "Loading model", "type": "unavailable_error"}
            return web.json_response({"error": error}, status=503)
        return web.json_response({"status": "ok"})

    async def models(self, _: web.Request) -> web.Response:
        entry = {
            "id": self.model,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "llamacpp",
        }
        return web.json_response({"object": "list", "data": [entry]})

    async def metrics(self, _: web.Request) -> web.Response:
        text = (
            "# HELP llamacpp:requests_processing Number of requests processing.\n"
            "# TYPE llamacpp:requests_processing gauge\n"
            f"llamacpp:requests_processing {self.processing}\n"
            "# HELP llamacpp:requests_deferred Number of requests deferred.\n"
            "# TYPE llamacpp:requests_deferred gauge\n"
            f"llamacpp:requests_deferred {self.deferred}\n"
        )
        return web.Response(text=text, content_type="text/plain")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, chat=False)

    async def _complete(self, request: web.Request, chat: bool) -> web.StreamResponse:
        if self.loading():
            return await self.health(request)
        try:
            body: dict[str, Any] = await request.json()
        except ValueError:
            error = {"code": 400, "message": "invalid JSON", "type": "invalid_request_error"}
            return web.json_response({"error": error}, status=400)
        kind = "chat.completion" if chat else "text_completion"
        self.processing += 1
        try:
            if not body.get("stream"):
                await asyncio.sleep(self.args.chunk_delay * len(WORDS))
                text = "".join(WORDS)
                choice: dict[str, Any] = {"index": 0, "finish_reason": "stop"}
                if chat:
                    choice["message"] = {"role": "assistant", "content": text}
                else:
                    choice["text"] = text
                return web.json_response(
                    {"id": "cmpl-standin", "object": kind, "model": self.model, "choices": [choice]}
                )
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            for word in WORDS:
                await asyncio.sleep(self.args.chunk_delay)
                delta: dict[str, Any] = {"index": 0, "finish_reason": None}
                if chat:
                    delta["delta"] = {"content": word}
                else:
                    delta["text"] = word
                chunk = {"id": "cmpl-standin", "object": f"{kind}.chunk", "choices": [delta]}
                await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        finally:
            self.processing -= 1


def parse(argv: list[str]) -> argparse.Namespace:
    env = os.environ
    parser = argparse.ArgumentParser(description="llama-server stand-in for tests")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8080, help="port to listen on")
    parser.add_argument("-m", "--model", default="model.gguf", help="model path")
    parser.add_argument("--alias", default="", help="model name to serve it as")
    parser.add_argument(
        "--load-time",
        type=float,
        default=float(env.get("STANDIN_LOAD_TIME", "0.3")),
        help="seconds /health answers 503",
    )
    parser.add_argument(
        "--chunk-delay",
        type=float,
        default=float(env.get("STANDIN_CHUNK_DELAY", "0.01")),
        help="seconds between stream chunks",
    )
    parser.add_argument(
        "--crash-after",
        type=float,
        default=float(env.get("STANDIN_CRASH_AFTER", "0")),
        help="exit with code 3 after this many seconds (0: never)",
    )
    parser.add_argument(
        "--hang",
        action="store_true",
        default=env.get("STANDIN_HANG") == "1",
        help="never finish loading",
    )
    parser.add_argument(
        "--spawn-child",
        action="store_true",
        default=env.get("STANDIN_SPAWN_CHILD") == "1",
        help="start a child process in the same process group",
    )
    return parser.parse_args(argv)


async def serve(args: argparse.Namespace) -> None:
    standin = Standin(args)
    app = web.Application()
    app.router.add_get("/health", standin.health)
    app.router.add_get("/v1/models", standin.models)
    app.router.add_get("/metrics", standin.metrics)
    app.router.add_post("/v1/chat/completions", standin.chat)
    app.router.add_post("/v1/completions", standin.completions)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, args.host, args.port).start()
    print(f"standin listening on {args.host}:{args.port} model {standin.model}", flush=True)
    child = None
    if args.spawn_child:
        code = "import time\nwhile True: time.sleep(1)"
        # Blocking is fine here: the server has no client yet that could wait on it.
        child = subprocess.Popen([sys.executable, "-c", code])  # noqa: ASYNC220
        print(f"standin child {child.pid}", flush=True)
    try:
        if args.crash_after > 0:
            await asyncio.sleep(args.crash_after)
            print("standin crashing", flush=True)
            os._exit(3)
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def main() -> None:
    asyncio.run(serve(parse(sys.argv[1:])))


if __name__ == "__main__":
    main()
