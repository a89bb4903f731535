"""The fleet's alerts reach a real Alertmanager through its API, resolve when the node
beats again, and stay in FLEET_ALERTS but out of Alertmanager for a node in maintenance."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any, cast

import aiohttp
import msgspec
import pytest
from aiohttp import web

from actors.fleet.alerts.alertmanager import (
    AlertmanagerActor,
    AmAlert,
    Outbox,
    alertname,
    basic_auth,
    conditions,
    rfc3339,
)
from actors.fleet.config import AggregatorConfig
from actors.fleet.metrics import AggregatorMetrics
from actors.fleet.operator.maintenance import MaintenanceActor
from actors.fleet.storage.registry import approve
from actors.fleet.storage.windows import InForce, MaintenanceWindows
from actors.runtime.config import ConfigError
from schemas import codec, signing
from schemas.messages import Alert, AlertKind, Maintenance, MaintenanceWindow, NodeRecord
from schemas.subjects import STREAM_ALERTS, Subjects
from tests.support.fleet import Fleet, new_aggregator, wait_for, wait_record
from tests.support.observability import agent_process, alertmanager, alertmanager_alerts


def record(**changes: Any) -> NodeRecord:
    base = NodeRecord(node_id="n1", cluster="c1", state="active", last_seq=1, last_seen=1.0)
    return msgspec.structs.replace(base, **changes)


def test_conditions_follow_the_record() -> None:
    """Stale, offline, unhealthy and degraded are conditions; an active healthy node, a
    pending one and a deregistered one have none."""
    assert [c.kind for c in conditions(record(state="stale"))] == ["stale"]
    assert [c.severity for c in conditions(record(state="offline"))] == ["critical"]
    assert [c.kind for c in conditions(record(health_status="unhealthy"))] == ["unhealthy"]
    assert [c.kind for c in conditions(record(health_status="degraded"))] == ["degraded"]
    for quiet in (record(), record(state="pending"), record(state="deregistered")):
        assert conditions(quiet) == []
    assert alertname("sequence_gap") == "FleetNodeSequenceGap"


def test_a_window_covers_by_selector_cluster_name_and_time() -> None:
    """A window covers the nodes its selector matches (in its cluster), the nodes it
    names, and only between since and until."""
    window = MaintenanceWindow(
        id="w",
        since=100.0,
        until=200.0,
        by="U",
        selector={"rack": "r12"},
        cluster="c1",
        nodes=["n9"],
    )
    assert InForce([window], 150.0).covering("n1", "c1", {"rack": "r12", "zone": "a"})
    assert not InForce([window], 150.0).covering("n1", "c2", {"rack": "r12"})
    assert not InForce([window], 150.0).covering("n1", "c1", {"rack": "r13"})
    assert InForce([window], 150.0).covering("n9", "c2", {})
    assert not InForce([window], 200.0).covering("n1", "c1", {"rack": "r12"})
    assert not InForce([window], 99.0).covering("n1", "c1", {"rack": "r12"})


class Changes:
    """Held nodes as the aggregator's view tells them: each write, each record."""

    def __init__(self, *records: NodeRecord) -> None:
        self.records = {record.node_id: record for record in records}
        self.moves = (0, 0)
        self.looked = 0
        self.walks = 0
        self.listeners: list[Callable[[str], None]] = []

    def held(self) -> list[NodeRecord]:
        self.walks += 1
        return list(self.records.values())

    def record(self, node: str) -> NodeRecord | None:
        self.looked += 1
        return self.records.get(node)

    def listen(self, written: Callable[[str], None]) -> None:
        self.listeners.append(written)

    def __len__(self) -> int:
        return len(self.records)

    def write(self, record: NodeRecord) -> None:
        self.records[record.node_id] = record
        for listener in self.listeners:
            listener(record.node_id)


def labels(alert: AmAlert) -> dict[str, str]:
    return cast(dict[str, str], alert["labels"])


class Kept(AlertmanagerActor):
    """The forwarder with what it sends kept, not posted."""

    sent: list[AmAlert]

    def send(self, alerts: list[AmAlert]) -> None:
        self.sent += alerts


