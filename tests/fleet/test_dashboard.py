"""The fleet dashboard in a real headless Chromium (Debian's ``chromium`` driven by
Playwright through its ``executable_path``): rows appear, follow an injected fault and a
SIGKILL without a reload, a node page charts its history, and a cordon sent from the
page reaches the node and its result shows."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
from aiohttp import web
from nats.aio.msg import Msg

from actors.fleet.aggregator.actor import AggregatorActor
from actors.fleet.config import AggregatorConfig
from actors.fleet.live.state_index import index_key
from actors.fleet.metrics import AggregatorMetrics
from actors.fleet.storage.registry import approve
from actors.fleet.storage.streams import provision
from actors.fleet.views.api import FleetApiActor, exposure
from actors.fleet.views.dashboard import render
from actors.fleet.views.dashboard.actor import DashboardActor
from actors.fleet.views.dashboard.held_nodes import HeldNodes
from actors.runtime.http_login import check_password, hash_password
from actors.runtime.supervisor import FatalError
from schemas import codec, signing
from schemas.events import Capacity, Gpu, Health, HealthCheck, Inject, Sample, XidCount
from schemas.fleet_index import PartitionIndex
from schemas.messages import CommandResult, MaintenanceWindow, NodeRecord
from schemas.subjects import BUCKET_INDEX, BUCKET_MAINTENANCE, EVENT_INJECT, Subjects
from schemas.xid_catalog import XID_TABLE
from tests.fleet.test_aggregator import publish
from tests.support.dashboard import basic, client, link, logged_in, start_dashboard
from tests.support.fleet import (
    HANG,
    TEST_LIMITS,
    Fleet,
    heartbeat,
    new_aggregator,
    wait_for,
    wait_record,
)
from tests.support.observability import agent_process
from tests.support.pki import Pki


async def test_rows_follow_the_fleet_live(fleet: Fleet, browser: Any, tmp_path: Path) -> None:
    """Three agents' rows appear; a GPU made hot turns its node's row degraded, and a
    SIGKILLed agent's row stale, without a reload; the page says it is live."""
    url, _ = await start_dashboard(fleet)
    for node in ("n1", "n2"):
        await fleet.start_agent(fleet.config(node))
    killed = fleet.config("n3")
    key = signing.load_or_create_key_file(killed.key_path)
    await approve(fleet.bus, Subjects(fleet.prefix), "n3", key.public_key)
    with agent_process(killed, tmp_path / "n3.log") as process:
        for node in ("n1", "n2", "n3"):
            await wait_record(fleet.bus, fleet.prefix, node, lambda r: r.state == "active", 30)
        page = await browser.new_page(viewport={"width": 1300, "height": 900})
        await page.goto(url + "/")
        await page.wait_for_selector("tr[data-node='n3']", timeout=HANG * 1000)
        await page.wait_for_selector("#live.on", timeout=HANG * 1000)
        assert await page.locator("#rows tr").count() == 3

        hot = Inject(ts=time.time(), node_id="n1", fault="temp", gpu=0, value=95.0)
        await fleet.publish_event(EVENT_INJECT, hot, "n1")
        await page.wait_for_selector("tr[data-node='n1'] .badge.warn", timeout=HANG * 1000)

        process.send_signal(signal.SIGKILL)
        await page.wait_for_selector("tr[data-node='n3'] .badge.bad", timeout=HANG * 1000)
        assert await page.inner_text("tr[data-node='n3'] .badge") == "stale"
        await page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)


