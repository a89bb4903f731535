"""The dashboard as an operator's console, in a real headless Chromium against a real
nats-server and aggregator: the first screen puts problems first, live updates keep what
the reader opened, a chart has axes, a threshold, a hover readout and the live "now", a
storm of stale nodes is one condition, every page shows a node's hostile claims as text,
and every page needs the login the port needs."""

from __future__ import annotations

import time
from typing import Any

import aiohttp

from schemas import codec
from schemas.base import CheckStatus, HealthStatus
from schemas.events import (
    Capacity,
    Gpu,
    Health,
    HealthCheck,
    HostFacts,
    Inject,
    Sample,
)
from schemas.messages import Alert, MaintenanceWindow, NodeRecord, WorkloadSummary
from schemas.placement import PlacedWorkload, Replica
from schemas.remediation import Hold, PolicyRecord
from schemas.subjects import (
    BUCKET_MAINTENANCE,
    BUCKET_POLICY,
    BUCKET_WORKLOADS,
    EVENT_INJECT,
    Subjects,
)
from schemas.workloads import Deploy
from tests.support.dashboard import beat, client, logged_in, put_fact, start_dashboard
from tests.support.fleet import Fleet, wait_for, wait_record

HANG = 30_000
"""Milliseconds a browser wait may take: a bound on a hang, not a target."""
HOSTILE = "<img src=x onerror=alert(1)>"
PAGES = ("/", "/ui/nodes/n1", "/ui/gpus", "/ui/workloads", "/ui/policy", "/ui/maintenance")


def health(status: HealthStatus, score: int, reason: str = "fine") -> Health:
    """A health report of ``status``, its nvml check saying ``reason``."""
    said: CheckStatus = "ok" if status == "healthy" else status
    check = HealthCheck(name="nvml", status=said, reason=reason)
    return Health(ts=time.time(), status=status, score=score, checks=[check])


async def rows_in_order(page: Any) -> list[str]:
    return list(
        await page.eval_on_selector_all(
            "#rows tr[data-node]", "rows => rows.map(r => r.dataset.node)"
        )
    )


async def test_the_first_screen_puts_problems_first(fleet: Fleet, browser: Any) -> None:
    """A healthy, a degraded and a stale node, named so that name order is the reverse:
    the page says two need a person and lists the stale one first, then the degraded,
    then the healthy, each problem with its reason, without a reload."""
    url, _ = await start_dashboard(fleet)
    await beat(fleet, "a1", health=health("healthy", 100), stale_after=60.0)
    await beat(fleet, "b2", health=health("degraded", 70, "GPU 0 at 95 C"), stale_after=60.0)
    await beat(fleet, "c3", health=health("healthy", 100), stale_after=2.0)
    page = await browser.new_page(viewport={"width": 1400, "height": 1000})
    await page.goto(url + "/")
    await page.wait_for_selector("tr[data-node='c3'] .badge.bad", timeout=HANG)
    await page.wait_for_function(
        "[...document.querySelectorAll('#rows tr[data-node]')].map(r => r.dataset.node)"
        ".join() === 'c3,b2,a1'",
        timeout=HANG,
    )
    assert await rows_in_order(page) == ["c3", "b2", "a1"]
    headline = await page.inner_text(".headline")
    assert headline.startswith("2 nodes need a person") and "1 stale" in headline
    assert "stale: silent for" in await page.inner_text("tr[data-node='c3'] .why")
    assert "GPU 0 at 95 C" in await page.inner_text("tr[data-node='b2'] .why")
    assert await page.inner_text("tr[data-node='a1'] td:nth-child(4)") == "-"
    assert "temperature (of 100 °C)" in await page.inner_text(".legend")
    box = await page.locator("tr[data-node='b2']").bounding_box()
    assert box is not None and box["y"] + box["height"] < 1000, "on the first screen"


async def test_what_the_reader_opened_stays_open_across_live_updates(
    fleet: Fleet, browser: Any
) -> None:
    """A health detail opened by the reader is still open after three live updates of
    its row, the page has not scrolled back, and the search box keeps focus and text."""
    url, _ = await start_dashboard(fleet)
    await fleet.start_agent(fleet.config("n1"))
    await wait_record(fleet.bus, fleet.prefix, "n1", lambda r: r.health_score is not None, 30)
    page = await browser.new_page(viewport={"width": 900, "height": 400})
    await page.goto(url + "/")
    detail = "tr[data-node='n1'] details[data-key='health']"
    await page.wait_for_selector(detail, timeout=HANG)
    await page.wait_for_selector("#live.on", timeout=HANG)
    await page.click(f"{detail} summary")
    assert await page.get_attribute(detail, "open") is not None
    await page.fill("input[name=q]", "n")
    await page.evaluate("window.scrollTo(0, 150)")
    scrolled = await page.evaluate("window.scrollY")
    updates = int(await page.evaluate("Number(document.body.dataset.updates || 0)"))
    await page.wait_for_function(
        f"Number(document.body.dataset.updates || 0) >= {updates + 3}", timeout=HANG
    )
    assert await page.get_attribute(detail, "open") is not None, "still open"
    assert await page.evaluate("window.scrollY") == scrolled
    assert await page.evaluate("document.activeElement.name") == "q"
    assert await page.input_value("input[name=q]") == "n"


