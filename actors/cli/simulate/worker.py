"""One worker process of ``fleetctl simulate --processes P``
(``python -m actors.cli.simulate.worker``).

The parent writes a :class:`WorkerJob` line to its stdin; the worker builds and approves
its share of the nodes (every P-th), answers ``ready``, reads a :class:`WorkerGo` line
(start time, first seqs), publishes, and writes its :class:`SliceResult` as one JSON line.
Errors are one line on stderr and exit 1. A thread waits for stdin to close: the parent
gone (exited, killed) before the result is sent ends the worker at once, so none is left
behind.
"""

from __future__ import annotations

import asyncio
import os
import queue
import sys
import threading

import msgspec

from actors.cli.common import connected_to, run_main
from actors.cli.simulate.processes import READY, SETUP_TIMEOUT, WorkerGo, WorkerJob, own_indices
from actors.cli.simulate.publisher import build_nodes, publish_slice
from schemas.errors import FleetError

ORPHANED = 3
"""Exit status of a worker whose parent went away."""


class Stdin:
    """The parent's lines, read by a thread; the parent closing stdin before the worker is
    done ends the process (``os._exit``: no await of anything can hold it up)."""

    def __init__(self) -> None:
        self.lines: queue.Queue[bytes] = queue.Queue(maxsize=2)
        self.done = threading.Event()
        threading.Thread(target=self._read, name="parent-watch", daemon=True).start()

    def _read(self) -> None:
        for line in sys.stdin.buffer:
            self.lines.put(line)
        if not self.done.is_set():
            os._exit(ORPHANED)

    async def next(self, timeout: float) -> bytes:
        try:
            return await asyncio.to_thread(self.lines.get, True, timeout)
        except queue.Empty:
            raise FleetError(f"no word from the parent within {timeout:g}s") from None


async def work(stdin: Stdin) -> int:
    try:
        job = msgspec.json.decode(await stdin.next(SETUP_TIMEOUT), type=WorkerJob)
    except msgspec.DecodeError as exc:
        raise FleetError(f"a bad job line: {exc}") from None
    options = job.options
    async with connected_to(job.client, f"fleetctl-simulate-{job.worker}") as bus:
        nodes = await build_nodes(bus, options, own_indices(options, job.worker), job.boot)
        sys.stdout.buffer.write(READY)
        sys.stdout.flush()
        # The parent waits for every worker, then for its KV watch: no bound of our own.
        try:
            go = msgspec.json.decode(await stdin.next(10 * SETUP_TIMEOUT), type=WorkerGo)
        except msgspec.DecodeError as exc:
            raise FleetError(f"a bad start line: {exc}") from None
        if len(go.seqs) != len(nodes):
            raise FleetError(f"got {len(go.seqs)} first seqs for {len(nodes)} nodes")
        for node, seq in zip(nodes, go.seqs, strict=True):
            node.seq = seq
        result = await publish_slice(bus, options, nodes, go.start_at)
    stdin.done.set()
    sys.stdout.buffer.write(msgspec.json.encode(result) + b"\n")
    sys.stdout.flush()
    return 0


def main() -> int:
    stdin = Stdin()
    code = run_main(lambda: work(stdin))
    sys.stdout.flush()
    sys.stderr.flush()
    # The stdin thread is blocked in a read: a normal interpreter exit would abort on
    # its buffer's lock (SIGABRT at shutdown), so leave at once, everything written.
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