async def test_node_page_charts_and_a_cordon_from_the_page(fleet: Fleet, browser: Any) -> None:
    """A node page charts points of its last hour; with allow_ui_commands a confirmed
    cordon is sent signed, reaches the node, and its result shows on the page."""
    url, key = await start_dashboard(fleet, allow_ui_commands=True, dashboard_history_interval=1.0)
    config = fleet.config("n1", trust_operators=[key.public_key])
    await fleet.start_agent(config)
    await wait_record(fleet.bus, fleet.prefix, "n1", lambda r: r.state == "active", 30)
    page = await browser.new_page()
    await page.goto(link(url, key))  # the one-time link logs the browser in
    await page.goto(url + "/ui/nodes/n1")

    async def charted() -> bool:
        points = await page.get_attribute("figure.chart", "data-points")
        return points is not None and int(points) >= 2

    await wait_for(charted, interval=0.5)
    page.on("dialog", lambda dialog: dialog.accept())
    await page.fill("input[name=reason]", "from the browser test")
    await page.click("button[value=cordon]")
    await page.wait_for_selector("p.notice")
    assert "cordon sent" in await page.inner_text("p.notice")
    await page.wait_for_selector("#results li b:text('done')", timeout=20_000)
    record = await wait_record(
        fleet.bus, fleet.prefix, "n1", lambda r: r.schedulability == "cordoned", 15
    )
    assert record.schedulability == "cordoned"


async def test_commands_are_refused_without_the_setting_or_the_page_token(fleet: Fleet) -> None:
    """Read-only by default (403, no buttons); with commands on, a logged-in post without
    the page's token or from another site is refused."""
    url, _ = await start_dashboard(fleet)
    async with client() as session:
        async with session.post(
            url + "/ui/nodes/n1/command", data={"action": "drain"}, headers={"Origin": url}
        ) as off:
            assert off.status == 403
            assert "commands from the page are off" in await off.text()
    url, key = await start_dashboard(fleet, allow_ui_commands=True)
    async with client() as session:
        await logged_in(session, url, key)
        async with session.post(
            url + "/ui/nodes/n1/command",
            data={"action": "drain", "token": "guess"},
            headers={"Origin": url},
        ) as forged:
            assert forged.status == 403
        async with session.post(
            url + "/ui/nodes/n1/command",
            data={"action": "drain"},
            headers={"Sec-Fetch-Site": "cross-site", "Origin": url},
        ) as foreign:
            assert foreign.status == 403


def test_a_nodes_own_words_are_text_on_the_page() -> None:
    """Markup in what a node says of itself (its schedulability reason, a workload's name
    or a check's reason) is escaped in its row and on its page."""
    hostile = "<img src=x onerror=alert(1)>"
    beat = heartbeat(
        "n1",
        schedulability="cordoned",
        schedulability_reason=hostile,
        health=Health(
            ts=1.0,
            status="degraded",
            score=60,
            checks=[HealthCheck(name="xid", status="degraded", reason=hostile, action=hostile)],
        ),
    )
    record = NodeRecord(
        node_id="n1", cluster="c1", state="cordoned", last_seq=1, last_seen=1.0,
        heartbeat=beat, health_score=60,
    )  # fmt: skip
    for html in (render.node_row(record, 2.0), render.node_detail(record, 2.0)):
        assert hostile not in html and "&lt;img src=x onerror=alert(1)&gt;" in html