async def test_a_check_looks_only_at_the_nodes_written_since_the_last(fleet: Fleet) -> None:
    """With the aggregator's writes, a check after the first walks no held node and looks
    at none when nothing was written; a node written stale fires once and resolves when
    written active; a resend sends every firing condition; nodes loaded without a write
    (a partition taken) are walked again."""
    config = AggregatorConfig(prefix=fleet.prefix, alertmanager_resend=60.0)
    windows = MaintenanceWindows(fleet.bus, Subjects(fleet.prefix))
    changes = Changes(*(record(node_id=f"n{i}") for i in range(100)))
    actor = Kept(config, fleet.bus, AggregatorMetrics(), changes.held, windows, changes=changes)
    actor.sent = []
    actor.check_conditions(1000.0)
    assert (changes.walks, actor.sent) == (1, [])
    for now in (1001.0, 1002.0, 1003.0):
        actor.check_conditions(now)
    assert (changes.walks, changes.looked, actor.sent) == (1, 0, [])
    changes.write(record(node_id="n7", state="stale", stale_since=1003.5))
    actor.check_conditions(1004.0)
    actor.check_conditions(1005.0)
    assert [(labels(a)["node"], labels(a)["alertname"]) for a in actor.sent] == [
        ("n7", "FleetNodeStale")
    ]
    assert (changes.walks, changes.looked) == (1, 1)
    actor.sent.clear()
    actor.check_conditions(1061.0)  # the resend is due
    assert [labels(a)["node"] for a in actor.sent] == ["n7"]
    actor.sent.clear()
    changes.write(record(node_id="n7"))
    actor.check_conditions(1062.0)
    assert [labels(a)["node"] for a in actor.sent] == ["n7"]
    assert actor.sent[0]["endsAt"] == rfc3339(1062.0)
    assert actor.firing == {}
    changes.moves = (0, 1)
    actor.check_conditions(1063.0)
    assert changes.walks == 2


async def test_outbox_retries_a_failing_alertmanager_and_bounds_its_queue(fleet: Fleet) -> None:
    """A 503 is retried until accepted; a 400 is dropped and counted; a full queue drops
    its oldest alert and counts it."""
    answers = [503, 200, 400]
    received: list[list[dict[str, Any]]] = []

    async def alerts(request: web.Request) -> web.Response:
        received.append(await request.json())
        return web.Response(status=answers.pop(0) if answers else 200)

    url = await fleet.serve({"/api/v2/alerts": alerts})
    metrics = AggregatorMetrics()
    config = AggregatorConfig(alertmanager_queue=2)
    async with aiohttp.ClientSession() as session:
        outbox = Outbox(url, session, config, metrics)
        outbox.put([{"labels": {"n": str(i)}} for i in range(3)])
        assert [a["labels"] for a in outbox.queue] == [{"n": "1"}, {"n": "2"}]
        sender = asyncio.create_task(outbox.run())
        try:
            await wait_for(lambda: len(received) == 2 and not outbox.queue)
            outbox.put([{"labels": {"n": "3"}}])
            await wait_for(lambda: len(received) == 3)
        finally:
            sender.cancel()
    assert received[0] == received[1] == [{"labels": {"n": "1"}}, {"labels": {"n": "2"}}]
    value = metrics.registry.get_sample_value
    assert value("fleet_alertmanager_dropped_total", {"reason": "queue_full"}) == 1
    assert value("fleet_alertmanager_dropped_total", {"reason": "rejected"}) == 1
    assert value("fleet_alertmanager_errors_total", {"url": outbox.url}) == 1
    assert value("fleet_alertmanager_sent_total", {"url": outbox.url}) == 2


async def test_events_are_forwarded_once_with_their_hold(fleet: Fleet) -> None:
    """An event alert of FLEET_ALERTS reaches Alertmanager's API with the node's labels,
    severity and endsAt event_hold after it was raised; a stale alert is left to the
    conditions (not sent as an event)."""
    received: list[dict[str, Any]] = []

    async def alerts(request: web.Request) -> web.Response:
        received.extend(await request.json())
        return web.Response(status=200)

    url = await fleet.serve({"/api/v2/alerts": alerts})
    config = msgspec.structs.replace(
        new_aggregator(fleet.bus, fleet.prefix).config,
        alertmanager_urls=[url],
        alertmanager_event_hold=600.0,
        alertmanager_durable=f"am_{fleet.prefix}",
    )
    metrics = AggregatorMetrics()
    windows = MaintenanceWindows(fleet.bus, Subjects(fleet.prefix))
    await fleet.start_supervisor(AlertmanagerActor(config, fleet.bus, metrics, list, windows))
    subjects = Subjects(fleet.prefix)
    now = time.time()
    # n8's is a mark: the forwarder takes FLEET_ALERTS in stream order, so once it has
    # posted n7's sequence_gap and n8's, it has done with n7's stale one (posts of two
    # batches may reach the server in either order).
    sent_alerts: list[tuple[AlertKind, str]] = [
        ("stale", "n7"),
        ("sequence_gap", "n7"),
        ("sequence_gap", "n8"),
    ]
    for kind, node in sent_alerts:
        alert = Alert(
            id=f"a-{kind}-{node}",
            kind=kind,
            node_id=node,
            cluster="c1",
            severity="warning",
            message="seq 5 after 2",
            ts=now,
        )
        await fleet.bus.js.publish(
            subjects.alert(kind, "c1", node),
            codec.encode(alert),
            stream=subjects.stream_name(STREAM_ALERTS),
        )
    await wait_for(lambda: {"n7", "n8"} <= {a["labels"]["node"] for a in received})
    assert sorted(a["labels"]["node"] for a in received) == ["n7", "n8"]
    (sent,) = [a for a in received if a["labels"]["node"] == "n7"]
    assert sent["labels"] == {
        "alertname": "FleetNodeSequenceGap",
        "node": "n7",
        "cluster": "c1",
        "kind": "sequence_gap",
        "severity": "warning",
    }
    starts = sent["startsAt"]
    ends = sent["endsAt"]
    assert isinstance(starts, str) and isinstance(ends, str)
    held = datetime.fromisoformat(ends).timestamp() - datetime.fromisoformat(starts).timestamp()
    assert abs(held - 600.0) < 0.01


