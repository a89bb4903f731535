"""``run_main``, which every fleetctl command runs in: a Ctrl-C exits 130 even when a
library lost the cancel it caused (Python 3.11's ``asyncio.wait_for``, which nats-py
awaits its flushes and requests with, returns a result that came as its task was
cancelled)."""

from __future__ import annotations

import asyncio
import os
import signal

from actors.cli.common import run_main


def test_a_ctrl_c_whose_cancel_was_lost_still_exits_130() -> None:
    # Python's own Ctrl-C handler, as a command starts with (a pytest-xdist worker
    # ignores SIGINT, and asyncio then leaves it alone).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)

    async def entry() -> int:
        os.kill(os.getpid(), signal.SIGINT)  # asyncio's handler cancels this task
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            pass  # lost, as wait_for loses it
        return 0

    try:
        assert run_main(entry) == 130
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_command_that_ends_returns_its_code() -> None:
    async def entry() -> int:
        await asyncio.sleep(0)
        return 3

    assert run_main(entry) == 3
