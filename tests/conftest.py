"""Shared fixtures: a real nats-server per test module, a fresh subject prefix per test, and
a ``fleet`` whose factories start agents, aggregators and servers that the fixture stops.

The suite runs in parallel processes (pytest-xdist, ``-n`` in pyproject's addopts): each
worker has its own servers (module-scoped, on ports they pick), its own temp dirs, its
own ``XDG_CONFIG_HOME`` and ``XDG_STATE_HOME`` (:func:`private_homes`; each test its own
``XDG_CONFIG_HOME``, :func:`private_config_home`), and ports a test
must name in advance from its own slice (tests/support/ports.py).
"""

from __future__ import annotations

import compileall
import functools
import inspect
import itertools
import os
import shutil
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack
from pathlib import Path
from types import ModuleType

import pytest

from actors.fleet.storage.streams import provision
from actors.runtime.bus import NatsBus
from actors.runtime.embedded import NatsServer
from schemas.subjects import Subjects
from tests.support import assert_cache
from tests.support.fleet import TEST_LIMITS, Fleet

_prefixes = itertools.count(1)

SERVER_FIXTURES = frozenset({"nats_server", "auth", "tls_auth", "attacker"})
"""Fixtures that start a nats-server (tests/security's under the shipped accounts)."""


ROOT = Path(__file__).resolve().parents[1]

MEMORY_TMP = Path("/dev/shm")
"""Where the suite keeps its temporary files when it is a tmpfs (:func:`temp_in_memory`)."""
MEMORY_TMP_FREE = 4 * 2**30
"""The free space it must have for that: a run writes a few hundred MiB."""


def temp_in_memory() -> None:
    """Put the run's temporary files (pytest's ``tmp_path``s, hence every nats-server's
    JetStream store, the artifact builds, the agents' state) in memory, unless ``TMPDIR``
    is set: the suite's hundreds of servers write gigabytes, and on a disk the kernel's
    block-layer work for them cost about a quarter of the CPU of the tests that use them
    (tests/fleet/test_command_queues.py and test_silence.py: 5.2 CPU-s with the files in
    /dev/shm against 7.0 and 9.9 on the disk). Set ``TMPDIR`` to keep them on a disk.
    The workers inherit the variable: the controller sets it before it starts them."""
    if "TMPDIR" in os.environ or not MEMORY_TMP.is_dir() or not os.access(MEMORY_TMP, os.W_OK):
        return
    mounts = Path("/proc/mounts")
    lines = mounts.read_text().splitlines() if mounts.exists() else []
    if [str(MEMORY_TMP), "tmpfs"] not in (line.split()[1:3] for line in lines):
        return
    if shutil.disk_usage(MEMORY_TMP).free < MEMORY_TMP_FREE:
        return
    os.environ["TMPDIR"] = str(MEMORY_TMP)
    tempfile.tempdir = None  # gettempdir() looks again


def pytest_configure(config: pytest.Config) -> None:
    """Temporary files in memory where it can (:func:`temp_in_memory`). Keep compiled
    code between runs even where PYTHONDONTWRITEBYTECODE is set (CI images often set it,
    and this machine does). Each pytest process lets pytest cache
    the test modules it rewrites for assertions: without the cache every worker rewrites
    all of them at every run, ~13 s of CPU a worker before its first test. The controller
    compiles the project once, before the workers start: the suite runs fleetctl,
    node-agent and agents as programs hundreds of times, and each would compile every
    module it imports again (~0.1-0.3 s of CPU a start). Where workers will run, it also
    rewrites the test modules into pytest's cache once (tests/support/assert_cache.py),
    so that the workers do not each rewrite them on a fresh clone. Both use every core
    and skip up-to-date files."""
    sys.dont_write_bytecode = False
    if not hasattr(config, "workerinput"):
        temp_in_memory()
        for package in ("actors", "schemas", "tests/support"):
            compileall.compile_dir(ROOT / package, quiet=1, workers=0)
        if getattr(config.option, "numprocesses", None):
            assert_cache.write_rewritten(config)


@pytest.fixture(scope="session", autouse=True)
def private_homes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """XDG_CONFIG_HOME and XDG_STATE_HOME of this test process's own, for it and every
    program it starts: fleetctl's contexts, ``fleetctl up``'s default store and the
    agent's default state dir are never the developer's, nor another worker's."""
    home = tmp_path_factory.mktemp("home")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CONFIG_HOME", str(home / "config"))
        patch.setenv("XDG_STATE_HOME", str(home / "state"))
        yield home


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test by what it starts, from its fixtures (through other fixtures too)
    and its module, never by hand: ``server`` if it uses a fixture that starts a
    nats-server or its module starts one itself (it holds ``NatsServer``); ``browser`` if
    it drives a browser; ``programs`` if its module runs programs as processes (its code
    names ``subprocess``: the CLIs, ruff, mypy, Slurm's tools...). The tests with none of
    the three are the quick loop's (``python -m tests.quick``). Then the files are put in
    the order pytest-xdist hands them to workers (:func:`in_file_order`)."""
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        module = getattr(item, "module", None)
        if fixtures & SERVER_FIXTURES or hasattr(module, "NatsServer"):
            item.add_marker("server")
        if "browser" in fixtures:
            item.add_marker("browser")
        if module is not None and runs_programs(module):
            item.add_marker("programs")
    items[:] = in_file_order(items)


def in_file_order(items: list[pytest.Item]) -> list[pytest.Item]:
    """The tests in the order pytest-xdist hands their files to workers: the fault
    harness's round (minutes) first, then the files with a ``slow`` test each followed by
    one of the others, so that no long file starts last and runs alone, and the long
    files, which compute, run beside short ones, which mostly wait (docs/testing.md).
    Each file's tests stay together, in their own order."""
    files: dict[Path, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(item.path, []).append(item)
    faults = [path for path, tests in files.items() if any(is_marked(t, "faults") for t in tests)]
    slow = [path for path, tests in files.items() if any(is_marked(t, "slow") for t in tests)]
    rest = [path for path in files if path not in faults and path not in slow]
    slow = [path for path in slow if path not in faults]
    paired = itertools.chain.from_iterable(itertools.zip_longest(slow, rest))
    order = [*faults, *(path for path in paired if path is not None)]
    return [item for path in order for item in files[path]]


def is_marked(item: pytest.Item, marker: str) -> bool:
    return item.get_closest_marker(marker) is not None


@functools.cache
def runs_programs(module: ModuleType) -> bool:
    """Whether a test module starts processes (``subprocess``, or asyncio's
    ``create_subprocess_exec``)."""
    return "subprocess" in inspect.getsource(module)


@pytest.fixture(autouse=True)
def private_config_home(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> Path:
    """Every test's own XDG_CONFIG_HOME, over :func:`private_homes`' process-wide one:
    ``fleetctl up`` writes its context there and makes it current where none is, which
    must not reach the next test of the process (its fleetctl would follow it)."""
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