async def maintenance_request(fleet: Fleet, operator: signing.KeyPair, request: Maintenance) -> str:
    """Send ``request`` signed by ``operator`` as fleetctl does; the reply's status."""
    body = codec.encode(request)
    reply = await fleet.bus.request(
        Subjects(fleet.prefix).maintenance(), body, 5.0, operator.headers(body)
    )
    answer: str = msgspec.json.decode(reply.data)["status"]
    return answer


async def test_a_real_alertmanager_gets_stale_resolves_it_and_never_hears_of_maintenance(
    fleet: Fleet, tmp_path: Path
) -> None:
    """Against a real Alertmanager: a SIGKILLed agent's node fires FleetNodeStale with its
    labels, and resolves when the agent beats again; a node in a maintenance window goes
    stale too (alert recorded in FLEET_ALERTS) but Alertmanager never holds its alert."""
    operator = signing.KeyPair.generate()
    async with alertmanager(tmp_path / "am") as am_url:
        aggregator = new_aggregator(
            fleet.bus,
            fleet.prefix,
            alertmanager_urls=[am_url],
            alertmanager_resend=1.0,
            alertmanager_durable=f"am_{fleet.prefix}",
            trust_operators=[operator.public_key],
            bus_outage_max=1.0,  # its two nodes, killed together, are the whole stream
        )
        config = aggregator.config
        metrics = AggregatorMetrics()
        windows = MaintenanceWindows(fleet.bus, Subjects(fleet.prefix))

        def held() -> list[NodeRecord]:
            return [record for _, record in aggregator.view.items()]

        await fleet.start_supervisor(
            aggregator,
            MaintenanceActor(config, fleet.bus),
            AlertmanagerActor(config, fleet.bus, metrics, held, windows, changes=aggregator.view),
        )
        watched = fleet.config("n1", labels={"rack": "r11"})
        quiet = fleet.config("n2", labels={"rack": "r12"})
        for node in (watched, quiet):
            key = signing.load_or_create_key_file(node.key_path)
            await approve(fleet.bus, Subjects(fleet.prefix), node.node_id, key.public_key)
        assert (
            await maintenance_request(
                fleet,
                operator,
                Maintenance(
                    action="start",
                    id="r12-swap",
                    ts=time.time(),
                    selector={"rack": "r12"},
                    until=time.time() + 3600,
                    reason="PSU swap",
                ),
            )
            == "started"
        )
        await windows.refresh()
        with (
            agent_process(watched, tmp_path / "n1.log") as first,
            agent_process(quiet, tmp_path / "n2.log") as second,
        ):
            for name in ("n1", "n2"):
                await wait_record(fleet.bus, fleet.prefix, name, lambda r: r.state == "active", 30)
            first.send_signal(signal.SIGKILL)
            second.send_signal(signal.SIGKILL)

            async def stale_in_alertmanager() -> dict[str, Any] | None:
                for alert in await alertmanager_alerts(am_url):
                    if alert["labels"].get("alertname") == "FleetNodeStale":
                        return alert
                return None

            fired = await wait_for(stale_in_alertmanager, interval=0.5)
            assert fired["labels"]["node"] == "n1"
            assert fired["labels"]["label_rack"] == "r11"
            assert fired["labels"]["severity"] == "warning"
            await wait_record(fleet.bus, fleet.prefix, "n2", lambda r: r.state == "stale", 15)
        # n2's stale alert is in FLEET_ALERTS, and was suppressed, not forwarded.
        stream = Subjects(fleet.prefix).stream_name(STREAM_ALERTS)
        recorded = await fleet.bus.js.get_last_msg(
            stream, Subjects(fleet.prefix).alert("stale", "c1", "n2")
        )
        assert recorded.data is not None
        await wait_for(
            lambda: metrics.registry.get_sample_value(
                "fleet_alertmanager_suppressed_total", {"reason": "maintenance"}
            ),
        )
        nodes = {alert["labels"]["node"] for alert in await alertmanager_alerts(am_url)}
        assert nodes == {"n1"}

        with agent_process(watched, tmp_path / "n1-again.log"):
            await wait_record(fleet.bus, fleet.prefix, "n1", lambda r: r.state == "active", 30)

            async def resolved() -> bool:
                return not any(
                    alert["labels"].get("node") == "n1"
                    for alert in await alertmanager_alerts(am_url)
                )

            await wait_for(resolved, interval=0.5)


