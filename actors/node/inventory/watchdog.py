"""The watchdog between the inventory and NVML: a GPU read that hangs never freezes it.

Each read runs in a daemon thread of its own (a hung NVML call then neither occupies the
event loop's executor nor keeps the process from exiting). The inventory waits at most
``deadline`` seconds for it; a read still running then leaves the GPUs' last readings in
the sample, and ``hung`` names the call ("nvmlDeviceGetTemperature hung for 12 s (GPU 3)"),
which the sample carries as its ``gpu_error`` (the nvml check turns unhealthy) and
``/healthz`` reports. No second read starts while one hangs; once it returns, its
readings are the next sample's and the problem clears.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import threading
from typing import Any, Protocol

from schemas.events import Gpu

log = logging.getLogger(__name__)


class Watched(Protocol):
    def read(self) -> list[Gpu]: ...

    def hung(self, deadline: float) -> str:
        """Which call has run ``deadline`` seconds or more, and for how long; "" if none."""
        ...


def _settle(future: asyncio.Future[list[Gpu]], result: list[Gpu] | None, error: Any) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result or [])


class GpuWatchdog:
    """Reads ``source`` off the event loop, waiting at most ``deadline`` for an answer."""

    def __init__(self, source: Watched, deadline: float) -> None:
        self.source = source
        self.deadline = deadline
        self.last: list[Gpu] = []
        """The last readings a read returned."""
        self.hung = ""
        """What hangs now ("" while reads return in time)."""
        self._reading: asyncio.Future[list[Gpu]] | None = None

    def _start(self) -> asyncio.Future[list[Gpu]]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[list[Gpu]] = loop.create_future()
        context = contextvars.copy_context()

        def work() -> None:
            result: list[Gpu] | None = None
            error: BaseException | None = None
            try:
                result = context.run(self.source.read)
            except Exception as exc:  # handed to the waiting coroutine
                error = exc
            try:
                loop.call_soon_threadsafe(_settle, future, result, error)
            except RuntimeError:
                # The loop closed while the call hung: nobody waits for this answer.
                log.debug("a GPU read returned after the inventory stopped")

        threading.Thread(target=work, name="gpu-read", daemon=True).start()
        return future

    async def read(self) -> list[Gpu]:
        """The GPUs' readings now, or the last ones while a read hangs (``hung`` set)."""
        if self._reading is None:
            self._reading = self._start()
        done, _ = await asyncio.wait({self._reading}, timeout=self.deadline)
        if not done:
            self.hung = self.source.hung(self.deadline) or (
                f"the GPU read has taken over {self.deadline:g} s"
            )
            log.error("NVML call hangs", extra={"reason": self.hung})
            return self.last
        reading, self._reading = self._reading, None
        if self.hung:
            log.warning("NVML answers again", extra={"reason": self.hung})
        self.hung = ""
        self.last = reading.result()
        return self.last
