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
    async def entry() -> int:
        os.kill(os.getpid(), signal.SIGINT)  # asyncio's handler cancels this task
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            pass  # lost, as wait_for loses it
        return 0

    assert run_main(entry) == 130


def test_a_command_that_ends_returns_its_code() -> None:
    async def entry() -> int:
        await asyncio.sleep(0)
        return 3

    assert run_main(entry) == 3
