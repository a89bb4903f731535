"""A TCP relay to a nats-server that a test can cut and heal: one client's bus lost and
found again while the server and everyone else keep running. The relay is a process of
its own (``python -m tests.support.relay PORT HOST:PORT``): a cut kills it (every
connection through it reset, new ones refused), a heal starts it again on the same port.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from urllib.parse import urlparse

from tests.support.ports import free_port
from tests.support.workloads import REPO

CHUNK = 65536
START_TIMEOUT = 10.0
"""Seconds the relay process may take to listen."""


class Relay:
    """Relays connections made to its own port to ``target`` (a ``nats://host:port``)."""

    def __init__(self, target: str) -> None:
        parsed = urlparse(target)
        assert parsed.hostname is not None and parsed.port is not None, target
        self.target = f"{parsed.hostname}:{parsed.port}"
        self.port = free_port()
        self.url = f"nats://127.0.0.1:{self.port}"
        self._process: asyncio.subprocess.Process | None = None

    async def start(self) -> str:
        """Start relaying (again); the URL clients are to use, once it listens."""
        self._process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tests.support.relay", str(self.port), self.target,
            cwd=REPO, stdout=subprocess.PIPE,
        )  # fmt: skip
        assert self._process.stdout is not None
        async with asyncio.timeout(START_TIMEOUT):
            assert await self._process.stdout.readline() == b"listening\n"
        return self.url

    async def sever(self) -> None:
        """Kill the relay: every connection through it is reset, new ones refused."""
        if self._process is not None and self._process.returncode is None:
            self._process.kill()
            await self._process.wait()

    async def heal(self) -> None:
        await self.start()

    async def close(self) -> None:
        await self.sever()


async def _pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
    try:
        while data := await source.read(CHUNK):
            sink.write(data)
            await sink.drain()
    except ConnectionError:
        pass
    finally:
        sink.close()


async def _relay(port: int, host: str, target_port: int) -> None:
    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(START_TIMEOUT):
                upstream = await asyncio.open_connection(host, target_port)
        except (OSError, TimeoutError):
            writer.close()
            return
        await asyncio.gather(_pipe(reader, upstream[1]), _pipe(upstream[0], writer))

    server = await asyncio.start_server(accept, "127.0.0.1", port, reuse_address=True)
    sys.stdout.write("listening\n")
    sys.stdout.flush()
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    host, _, target_port = sys.argv[2].rpartition(":")
    asyncio.run(_relay(int(sys.argv[1]), host, int(target_port)))