def test_a_nodes_xids_show_their_severity_and_meaning() -> None:
    """The node page lists each GPU's XIDs with the catalog's severity, meaning and
    action (79 unhealthy, 13 degraded, an unknown code marked as such) and when each was
    last seen ("-" for a node's time past any calendar); no XIDs, no table."""
    xids = [
        XidCount(code=79, count=1, last_at=1.0),
        XidCount(code=13, count=4, last_at=2.0),
        XidCount(code=999, count=1, last_at=1e300),
    ]
    gpu = Gpu(
        index=0, uuid="GPU-0", name="H100", pci_bus_id="0", memory_total=1, memory_used=0,
        xids=xids,
    )  # fmt: skip
    capacity = Capacity(
        cpu_cores=1, cpu_percent=0.0, load_avg_1m=0.0, memory_total=1, memory_available=1,
        storage_total=1, storage_available=1, gpus_total=1, gpus_available=1,
    )  # fmt: skip
    beat = heartbeat("n1", sample=Sample(ts=1.0, capacity=capacity, gpus=[gpu]))
    record = NodeRecord(
        node_id="n1", cluster="c1", state="active", last_seq=1, last_seen=1.0, heartbeat=beat
    )  # fmt: skip
    page = render.node_detail(record, 2.0)
    rows = page.split("<h3>XIDs</h3>", 1)[1].split("</tbody>", 1)[0].split("<tr>")[2:]
    assert [row.split("</td>")[1:4] for row in rows] == [
        ["<td>79", "<td>1", '<td class="unhealthy">unhealthy'],
        ["<td>13", "<td>4", '<td class="degraded">degraded'],
        ["<td>999", "<td>1", '<td class="degraded">degraded'],
    ]
    assert render.esc(XID_TABLE[79].meaning) in rows[0]
    assert render.esc(XID_TABLE[13].action) in rows[1]
    assert "not in the agent&#x27;s table" in rows[2]
    assert rows[0].split("</td>")[-2] == "<td>1970-01-01 00:00:01 UTC"
    assert rows[2].split("</td>")[-2] == "<td>-", "a time past any calendar is '-'"
    bare = msgspec.structs.replace(gpu, xids=[])
    plain = msgspec.structs.replace(beat, sample=Sample(ts=1.0, capacity=capacity, gpus=[bare]))
    assert "<h3>XIDs</h3>" not in render.node_detail(
        msgspec.structs.replace(record, heartbeat=plain), 2.0
    )


async def test_queries_never_fail_and_are_escaped(fleet: Fleet) -> None:
    """A query holding markup comes back escaped; nonsense sort, page and label
    parameters give the table, not an error; an unknown node and a path outside the
    static files are 404."""
    url, _ = await start_dashboard(fleet)
    async with aiohttp.ClientSession() as session:
        async with session.get(url + "/", params={"q": "<script>x", "label": "team=x"}) as page:
            text = await page.text()
            assert page.status == 200 and "<script>x" not in text and "&lt;script&gt;x" in text
        for params in ({"sort": "nope", "page": "-3"}, {"page": "x", "label": "=="}):
            async with session.get(url + "/", params=params) as odd:
                assert odd.status == 200 and "nodes" in await odd.text()
        async with session.get(url + "/ui/nodes/nobody") as missing:
            assert missing.status == 404
        async with session.get(url + "/ui/static/../../etc/passwd") as escape:
            assert escape.status == 404


def test_passwords_are_hashed_and_checked() -> None:
    """A stored line checks its own password only."""
    stored = hash_password("s3cret", iterations=1000)
    assert check_password("s3cret", stored) and not check_password("other", stored)
    assert not check_password("s3cret", "md5$1$00$00")


def test_exposed_without_tls_and_login_is_refused() -> None:
    """Served beyond loopback with the dashboard on, the HTTP port needs TLS and a users
    file: without them the aggregator stops with one line saying what to set."""
    config = AggregatorConfig(http_host="0.0.0.0")
    with pytest.raises(FatalError, match="http_tls_cert, http_tls_key and http_users_file"):
        exposure(config, web.Application())
    exposure(msgspec.structs.replace(config, dashboard=False), web.Application())


async def test_exposed_over_tls_asks_for_a_login(fleet: Fleet, tmp_path: Path) -> None:
    """On 0.0.0.0 with TLS and a users file: no login is 401 with a realm (browsers ask),
    a wrong password 401, the right one 200, over TLS the client verifies."""
    pki = Pki(tmp_path / "tls")
    users = tmp_path / "users"
    users.write_text(f"alice:{hash_password('correct horse battery', iterations=1000)}\n")
    url, _ = await start_dashboard(
        fleet,
        http_host="0.0.0.0",
        http_tls_cert=str(pki.dir / "server.pem"),
        http_tls_key=str(pki.dir / "server-key.pem"),
        http_users_file=str(users),
    )
    https = url.replace("http://", "https://")
    connector = aiohttp.TCPConnector(ssl=pki.client())
    async with aiohttp.ClientSession(connector=connector) as session:
        async with session.get(https + "/") as anonymous:
            assert anonymous.status == 401
            assert anonymous.headers["WWW-Authenticate"].startswith('Basic realm="fleet"')
        wrong = {"Authorization": basic("alice", "wrong horse")}
        async with session.get(https + "/nodes", headers=wrong) as refused:
            assert refused.status == 401
        right = {"Authorization": basic("alice", "correct horse battery")}
        async with session.get(https + "/", headers=right) as page:
            assert page.status == 200 and "GPU fleet" in await page.text()


