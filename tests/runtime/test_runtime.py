"""Runtime pieces: supervisor restarts (and how they are logged), config layering and
errors, sequence persistence."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

import nats.errors
import pytest

from actors.node.config import ENV_PREFIX, AgentConfig
from actors.node.heartbeat.sequence import SequenceError, SequenceStore
from actors.runtime.config import ConfigError, build
from actors.runtime.supervisor import Supervisor
from tests.support.fleet import wait_for


class Crasher:
    name = "crasher"

    def __init__(self) -> None:
        self.starts = 0

    async def run(self, ready: Callable[[], None]) -> None:
        self.starts += 1
        ready()
        await asyncio.sleep(0)
        raise RuntimeError("boom")


class Steady:
    name = "steady"

    def __init__(self) -> None:
        self.ticks = 0
        self.cancelled = False

    async def run(self, ready: Callable[[], None]) -> None:
        ready()
        try:
            while True:
                self.ticks += 1
                await asyncio.sleep(0.01)  # its work, a tick every 10 ms
        except asyncio.CancelledError:
            self.cancelled = True
            raise


async def test_supervisor_restarts_crasher_and_keeps_others_running() -> None:
    """A crashing actor is restarted with backoff; its neighbour never stops."""
    crasher, steady = Crasher(), Steady()
    supervisor = Supervisor([crasher, steady], backoff_initial=0.01, backoff_max=0.05)
    supervisor.start()
    await wait_for(lambda: crasher.starts >= 3 and supervisor.status["crasher"].restarts >= 2)
    assert "boom" in supervisor.status["crasher"].last_error
    ticks = steady.ticks  # still ticking after the crashes
    await wait_for(lambda: steady.ticks > ticks)
    assert supervisor.status["steady"].phase == "running"
    await supervisor.stop()
    assert supervisor.status["steady"].phase == "stopped"  # type: ignore[comparison-overlap]


async def test_supervisor_stop_cancels_everything() -> None:
    """Stopping propagates cancellation into every actor."""
    steady = Steady()
    supervisor = Supervisor([steady])
    supervisor.start()
    assert await supervisor.wait_ready(1)
    await supervisor.stop(timeout=1)
    ticks = steady.ticks
    assert steady.cancelled  # its loop ended by cancellation: it ticks no more
    await asyncio.sleep(0)
    assert steady.ticks == ticks


class Gated:
    """An actor ready only once ``gate`` is set, like the aggregator once it provisioned
    the streams; it notes which actors had started when it became ready."""

    name = "first"

    def __init__(self, started: list[str]) -> None:
        self.gate = asyncio.Event()
        self.started = started
        self.seen_at_ready: list[str] = []

    async def run(self, ready: Callable[[], None]) -> None:
        self.started.append(self.name)
        await self.gate.wait()
        self.seen_at_ready = list(self.started)
        ready()
        await asyncio.Event().wait()


class Reader(Steady):
    """An actor that notes when it starts (one that reads what the first one makes)."""

    def __init__(self, started: list[str]) -> None:
        super().__init__()
        self.name = "reader"
        self.started = started

    async def run(self, ready: Callable[[], None]) -> None:
        self.started.append(self.name)
        await super().run(ready)


async def test_supervisor_starts_then_actors_once_the_first_are_ready() -> None:
    """Actors given as ``then`` start only after every first actor said it is ready, not
    before; the first one's restarts do not start them twice."""
    started: list[str] = []
    first, reader = Gated(started), Reader(started)
    supervisor = Supervisor([first], then=[reader])
    supervisor.start()
    await wait_for(lambda: started)  # started together, both would be there by now
    assert started == ["first"] and supervisor.status["reader"].phase == "starting"
    first.gate.set()
    assert await supervisor.wait_ready(5)
    assert first.seen_at_ready == ["first"] and started == ["first", "reader"]
    assert [actor.name for actor in supervisor.actors] == ["first", "reader"]
    await supervisor.stop(timeout=1)


