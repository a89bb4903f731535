"""The parent's side of ``fleetctl simulate --processes P``: the lines it exchanges with each
worker process (``actors.cli.simulate.worker``: a :class:`WorkerJob`, ``ready``, a
:class:`WorkerGo`, its result) and :class:`Worker`, its handle on one process (started,
written to, read with a timeout, stopped; its stderr kept for the error it ends with).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib

import msgspec

from actors.cli.common import ClientConfig
from actors.cli.simulate.publisher import SimOptions
from actors.runtime.bus import PUBLISH_TIMEOUT
from actors.runtime.python_children import child_env, module_command
from schemas.errors import FleetError

SETUP_TIMEOUT = 60.0
SETUP_PER_NODE = 0.01
"""A worker builds and approves its nodes within SETUP_TIMEOUT + SETUP_PER_NODE x nodes."""


class WorkerJob(msgspec.Struct, frozen=True, kw_only=True):
    """The parent's first line to a worker: which nodes are its, and how to connect."""

    worker: int
    options: SimOptions
    client: ClientConfig
    boot: str


class WorkerGo(msgspec.Struct, frozen=True, kw_only=True):
    """The parent's second line: when to start (wall clock) and where each node's seq
    starts (the worker's nodes in order)."""

    start_at: float
    seqs: list[int]


READY = b"ready\n"
"""A worker's first line: its nodes are built and approved."""


def own_indices(options: SimOptions, worker: int) -> range:
    """The nodes of worker ``worker``: every P-th, so a ``--kill`` hits all workers."""
    return range(worker, options.nodes, options.processes)


class WorkerFailed(FleetError):
    """A worker process exited or answered something else than expected."""


class Worker:
    """The parent's handle on one worker process: JSON lines over its stdin and stdout."""

    def __init__(self, index: int, process: asyncio.subprocess.Process) -> None:
        self.index = index
        self.process = process
        self.errors: collections.deque[str] = collections.deque(maxlen=20)
        """The last lines of its stderr, read all along so that it never fills the pipe."""
        self.reader = asyncio.create_task(self._read_errors())

    async def _read_errors(self) -> None:
        assert self.process.stderr is not None
        async for line in self.process.stderr:
            if line.strip():
                self.errors.append(line.decode(errors="replace").strip())

    @classmethod
    async def start(cls, index: int) -> Worker:
        process = await asyncio.create_subprocess_exec(
            *module_command("actors.cli.simulate.worker"),
            env=child_env(),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            limit=2**26,  # a result names every node of the worker
        )
        return cls(index, process)

    async def send(self, message: msgspec.Struct) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(msgspec.json.encode(message) + b"\n")
        try:
            async with asyncio.timeout(PUBLISH_TIMEOUT):
                await self.process.stdin.drain()
        except (OSError, TimeoutError):
            raise await self.failed() from None

    async def receive(self, timeout: float) -> bytes:
        """The worker's next line; WorkerFailed if it ends, or after ``timeout``."""
        assert self.process.stdout is not None
        try:
            async with asyncio.timeout(timeout):
                line = await self.process.stdout.readline()
        except TimeoutError:
            raise WorkerFailed(
                f"simulate worker {self.index} did not answer within {timeout:.0f}s"
            ) from None
        if not line.endswith(b"\n"):
            raise await self.failed()
        return line

    async def failed(self) -> WorkerFailed:
        """The worker's own last error line, once it has exited."""
        await self.stop()
        last = self.errors[-1].removeprefix("error: ") if self.errors else "no message"
        return WorkerFailed(
            f"simulate worker {self.index} failed (exit {self.process.returncode}): {last}"
        )

    async def stop(self) -> None:
        """Let the worker end by itself (it exits once its result is out, and at once when
        its stdin closes), and kill it only if it has not within PUBLISH_TIMEOUT: killing
        one that has just exited races asyncio's child watcher (``Popen.kill`` reaps it
        first; the watcher then logs "Unknown child process pid" and reports exit 255)."""
        if self.process.stdin is not None:
            self.process.stdin.close()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(PUBLISH_TIMEOUT):
                await self.process.wait()
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()
            await self.process.wait()
        # Its stderr ends with it: the reader has read the last line.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(PUBLISH_TIMEOUT):
                await asyncio.shield(self.reader)
        self.reader.cancel()
        await asyncio.gather(self.reader, return_exceptions=True)