async def test_a_node_in_maintenance_says_so(fleet: Fleet) -> None:
    """A node a maintenance window covers shows a maintenance badge in its row and on its
    page; a node outside it does not."""
    now = time.time()
    window = MaintenanceWindow(
        id="r12", since=now, until=now + 3600, by="U" + "A" * 55, selector={"rack": "r12"}
    )
    bucket = await fleet.bus.kv(Subjects(fleet.prefix).bucket_name(BUCKET_MAINTENANCE))
    await bucket.put("r12", codec.encode(window))
    url, _ = await start_dashboard(fleet)
    await fleet.start_agent(fleet.config("n1", labels={"rack": "r12"}))
    await fleet.start_agent(fleet.config("n2", labels={"rack": "r13"}))
    for node in ("n1", "n2"):
        await wait_record(fleet.bus, fleet.prefix, node, lambda r: r.state == "active", 30)
    async with aiohttp.ClientSession() as session:
        async with session.get(url + "/") as page:
            rows = {
                row.split('"')[0]: row for row in (await page.text()).split('<tr data-node="')[1:]
            }
        assert ">maintenance<" in rows["n1"] and ">maintenance<" not in rows["n2"]
        async with session.get(url + "/ui/nodes/n1") as node_page:
            assert 'title="window r12: no reason given">maintenance<' in await node_page.text()


async def test_the_fleet_chart_counts_states_from_the_state_index(fleet: Fleet) -> None:
    """A sample of the fleet chart takes the counts by state from the state index where
    every partition has a fresh one (deregistered nodes left out), and passes over no
    node for them (no snapshot built); without an index it counts the pages' snapshot."""
    subjects = Subjects(fleet.prefix)
    await provision(fleet.bus.js, subjects, limits=TEST_LIMITS)

    def dashboard() -> DashboardActor:
        aggregator = new_aggregator(fleet.bus, fleet.prefix)
        assert isinstance(aggregator.metrics, AggregatorMetrics)
        config = msgspec.structs.replace(aggregator.config, http_port=0)
        api = FleetApiActor(config, fleet.bus, aggregator.metrics, dict, aggregator.view)
        return DashboardActor(config, fleet.bus, api, HeldNodes(aggregator.view))

    unindexed = dashboard()
    await unindexed._sample()
    assert unindexed._snapshot is not None
    assert unindexed.fleet_history.latest("active") == 0
    index = await fleet.bus.kv(subjects.bucket_name(BUCKET_INDEX))
    for partition, counts in enumerate(
        ({"c1": {"active": 3, "stale": 1, "deregistered": 5}}, {"c2": {"active": 4}})
    ):
        part = PartitionIndex(
            partition=partition, partitions=2, holder="a", written=time.time(), counts=counts
        )
        await index.put(index_key(partition), codec.encode(part))
    indexed = dashboard()
    await indexed._sample()
    assert indexed._snapshot is None
    assert indexed.fleet_history.latest("active") == 7
    assert indexed.fleet_history.latest("stale or offline") == 1


