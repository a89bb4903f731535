"""Shared fixtures: a real nats-server per test module, a fresh subject prefix per test, and
a ``fleet`` whose factories start agents, aggregators and servers that the fixture stops."""

from __future__ import annotations

import functools
import inspect
import itertools
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack
from pathlib import Path
from types import ModuleType

import pytest

from actors.fleet.storage.streams import provision
from actors.runtime.bus import NatsBus
from actors.runtime.embedded import NatsServer
from schemas.subjects import Subjects
from tests.support.fleet import TEST_LIMITS, Fleet

_prefixes = itertools.count(1)

SERVER_FIXTURES = frozenset({"nats_server", "auth", "tls_auth", "attacker"})
"""Fixtures that start a nats-server (tests/security's under the shipped accounts)."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test by what it starts, from its fixtures (through other fixtures too)
    and its module, never by hand: ``server`` if it uses a fixture that starts a
    nats-server or its module starts one itself (it holds ``NatsServer``); ``browser`` if
    it drives a browser; ``programs`` if its module runs programs as processes (its code
    names ``subprocess``: the CLIs, ruff, mypy, Slurm's tools...). The tests with none of
    the three are the quick loop's (``python -m tests.quick``)."""
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        module = getattr(item, "module", None)
        if fixtures & SERVER_FIXTURES or hasattr(module, "NatsServer"):
            item.add_marker("server")
        if "browser" in fixtures:
            item.add_marker("browser")
        if module is not None and runs_programs(module):
            item.add_marker("programs")


@functools.cache
def runs_programs(module: ModuleType) -> bool:
    """Whether a test module starts processes (``subprocess``, or asyncio's
    ``create_subprocess_exec``)."""
    return "subprocess" in inspect.getsource(module)


@pytest.fixture(autouse=True)
def private_config_home(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> Path:
    """Every test's own XDG_CONFIG_HOME (fleetctl's contexts and default operator key live
    there, and ``fleetctl up`` writes a context), inherited by the programs it runs: no
    test reads or writes the real ~/.config."""
    home = tmp_path_factory.mktemp("config-home")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home))
    return home


@pytest.fixture(scope="module")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    """A JetStream-enabled nats-server on a free loopback port, stopped after the module."""
    server = NatsServer(tmp_path_factory.mktemp("nats"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def prefix() -> str:
    """A subject prefix of this test's own, so tests sharing a server never meet."""
    return f"t{next(_prefixes)}"


@pytest.fixture
async def bus(nats_server: NatsServer, prefix: str) -> AsyncIterator[NatsBus]:
    """A connected bus with this test's streams and buckets provisioned."""
    connected = await NatsBus.connect(nats_server.url, "test")
    await provision(connected.js, Subjects(prefix), limits=TEST_LIMITS)
    yield connected
    await connected.close()


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    return tmp_path / "state"


@pytest.fixture
async def fleet(
    nats_server: NatsServer, bus: NatsBus, prefix: str, state_dir: Path
) -> AsyncIterator[Fleet]:
    """Factories for what a test runs; everything they started is stopped, newest first,
    before the bus closes (this fixture needs the bus, so it ends first)."""
    async with AsyncExitStack() as stack:
        yield Fleet(nats_server.url, bus, prefix, state_dir, stack)