async def test_maintenance_requests_are_verified(fleet: Fleet) -> None:
    """The maintenance service refuses an untrusted key, a stale request, a window with no
    nodes, one over 30 days and a replayed start; it ends a window once."""
    operator = signing.KeyPair.generate()
    stranger = signing.KeyPair.generate()
    config = msgspec.structs.replace(
        new_aggregator(fleet.bus, fleet.prefix).config, trust_operators=[operator.public_key]
    )
    await fleet.start_supervisor(MaintenanceActor(config, fleet.bus))
    now = time.time()
    start = Maintenance(action="start", id="w1", ts=now, selector={"rack": "r1"}, until=now + 60)
    assert await maintenance_request(fleet, stranger, start) == "rejected"
    old = msgspec.structs.replace(start, ts=now - 3600)
    assert await maintenance_request(fleet, operator, old) == "rejected"
    empty = msgspec.structs.replace(start, selector={})
    assert await maintenance_request(fleet, operator, empty) == "rejected"
    long = msgspec.structs.replace(start, until=now + 31 * 86400)
    assert await maintenance_request(fleet, operator, long) == "rejected"
    assert await maintenance_request(fleet, operator, start) == "started"
    assert await maintenance_request(fleet, operator, start) == "rejected"
    end = Maintenance(action="end", id="w1", ts=time.time())
    assert await maintenance_request(fleet, operator, end) == "ended"
    assert await maintenance_request(fleet, operator, end) == "rejected"
    assert await maintenance_request(fleet, operator, start) == "rejected"


def test_basic_auth_header_and_a_bad_password_file(tmp_path: Path) -> None:
    """The Authorization header carries the user and the password file's first line; an
    unreadable file is one ConfigError naming the setting."""
    secret = tmp_path / "am-password"
    secret.write_text("s3cret\nignored\n")
    config = AggregatorConfig(alertmanager_username="fleet", alertmanager_password_file=str(secret))
    assert basic_auth(config) == {"Authorization": "Basic ZmxlZXQ6czNjcmV0"}
    assert basic_auth(AggregatorConfig()) == {}
    missing = msgspec.structs.replace(config, alertmanager_password_file=str(tmp_path / "none"))
    with pytest.raises(ConfigError, match="alertmanager_password_file"):
        basic_auth(missing)


def test_the_windows_in_force_are_found_once_until_one_begins_or_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The windows in force are found once for a pass over the fleet, the ended and the
    future ones left out (the bucket keeps a window 31 days after it ends), and found
    again only once one begins or ends, or the windows are read again."""
    from actors.fleet.storage import windows as windows_module

    def window(name: str, since: float, until: float) -> MaintenanceWindow:
        return MaintenanceWindow(id=name, since=since, until=until, by="U", nodes=[name])

    kept = [window(f"ended-{i}", 0.0, 1.0 + i / 1_000) for i in range(1_000)]
    kept += [window("w1", 100.0, 200.0), window("w2", 150.0, 300.0), window("f", 400.0, 500.0)]
    in_force = InForce(kept, 160.0)
    assert [w.id for w, _ in in_force.windows] == ["w1", "w2"]
    assert (in_force.start, in_force.end) == (150.0, 200.0)
    found: list[float] = []

    class Counted(InForce):
        def __init__(self, windows: list[MaintenanceWindow], now: float) -> None:
            found.append(now)
            super().__init__(windows, now)

    monkeypatch.setattr(windows_module, "InForce", Counted)
    windows = MaintenanceWindows(cast(Any, None), Subjects("t"))
    windows.windows = kept
    found.clear()
    records = [record(node_id=f"n{i}") for i in range(1_000)]
    records += [record(node_id="w1"), record(node_id="w2")]
    covered = [windows.covering(each, 160.0 + i / 100) for i, each in enumerate(records)]
    assert found == [160.0]
    assert [w.id for w in covered if w is not None] == ["w1", "w2"]
    assert windows.covering(record(node_id="w1"), 200.0) is None  # w1 ended: found again
    assert windows.covering(record(node_id="w2"), 250.0) is not None
    assert found == [160.0, 200.0]
    windows.windows = list(kept)  # read again
    windows.covering(record(node_id="w2"), 250.0)
    assert found == [160.0, 200.0, 250.0]