async def test_a_sample_looks_only_at_the_nodes_that_changed(fleet: Fleet) -> None:
    """After the first round, a round of the charts' history looks at the nodes beaten,
    taken in or let go since the last one and at no other: an idle round looks at none,
    and the quiet nodes' points and share of the totals are repeated as they were."""
    subjects = Subjects(fleet.prefix)
    keys = {node: signing.KeyPair.generate() for node in ("n1", "n2")}
    for node, key in keys.items():
        await approve(fleet.bus, subjects, node, key.public_key)
    owner = await fleet.start_aggregator(checkpoint_interval=120.0)
    aggregator = owner.actors[0]
    assert isinstance(aggregator, AggregatorActor)
    assert isinstance(aggregator.metrics, AggregatorMetrics)

    async def beat(node: str, seq: int) -> None:
        body = codec.encode(heartbeat(node, seq, stale_after=60.0, interval=30.0))
        # The TTL the beat claims, as an agent sends it: a 2 s one could expire unjudged
        # while a busy machine's aggregator starts.
        await publish(fleet.bus, fleet.prefix, body, keys[node].headers(body), node, ttl=60)

        def accepted() -> bool:
            state = aggregator.ledger.nodes.get(node)
            return state is not None and state.record.last_seq == seq

        await wait_for(accepted)

    for node in keys:
        await beat(node, 1)
    config = msgspec.structs.replace(aggregator.config, http_port=0)
    api = FleetApiActor(config, fleet.bus, aggregator.metrics, dict, aggregator.view)
    dashboard = DashboardActor(config, fleet.bus, api, HeldNodes(aggregator.view))
    looked: list[str] = []
    seq_of = dashboard.held.seq

    def counted(node: str) -> int | None:
        looked.append(node)
        return seq_of(node)

    dashboard.held.seq = counted  # type: ignore[method-assign]  # counts the nodes looked at
    await dashboard._sample()
    assert sorted(looked) == ["n1", "n2"]
    looked.clear()
    await dashboard._sample()
    assert looked == []
    assert dashboard.fleet_history.latest("nodes held") == 2
    assert dashboard.history.current("n2", 1)
    await beat("n1", 2)
    await dashboard._sample()
    assert looked == ["n1"]
    assert dashboard.fleet_history.latest("nodes held") == 2
    assert dashboard.history.current("n1", 2) and dashboard.history.current("n2", 1)


class OneRecordView:
    """A fleet view of one node that fails the test if asked for every record."""

    complete = True

    def __init__(self, record: NodeRecord) -> None:
        self.one = record

    def current(self) -> dict[str, NodeRecord]:
        raise AssertionError("every record read for one node's result")

    def record(self, node: str) -> NodeRecord | None:
        return self.one if node == self.one.node_id else None

    async def live_records(self, records: list[NodeRecord]) -> list[NodeRecord]:
        return records


async def test_a_nodes_result_reads_its_record_alone(fleet: Fleet) -> None:
    """Each signed result the dashboard keeps is checked against its node's record alone,
    not the whole fleet's (every record per result held the event loop for 25 ms with
    100,000 nodes held, 0.5 s with half of them held by another aggregator, at each of
    the thousands of results a rolling drain sends); one signed by another key is still
    dropped."""
    aggregator = new_aggregator(fleet.bus, fleet.prefix)
    key = signing.KeyPair.generate()
    record = NodeRecord(
        node_id="n1",
        cluster="c1",
        state="active",
        last_seq=1,
        last_seen=1.0,
        public_key=key.public_key,
    )
    dashboard = DashboardActor(
        aggregator.config, fleet.bus, OneRecordView(record), HeldNodes(aggregator.view)
    )
    subject = Subjects(fleet.prefix).result("c1", "n1")
    for command_id, signer in (("c-1", key), ("c-2", signing.KeyPair.generate())):
        result = CommandResult(
            command_id=command_id, node_id="n1", cluster="c1", status="done", ts=time.time()
        )
        body = codec.encode(result)
        await dashboard._on_result(
            Msg(fleet.bus.nc, subject=subject, data=body, headers=signer.headers(body))
        )
    assert [kept.command_id for kept in dashboard.results["n1"]] == ["c-1"]
