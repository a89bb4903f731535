"""A deferred module (actors/cli/lazy.py) is not loaded by importing what imports it, and
is the real module at its first use: nats-py imports aiohttp without loading it, and the
dashboard's ``from aiohttp import web`` still gets aiohttp's."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import sys
from actors.cli import lazy
lazy.defer("aiohttp")
import nats.aio.client
import aiohttp
assert "aiohttp.client" not in sys.modules, "loaded by an import"
from aiohttp import web
assert web.Application.__module__ == "aiohttp.web_app"
assert type(sys.modules["aiohttp"]).__name__ == "module"
import nats.aio.transport
assert nats.aio.transport.aiohttp.WSMsgType.BINARY == 2
lazy.defer("aiohttp")
assert type(sys.modules["aiohttp"]).__name__ == "module", "a loaded module deferred again"
lazy.defer("no_such_module_here")
assert "no_such_module_here" not in sys.modules
print("ok")
"""


def test_a_deferred_module_loads_at_its_first_use_only() -> None:
    """Importing nats (and aiohttp itself) leaves aiohttp unloaded; ``from aiohttp import
    web`` and nats-py's reads then see the real module; a loaded or missing module is not
    deferred."""
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60, check=False
    )
    assert (done.returncode, done.stdout.strip()) == (0, "ok"), done.stderr
