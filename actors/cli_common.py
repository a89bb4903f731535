"""What both command-line tools share: error handling, signals, the operator's paths."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import nats.errors

from schemas.errors import FleetError


def config_home() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base)


def fail(message: str, code: int = 1) -> int:
    sys.stderr.write(f"error: {message}\n")
    return code


def run_main(entry: Callable[[], Coroutine[Any, Any, int]]) -> int:
    """Run an async command; known errors become one line on stderr and exit 1."""
    try:
        return asyncio.run(entry())
    except FleetError as exc:
        return fail(str(exc))
    except nats.errors.Error as exc:
        return fail(f"NATS: {exc}")
    except KeyboardInterrupt:
        return 130


def stop_event() -> asyncio.Event:
    """An event set by SIGINT or SIGTERM (the second one exits at once)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        if stop.is_set():
            os._exit(130)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    return stop
