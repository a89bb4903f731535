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

Built on the standard library's threaded HTTP server: the suite starts it about sixty
times, and importing aiohttp (its TLS contexts load the system's CA certificates) cost
more CPU than all it serves.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

WORDS = ["Hello", " from", " the", " stand", "-in", "."]


class Standin:
    """The model's state: when loading started, and the requests in flight."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.model = args.alias or args.model
        self.started = time.monotonic()
        self.processing = 0
        self.deferred = 0
        self.lock = threading.Lock()

    def loading(self) -> bool:
        return bool(self.args.hang) or time.monotonic() - self.started < self.args.load_time

    def metrics(self) -> str:
        return (
            "# HELP llamacpp:requests_processing Number of requests processing.\n"
            "# TYPE llamacpp:requests_processing gauge\n"
            f"llamacpp:requests_processing {self.processing}\n"
            "# HELP llamacpp:requests_deferred Number of requests deferred.\n"
            "# TYPE llamacpp:requests_deferred gauge\n"
            f"llamacpp:requests_deferred {self.deferred}\n"
        )

    def processing_by(self, step: int) -> None:
        with self.lock:
            self.processing += step


class Handler(BaseHTTPRequestHandler):
    """One request, as llama-server answers it (HTTP/1.1, kept alive)."""

    protocol_version = "HTTP/1.1"
    standin: Standin

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: the tests read the stand-in's output for its own lines only."""

    def do_GET(self) -> None:
        if self.path == "/health":
            self._health()
        elif self.path == "/v1/models":
            entry = {
                "id": self.standin.model,
                "object": "model",
                "created": int(time.time()),
                "owned_by": "llamacpp",
            }
            self._json({"object": "list", "data": [entry]})
        elif self.path == "/metrics":
            self._send(200, "text/plain; charset=utf-8", self.standin.metrics().encode())
        else:
            self._json({"error": {"code": 404, "message": "File Not Found"}}, 404)

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length)
        if self.path not in ("/v1/chat/completions", "/v1/completions"):
            self._json({"error": {"code": 404, "message": "File Not Found"}}, 404)
            return
        if self.standin.loading():
            self._health()
            return
        try:
            body: dict[str, Any] = json.loads(raw)
        except ValueError:
            error = {"code": 400, "message": "invalid JSON", "type": "invalid_request_error"}
            self._json({"error": error}, 400)
            return
        self.standin.processing_by(1)
        try:
            self._complete(body, chat=self.path == "/v1/chat/completions")
        finally:
            self.standin.processing_by(-1)

    def _complete(self, body: dict[str, Any], chat: bool) -> None:
        kind = "chat.completion" if chat else "text_completion"
        delay = self.standin.args.chunk_delay
        if not body.get("stream"):
            time.sleep(delay * len(WORDS))
            text = "".join(WORDS)
            choice: dict[str, Any] = {"index": 0, "finish_reason": "stop"}
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            model = self.standin.model
            self._json({"id": "cmpl-standin", "object": kind, "model": model, "choices": [choice]})
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for word in WORDS:
            time.sleep(delay)
            delta: dict[str, Any] = {"index": 0, "finish_reason": None}
            if chat:
                delta["delta"] = {"content": word}
            else:
                delta["text"] = word
            chunk = {"id": "cmpl-standin", "object": f"{kind}.chunk", "choices": [delta]}
            self._chunk(f"data: {json.dumps(chunk)}\n\n".encode())
        self._chunk(b"data: [DONE]\n\n")
        self._chunk(b"")

    def _chunk(self, data: bytes) -> None:
        """One chunk of a chunked body (an empty one ends it), sent at once."""
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _health(self) -> None:
        if self.standin.loading():
            error = {"code": 503, "message": "Loading model", "type": "unavailable_error"}
            self._json({"error": error}, 503)
        else:
            self._json({"status": "ok"})

    def _json(self, value: Any, status: int = 200) -> None:
        self._send(status, "application/json; charset=utf-8", json.dumps(value).encode())

    def _send(self, status: int, content_type: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


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


class Server(ThreadingHTTPServer):
    """A thread per connection; a client gone mid-answer (a cancelled stream) is no error."""

    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


def serve(args: argparse.Namespace) -> None:
    standin = Standin(args)
    handler = type("BoundHandler", (Handler,), {"standin": standin})
    family = socket.getaddrinfo(args.host, args.port, type=socket.SOCK_STREAM)[0][0]
    server_class = type("BoundServer", (Server,), {"address_family": family})
    server = server_class((args.host, args.port), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    print(f"standin listening on {args.host}:{args.port} model {standin.model}", flush=True)
    if args.spawn_child:
        code = "import time\nwhile True: time.sleep(1)"
        child = subprocess.Popen([sys.executable, "-c", code])
        print(f"standin child {child.pid}", flush=True)
    if args.crash_after > 0:
        time.sleep(args.crash_after)
        print("standin crashing", flush=True)
        os._exit(3)
    threading.Event().wait()


def main() -> None:
    serve(parse(sys.argv[1:]))


if __name__ == "__main__":
    main()