async def test_a_chart_has_axes_a_threshold_a_readout_and_the_live_now(
    fleet: Fleet, browser: Any
) -> None:
    """The hottest-GPU chart of a node whose GPUs are made 95 °C: clock labels on its time
    axis, °C on its value axis, the 85 °C threshold, a hover readout of a point, and its
    "now" is the live heartbeat's hottest GPU (as the fleet API reads it)."""
    url, _ = await start_dashboard(fleet, dashboard_history_interval=1.0)
    await fleet.start_agent(fleet.config("n1"))
    await wait_record(fleet.bus, fleet.prefix, "n1", lambda r: r.state == "active", 30)
    hot = Inject(ts=time.time(), node_id="n1", fault="temp", value=95.0)
    await fleet.publish_event(EVENT_INJECT, hot, "n1")
    page = await browser.new_page(viewport={"width": 1400, "height": 1000})
    await page.goto(url + "/ui/nodes/n1")
    chart = "figure[data-chart='hottest']"
    await page.wait_for_selector(f"{chart}[data-now='95']", timeout=HANG)
    await page.wait_for_function(
        f'Number(document.querySelector("{chart}").dataset.points) >= 2', timeout=HANG
    )
    times = await page.eval_on_selector_all(
        f"{chart} text.axis-x", "t => t.map(e => e.textContent)"
    )
    assert "UTC" in times and sum(1 for t in times if t[:2].isdigit() and ":" in t) >= 3
    values = await page.eval_on_selector_all(
        f"{chart} text.axis-y", "t => t.map(e => e.textContent)"
    )
    assert values and all(value.endswith("°C") for value in values)
    assert await page.text_content(f"{chart} line.threshold title") == "85 °C: hot"
    assert "max of GPUs" in await page.inner_text(f"{chart} figcaption")
    assert "(live heartbeat" in await page.inner_text(f"{chart} .now")
    await page.hover(f"{chart} svg", position={"x": 320, "y": 50})
    await page.wait_for_function(
        f'/UTC: hottest GPU [0-9]+ °C/.test(document.querySelector("{chart} output").textContent)',
        timeout=HANG,
    )
    async with aiohttp.ClientSession() as session:
        async with session.get(url + "/nodes/n1") as answer:
            live = codec.decode(await answer.read(), NodeRecord)
    assert live.heartbeat is not None and live.heartbeat.sample is not None
    hottest = max(gpu.temperature_c or 0.0 for gpu in live.heartbeat.sample.gpus)
    assert await page.get_attribute(chart, "data-now") == f"{hottest:g}" == "95"


async def test_a_storm_of_stale_nodes_is_one_condition(fleet: Fleet, browser: Any) -> None:
    """20 nodes that go stale together are one condition row, '20 nodes stale in c1',
    listing the 20 on expand; a link filtering by kind keeps it in the URL. They are the
    whole stream, so their silence is a bus outage until ``bus_outage_max``: 1 s here, the
    test is about the page, not that bound."""
    url, _ = await start_dashboard(fleet, bus_outage_max=1.0)
    nodes = [f"sim-{number:02}" for number in range(20)]
    for node in nodes:
        await beat(fleet, node, stale_after=2.0)
    page = await browser.new_page(viewport={"width": 1400, "height": 1000})
    await page.goto(url + "/")
    storm = "table.conditions tr:has-text('20 nodes stale in c1')"
    await page.wait_for_selector(storm, timeout=HANG)
    kinds = await page.eval_on_selector_all(
        "table.conditions tbody tr", "rows => rows.map(r => r.children[1].textContent)"
    )
    assert kinds.count("stale") == 1
    await page.click(f"{storm} summary")
    listed = await page.eval_on_selector_all(f"{storm} details a", "a => a.map(e => e.textContent)")
    assert sorted(listed) == nodes
    await page.click("#conditions .filters a:text-is('stale')")
    await page.wait_for_url("**kind=stale**", timeout=HANG)
    await page.wait_for_selector(storm, timeout=HANG)


