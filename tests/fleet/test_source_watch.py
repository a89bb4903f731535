"""The watch of FLEET_HB's source (actors/fleet/aggregator/source_watch.py): a source
nats-server left stalled while the intake stores makes FLEET_HB's leader step down, once
per spacing; a healthy, idle or single-replica stream is left alone. The decisions are
driven with the stream infos a server sends; the step-down, the reading of a live source
and the election advisory the sweeps listen for (lost_markers) against a real
three-server cluster."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from nats.aio.msg import Msg
from nats.js.api import StreamInfo

from actors.fleet.aggregator.source_watch import SOURCE_STALL, SourceWatch, source_silent
from actors.fleet.aggregator.sweeps import LEADER_ELECTED
from actors.fleet.storage.streams import provision
from actors.runtime.bus import NatsBus
from actors.runtime.embedded import NatsServer
from schemas.subjects import STREAM_HEARTBEAT_INTAKE, STREAM_HEARTBEATS, Subjects
from tests.support.fleet import wait_for
from tests.support.js_cluster import start_cluster, urls, wait_jetstream

SUBJECTS = Subjects("t")


def info(name: str, last_seq: int, active_ns: int | None = None, peers: int = 2) -> StreamInfo:
    """A stream info as nats-server answers it (the fields the watch reads)."""
    response: dict[str, Any] = {
        "config": {"name": name},
        "state": {
            "messages": 1,
            "bytes": 1,
            "first_seq": 1,
            "last_seq": last_seq,
            "consumer_count": 0,
        },
        "cluster": {
            "name": "c",
            "leader": "n1",
            "replicas": [{"name": f"n{i + 2}", "current": True, "active": 1} for i in range(peers)],
        },
    }
    if active_ns is not None:
        response["sources"] = [{"name": "FLEET_HB_IN", "lag": 0, "active": active_ns}]
    found: StreamInfo = StreamInfo.from_response(response)
    return found


class FakeJS:
    def __init__(self) -> None:
        self.infos: dict[str, StreamInfo] = {}

    async def stream_info(self, name: str) -> StreamInfo:
        return self.infos[name]


class FakeBus:
    js_api_prefix = "$JS.API"

    def __init__(self) -> None:
        self.js = FakeJS()
        self.requests: list[str] = []

    async def request(self, subject: str, data: bytes, timeout: float) -> Msg:
        self.requests.append(subject)
        return Msg(None, subject=subject, data=b'{"success":true}')  # type: ignore[arg-type]


@pytest.fixture
def bus() -> FakeBus:
    return FakeBus()


def watch_of(bus: FakeBus, clock: Callable[[], float] = time.monotonic) -> SourceWatch:
    return SourceWatch(bus, SUBJECTS, lambda: True, clock)  # type: ignore[arg-type]


def streams(bus: FakeBus, intake_seq: int, active_s: float | None, peers: int = 2) -> None:
    active = None if active_s is None else int(active_s * 1e9)
    bus.js.infos = {
        SUBJECTS.stream_name(STREAM_HEARTBEAT_INTAKE): info("FLEET_HB_IN", intake_seq),
        SUBJECTS.stream_name(STREAM_HEARTBEATS): info("FLEET_HB", 9, active, peers),
    }


STEPDOWN = f"$JS.API.STREAM.LEADER.STEPDOWN.{SUBJECTS.stream_name(STREAM_HEARTBEATS)}"


async def test_a_source_stalled_while_the_intake_stores_makes_its_leader_step_down(
    bus: FakeBus,
) -> None:
    watch = watch_of(bus)
    streams(bus, intake_seq=100, active_s=SOURCE_STALL + 1)
    assert not await watch.check()  # the first look only learns where the intake is
    streams(bus, intake_seq=105, active_s=SOURCE_STALL + 6)
    assert await watch.check()
    assert bus.requests == [STEPDOWN]
    streams(bus, intake_seq=110, active_s=SOURCE_STALL + 11)
    assert not await watch.check(), "a second step-down within the spacing"
    assert bus.requests == [STEPDOWN]


@pytest.mark.parametrize(
    ("intake_seqs", "active_s", "peers", "why"),
    [
        ((100, 100), SOURCE_STALL + 5, 2, "the intake stores nothing: no node beats"),
        ((100, 105), SOURCE_STALL - 5, 2, "silent for less than the stall"),
        ((100, 105), 0.4, 2, "the source is live"),
        ((100, 105), SOURCE_STALL + 5, 0, "one replica: nobody to hand over to"),
    ],
)
async def test_a_source_is_left_alone(
    bus: FakeBus, intake_seqs: tuple[int, int], active_s: float, peers: int, why: str
) -> None:
    watch = watch_of(bus)
    for seq in intake_seqs:
        streams(bus, intake_seq=seq, active_s=active_s, peers=peers)
        assert not await watch.check(), why
    assert bus.requests == []


async def test_a_source_never_heard_from_counts_from_when_the_watch_saw_it(
    bus: FakeBus,
) -> None:
    """nats-server reports no age (-1) for a source its leader has not heard from since it
    took over; the watch measures that silence itself."""
    now = [1000.0]
    watch = watch_of(bus, lambda: now[0])
    seq = 100
    for at in (0.0, SOURCE_STALL / 2, SOURCE_STALL - 1):
        now[0] = 1000.0 + at
        seq += 5
        streams(bus, intake_seq=seq, active_s=None)
        assert not await watch.check()
    now[0] = 1000.0 + SOURCE_STALL
    streams(bus, intake_seq=seq + 5, active_s=None)
    assert await watch.check()
    assert bus.requests == [STEPDOWN]


def test_the_age_reported_as_unknown_is_none() -> None:
    assert source_silent(info("FLEET_HB", 1, -1)) is None
    assert source_silent(info("FLEET_HB", 1)) is None
    assert source_silent(info("FLEET_HB", 1, 2_500_000_000)) == 2.5


# Against a real cluster ---------------------------------------------------------------


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[list[NatsServer]]:
    yield from start_cluster(tmp_path / "cluster")


@pytest.fixture
async def cluster_bus(cluster: list[NatsServer]) -> AsyncIterator[NatsBus]:
    bus = await NatsBus.connect(urls(cluster), "test")
    try:
        await wait_jetstream(bus)
        yield bus
    finally:
        await bus.close()


async def test_a_live_source_is_read_as_live_and_a_step_down_moves_the_leader(
    cluster: list[NatsServer], cluster_bus: NatsBus, prefix: str
) -> None:
    bus, subjects = cluster_bus, Subjects(prefix)
    await provision(bus.js, subjects, replicas=3)
    stream = subjects.stream_name(STREAM_HEARTBEATS)
    watch = SourceWatch(bus, subjects, lambda: True)

    async def source_heard() -> StreamInfo | None:
        await bus.publish(subjects.heartbeat("c1", "n1"), b"{}")
        found = await bus.js.stream_info(stream)
        silent = source_silent(found)
        return found if found.state.last_seq and silent is not None and silent < 5 else None

    before = await wait_for(source_heard, interval=0.2)
    assert not await watch.check()
    assert not await watch.check(), "a live source made its leader step down"
    assert before.cluster is not None and before.cluster.leader
    old_leader = before.cluster.leader
    # The advisory the sweeps hear elections by (the lost_markers module) comes on the
    # subject they listen to.
    elected: list[str] = []

    async def on_elected(msg: Msg) -> None:
        elected.append(json.loads(msg.data)["leader"])

    advisory = f"{LEADER_ELECTED}.{stream}"
    await bus.subscribe(advisory, on_elected)

    async def heard_through_every_server() -> bool:
        # The new leader publishes the advisory, and a server that has not yet heard of
        # this subscription (a route's interest comes a moment after the flush; on a
        # busy machine, after the election) drops it: a probe through each server first.
        for server in cluster:
            probe = await NatsBus.connect(server.url, "probe")
            try:
                await probe.publish(advisory, json.dumps({"leader": server.url}).encode())
                await probe.flush()
            finally:
                await probe.close()
        return all(server.url in elected for server in cluster)

    await wait_for(heard_through_every_server, interval=0.2)
    await watch.step_down()

    async def new_leader() -> StreamInfo | None:
        found = await source_heard()
        if found is None or found.cluster is None:
            return None
        return found if found.cluster.leader not in ("", old_leader) else None

    after = await wait_for(new_leader, interval=0.2)
    assert after.state.last_seq > before.state.last_seq, "the new leader's source carries"
    assert after.cluster is not None
    await wait_for(lambda: after.cluster is not None and after.cluster.leader in elected)