def test_config_layers_flags_over_env_over_file(tmp_path: Path) -> None:
    """Flags beat NODE_AGENT_* which beats the TOML file which beats defaults."""
    file = tmp_path / "agent.toml"
    file.write_text('node_id = "from-file"\ncluster = "file"\nheartbeat_interval = 3\n')
    config = build(
        AgentConfig,
        ENV_PREFIX,
        file=file,
        env={
            "NODE_AGENT_CLUSTER": "env",
            "NODE_AGENT_HEARTBEAT_INTERVAL": "4",
            "NATS_URL": "nats://h:1",
        },
        flags={"heartbeat_interval": "5", "node_id": None},
    )
    assert (config.node_id, config.cluster, config.heartbeat_interval) == ("from-file", "env", 5)
    assert config.server == "nats://h:1"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"node_id": "bad node"}, "config: node_id: expected `str` matching regex"),
        ({"heartbeat_interval": "soon"}, "config: heartbeat_interval: 'soon' is not a duration"),
        ({"stale_after": "5"}, "stale_after (5s) must be longer than heartbeat_interval"),
        ({"http_port": "70000"}, "config: http_port: expected `int` <= 65535"),
        ({"engines": ["tgi=http://x"]}, "config: engines[0]"),
    ],
)
def test_bad_values_are_one_line_naming_the_field(flags: dict[str, object], message: str) -> None:
    """Each invalid value yields one ConfigError line that names the field."""
    with pytest.raises(ConfigError) as caught:
        build(AgentConfig, ENV_PREFIX, env={}, flags=flags)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_bad_file_and_unknown_keys(tmp_path: Path) -> None:
    """A missing file, broken TOML, an unknown key and an unknown env var are named."""
    with pytest.raises(ConfigError, match="not found"):
        build(AgentConfig, ENV_PREFIX, file=tmp_path / "missing.toml", env={})
    broken = tmp_path / "broken.toml"
    broken.write_text("node_id = \n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        build(AgentConfig, ENV_PREFIX, file=broken, env={})
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("hearbeat_interval = 3\n")
    with pytest.raises(ConfigError, match="unknown setting `hearbeat_interval`"):
        build(AgentConfig, ENV_PREFIX, file=unknown, env={})
    with pytest.raises(ConfigError, match=r"NODE_AGENT_NODEID"):
        build(AgentConfig, ENV_PREFIX, env={"NODE_AGENT_NODEID": "x"})


def test_sequence_grows_across_restarts_and_crashes(tmp_path: Path) -> None:
    """A new store never hands out a number an earlier one could have used."""
    first = SequenceStore(tmp_path, block=10)
    used = [first.next() for _ in range(25)]
    second = SequenceStore(tmp_path, block=10)
    assert second.next() > max(used)
    assert used == sorted(set(used))


def test_corrupt_sequence_file_is_a_clear_error(tmp_path: Path) -> None:
    """A sequence file that is not a number stops the agent with a named file."""
    (tmp_path / "heartbeat.seq").write_text("garbage")
    with pytest.raises(SequenceError, match=r"heartbeat\.seq"):
        SequenceStore(tmp_path)


def test_full_disk_keeps_numbers_increasing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When a new block cannot be written, numbers still increase (and it is logged)."""
    store = SequenceStore(tmp_path, block=2)

    def no_space(*_args: object) -> None:
        raise SequenceError(tmp_path, "No space left on device")

    monkeypatch.setattr(store, "_reserve", no_space)
    numbers = [store.next() for _ in range(5)]
    assert numbers == sorted(set(numbers))


class Failer:
    """An actor that fails once with ``error``, then runs."""

    name = "failer"

    def __init__(self, error: BaseException) -> None:
        self.error = error
        self.starts = 0

    async def run(self, ready: Callable[[], None]) -> None:
        self.starts += 1
        ready()
        if self.starts == 1:
            raise self.error
        await asyncio.Event().wait()


@pytest.mark.parametrize(
    ("error", "level", "message", "traceback"),
    [
        (nats.errors.TimeoutError(), logging.WARNING, "actor stopped by a bus fault", False),
        (
            ExceptionGroup("task group", [TimeoutError(), nats.errors.ConnectionClosedError()]),
            logging.WARNING,
            "actor stopped by a bus fault",
            False,
        ),
        (RuntimeError("boom"), logging.ERROR, "actor crashed", True),
        (
            ExceptionGroup("task group", [TimeoutError(), RuntimeError("boom")]),
            logging.ERROR,
            "actor crashed",
            True,
        ),
    ],
)
async def test_a_bus_fault_is_logged_as_one_and_a_defect_as_a_crash(
    caplog: pytest.LogCaptureFixture,
    error: BaseException,
    level: int,
    message: str,
    traceback: bool,
) -> None:
    """An actor stopped by a timeout or a lost connection (alone or all of a task group's
    failures) is restarted with one warning line naming the fault, no traceback; any
    other failure is a crash, logged as an error with its traceback."""
    failer = Failer(error)
    supervisor = Supervisor([failer], backoff_initial=0.01)
    with caplog.at_level(logging.INFO, logger="actors.runtime.supervisor"):
        supervisor.start()
        await wait_for(lambda: failer.starts == 2)  # failed once, restarted, running
        await supervisor.stop()
    assert failer.starts == 2
    [record] = [
        r for r in caplog.records if r.message.startswith(("actor stopped", "actor crashed"))
    ]
    assert record.levelno == level and record.message.startswith(message)
    assert (record.exc_info is not None) == traceback