async def hostile_fleet(fleet: Fleet) -> None:
    """n1 claims hostile markup everywhere a node's words are shown (host name, CPU, a GPU's
    name, a check's reason, a workload), and the fleet's stores hold it where operators'
    words go (a window's reason, the policy's hold, a placed replica's why)."""
    capacity = Capacity(
        cpu_cores=1, cpu_percent=0.0, load_avg_1m=0.0, memory_total=1, memory_available=1,
        storage_total=1, storage_available=1, gpus_total=1, gpus_available=1,
    )  # fmt: skip
    gpu = Gpu(index=0, uuid="GPU-0", name=HOSTILE, pci_bus_id="0", memory_total=2**30,
              memory_used=0, temperature_c=50.0)  # fmt: skip
    host = HostFacts(uptime_s=1.0, memory_used_pct=1.0, cpu_model=HOSTILE)
    sample = Sample(ts=time.time(), capacity=capacity, gpus=[gpu], hostname=HOSTILE, host=host)
    running = WorkloadSummary(name=HOSTILE, engine="process", state="ready", since=1.0, port=1)
    await beat(
        fleet, "n1", stale_after=60.0, sample=sample, workloads=[running],
        health=health("degraded", 70, HOSTILE), schedulability_reason=HOSTILE,
    )  # fmt: skip
    now = time.time()
    window = MaintenanceWindow(id="w1", since=now - 60, until=now + 3600, by="U" + "A" * 55,
                               nodes=["n2"], reason=HOSTILE)  # fmt: skip
    await put_fact(fleet, BUCKET_MAINTENANCE, "w1", window)
    hold = Hold(reason_class="gpu", reason=HOSTILE, action="cordon", command_id="c1",
                since=now, needs_attention=True, hook_error=HOSTILE)  # fmt: skip
    policy = PolicyRecord(cluster="c1", holds={"n1": hold}, would=[HOSTILE], tripped_at=now)
    await put_fact(fleet, BUCKET_POLICY, "c1", policy)
    deploy = Deploy(name="chat", engine="process", model=HOSTILE, placed=True)
    replica = Replica(index=0, node="n1", cluster="c1", why=HOSTILE, deployed_at=now)
    placed = PlacedWorkload(name="chat", deploy=deploy, replicas=[replica], created_at=now)
    await put_fact(fleet, BUCKET_WORKLOADS, "chat", placed)
    decision = Alert(id="a1", kind="remediation", node_id="n1", cluster="c1", severity="info",
                     message="dry run, would: " + HOSTILE, ts=now)  # fmt: skip
    subject = Subjects(fleet.prefix).alert("remediation", "c1", "n1")
    await fleet.bus.js.publish(subject, codec.encode(decision))


async def test_every_page_shows_hostile_values_as_text(fleet: Fleet, browser: Any) -> None:
    """A node's hostile claims and hostile words in the fleet's stores are text on every
    page: shown as typed, never an element, never a script run."""
    url, _ = await start_dashboard(fleet)
    await hostile_fleet(fleet)
    await wait_record(fleet.bus, fleet.prefix, "n1", lambda r: r.state == "degraded", 30)
    page = await browser.new_page(viewport={"width": 1400, "height": 1000})
    dialogs: list[str] = []
    page.on("dialog", lambda dialog: dialogs.append(dialog.message))
    for path in PAGES:
        await page.goto(url + path)
        await page.wait_for_selector("#live.on", timeout=HANG)
        await page.wait_for_function(
            f"document.querySelector('main').innerText.includes({HOSTILE!r})", timeout=HANG
        )
        assert await page.locator("img").count() == 0, path
    assert dialogs == []


async def test_every_page_needs_the_login_the_port_needs(fleet: Fleet) -> None:
    """With commands on, each page and its event stream is 401 without a login and 200
    with one (the port's access rules cover the new pages); read-only, they are served."""
    url, key = await start_dashboard(fleet, allow_ui_commands=True)
    await beat(fleet, "n1", stale_after=60.0)
    await wait_record(fleet.bus, fleet.prefix, "n1", lambda r: r.state == "active", 30)
    streams = [f"/ui/events?view={view}" for view in ("gpus", "workloads", "policy", "maintenance")]
    async with client() as anonymous, client() as operator:
        for path in (*PAGES, *streams):
            async with anonymous.get(url + path) as refused:
                assert refused.status == 401, path
        await logged_in(operator, url, key)
        for path in PAGES:
            async with operator.get(url + path) as page:
                assert page.status == 200, path
    read_only, _ = await start_dashboard(fleet)
    async with client() as reader:

        async def served() -> bool:
            """Every page is 200 (n1's once this second aggregator's API has its record)."""
            for path in PAGES:
                async with reader.get(read_only + path) as page:
                    if page.status != 200:
                        return False
            return True

        assert await wait_for(served, timeout=30, interval=0.5)
