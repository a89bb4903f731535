"""The console's panels and pages as an operator reads them, in a real headless Chromium
against a real nats-server and aggregator: the conditions count repeats, filter by
severity in the URL and grey what resolved; the fleet table marks XIDs, ECC errors, lost
GPUs, maintenance and the policy; the GPU page filters and sorts as ``fleetctl gpus``;
the workloads page follows a placed workload's replicas and moves; the policy page shows
its breaker, holds and would-be actions; the maintenance page sorts its windows; the
node page says labels, host, versions, maintenance and the policy; the fleet's charts
count nodes by state. Each page updates live without a reload."""

from __future__ import annotations

import time
from typing import Any

from schemas import codec
from schemas.events import Capacity, Gpu, HostFacts, Sample, XidCount
from schemas.messages import Alert, MaintenanceWindow, WorkloadSummary
from schemas.placement import Leftover, PlacedWorkload, Replica
from schemas.remediation import Hold, PolicyRecord
from schemas.subjects import BUCKET_MAINTENANCE, BUCKET_POLICY, BUCKET_WORKLOADS, Subjects
from schemas.workloads import Deploy
from tests.fleet.test_dashboard_console import HANG, health, rows_in_order
from tests.support.dashboard import beat, put_fact, start_dashboard
from tests.support.fleet import Fleet, wait_record

GIB = 2**30
OPERATOR = "U" + "A" * 55


def gpu(index: int, temperature: float, **changes: Any) -> Gpu:
    """GPU ``index`` of a node, at ``temperature`` °C, with ``changes``."""
    return Gpu(index=index, uuid=f"GPU-{index}", name="H100", pci_bus_id=str(index),
               memory_total=80 * GIB, memory_used=GIB, temperature_c=temperature,
               utilization_pct=50.0, power_w=300.0, **changes)  # fmt: skip


def sample(*gpus: Gpu, host: HostFacts | None = None) -> Sample:
    """A node's sample of ``gpus`` (and ``host``), stamped now."""
    capacity = Capacity(
        cpu_cores=8, cpu_percent=1.0, load_avg_1m=0.1, memory_total=GIB, memory_available=GIB,
        storage_total=GIB, storage_available=GIB, gpus_total=len(gpus), gpus_available=len(gpus),
    )  # fmt: skip
    return Sample(ts=time.time(), capacity=capacity, gpus=list(gpus), hostname="h", host=host)


async def alert(fleet: Fleet, kind: Any, node: str, severity: Any, message: str, n: int) -> None:
    """Alert number ``n`` of ``kind`` on ``node``, stored in the alert stream as an
    aggregator stores it."""
    made = Alert(id=f"{kind}-{node}-{n}", kind=kind, node_id=node, cluster="c1",
                 severity=severity, message=message, ts=time.time())  # fmt: skip
    subject = Subjects(fleet.prefix).alert(kind, "c1", node)
    await fleet.bus.js.publish(subject, codec.encode(made))


async def texts(page: Any, selector: str) -> list[str]:
    return list(await page.eval_on_selector_all(selector, "all => all.map(e => e.innerText)"))


async def test_conditions_count_repeats_filter_by_severity_and_grey_the_resolved(
    fleet: Fleet, browser: Any
) -> None:
    """Three interruptions of n1 are one critical row counted x3, listed first; a stale
    node's row turns resolved (greyed) when it beats again, without a reload; the
    severity filter lives in the URL and leaves only its rows; the raw feed opens on a
    click and lists every alert."""
    url, _ = await start_dashboard(fleet)
    await beat(fleet, "q1", stale_after=2.0)
    for n in range(3):
        await alert(fleet, "interruption", "n1", "critical", f"spot notice {n}", n)
    page = await browser.new_page(viewport={"width": 1400, "height": 1000})
    await page.goto(url + "/")
    rows = "#conditions table.conditions tbody tr"
    stale = f"{rows}:has-text('q1'):has-text('stale')"
    await page.wait_for_selector(f"{stale}:not(.resolved)", timeout=HANG)
    spot = f"{rows}:has-text('spot notice 2')"
    await page.wait_for_selector(spot, timeout=HANG)
    assert await page.inner_text(f"{spot} td:nth-child(6)") == "x3"
    assert (await texts(page, f"{rows} td:nth-child(2)"))[0] == "interruption"
    assert await page.locator(f"{rows}:has-text('interruption')").count() == 1
    assert "since" in await page.inner_text(f"{spot} td:nth-child(5)")
    await beat(fleet, "q1", seq=2, stale_after=60.0)
    await page.wait_for_selector(f"{stale}.resolved", timeout=HANG)
    assert "resolved" in await page.inner_text(f"{stale}.resolved td:nth-child(5)")
    greyed = await page.eval_on_selector(
        f"{stale}.resolved", "row => getComputedStyle(row).opacity"
    )
    assert float(greyed) < 1.0, "greyed"
    await page.click("#conditions .filters a:text-is('critical')")
    await page.wait_for_url("**severity=critical**", timeout=HANG)
    await page.wait_for_selector(spot, timeout=HANG)
    assert set(await texts(page, f"{rows} .sev")) == {"critical"}
    await page.click("details.raw summary")
    feed = await texts(page, "details.raw #feed li")
    assert sum("spot notice" in line for line in feed) == 3
    assert any("q1 stale" in line for line in feed) and any("q1 recovered" in line for line in feed)


async def test_a_row_marks_xids_ecc_lost_gpus_maintenance_and_the_policy(
    fleet: Fleet, browser: Any
) -> None:
    """A node with an XID, uncorrectable ECC errors and a lost GPU, in a maintenance
    window, and one the policy gave up on: each row carries its marks, the counts say
    who the policy holds and who is in maintenance, and the legend explains the marks."""
    url, _ = await start_dashboard(fleet)
    now = time.time()
    xid = XidCount(code=79, count=2, last_at=now)
    broken = sample(gpu(0, 50.0, xids=[xid], ecc_uncorrected=3), gpu(1, 50.0, lost=True))
    await beat(fleet, "n1", stale_after=60.0, sample=broken)
    await beat(fleet, "n2", stale_after=60.0, health=health("unhealthy", 40, "GPU 1 lost"))
    window = MaintenanceWindow(id="w1", since=now - 60, until=now + 3600, by=OPERATOR,
                               nodes=["n1"], reason="reseat GPU 1")  # fmt: skip
    await put_fact(fleet, BUCKET_MAINTENANCE, "w1", window)
    hold = Hold(reason_class="gpu", reason="GPU 1 lost", action="cordon", command_id="c1",
                since=now, needs_attention=True)  # fmt: skip
    await put_fact(fleet, BUCKET_POLICY, "c1", PolicyRecord(cluster="c1", holds={"n2": hold}))
    page = await browser.new_page(viewport={"width": 1400, "height": 1000})
    await page.goto(url + "/")
    await page.wait_for_selector("tr[data-node='n2'] .mark:text-is('policy needs a person')",
                                 timeout=HANG)  # fmt: skip
    await page.wait_for_selector("tr[data-node='n1'] .mark:text-is('maintenance')", timeout=HANG)
    marks = await texts(page, "tr[data-node='n1'] .mark")
    assert marks == ["XID 79", "ECC 3", "lost 1", "maintenance"]
    assert await page.get_attribute("tr[data-node='n1'] .mark:text-is('maintenance')",
                                    "title") == "window w1: reseat GPU 1"  # fmt: skip
    assert await page.locator("tr[data-node='n1'] svg.gpu").count() == 1
    assert await page.locator("tr[data-node='n1'] .gpu.lost").count() == 1
    assert await page.inner_text("tr[data-node='n1'] td:nth-child(4)") == "-", "in maintenance"
    # Why and the order come from the pages' snapshot, built again in the background:
    # they follow the rows' marks within a refresh.
    await page.wait_for_function(
        "() => document.querySelector(\"tr[data-node='n2'] .why\")"
        ".innerText.includes('policy needs a person')",
        timeout=HANG,
    )
    assert await rows_in_order(page) == ["n2", "n1"]
    for said in ("held by the policy 1", "policy needs a person 1", "in maintenance 1"):
        await page.wait_for_function(
            "said => document.querySelector('#counts').innerText.includes(said)",
            arg=said,
            timeout=HANG,
        )
    legend = await page.inner_text(".legend")
    assert "XIDs reported" in legend and "uncorrectable ECC errors" in legend
    assert "a lost GPU" in legend and "held by the remediation policy" in legend


async def test_the_gpu_page_filters_and_sorts_as_fleetctl_gpus(fleet: Fleet, browser: Any) -> None:
    """Every GPU of the fleet, hottest first with ``sort=temp``, a GPU over 85 °C marked,
    its XIDs listed; the node filter keeps its choice in the URL; a hotter reading moves
    a GPU up without a reload."""
    url, _ = await start_dashboard(fleet)
    xid = XidCount(code=48, count=1, last_at=time.time())
    await beat(fleet, "n1", stale_after=60.0, sample=sample(gpu(0, 40.0), gpu(1, 90.0, xids=[xid])))
    await beat(fleet, "n2", stale_after=60.0, sample=sample(gpu(0, 70.0)))
    page = await browser.new_page(viewport={"width": 1400, "height": 1000})
    await page.goto(url + "/ui/gpus?sort=temp")
    order = "[...document.querySelectorAll('#gpus tr[data-key]')].map(r => r.dataset.key).join()"
    await page.wait_for_function(f"{order} === 'n1|1,n2|0,n1|0'", timeout=HANG)
    hot = "#gpus tr[data-key='n1|1']"
    assert await page.get_attribute(f"{hot} td:nth-child(5)", "class") == "bad"
    assert await page.inner_text(f"{hot} td:nth-child(5)") == "90 °C"
    assert await page.inner_text(f"{hot} td:nth-child(9)") == "48 x1"
    assert "(3 GPUs)" in await page.inner_text("#gpus .pager")
    await page.wait_for_selector("#live.on", timeout=HANG)
    await beat(fleet, "n2", seq=2, stale_after=60.0, sample=sample(gpu(0, 95.0)))
    await page.wait_for_function(f"{order} === 'n2|0,n1|1,n1|0'", timeout=HANG)
    await page.fill("form.filters input[name=node]", "n2")
    await page.click("form.filters button")
    await page.wait_for_url("**node=n2**", timeout=HANG)
    await page.wait_for_function(f"{order} === 'n2|0'", timeout=HANG)
    assert "sort=temp" in page.url


async def test_the_workloads_page_follows_a_placed_workload(fleet: Fleet, browser: Any) -> None:
    """A placed workload's replicas: the one running says its node, GPU, state as the
    node reports it, endpoint, moves and why; the pending one says no node fits; the old
    copy left by its move is listed; a restart the node reports shows without a reload."""
    url, _ = await start_dashboard(fleet)
    now = time.time()
    running = WorkloadSummary(name="chat", engine="process", state="ready", since=now,
                              port=8001, gpus=[1], placed=True)  # fmt: skip
    await beat(fleet, "n1", stale_after=60.0, workloads=[running])
    moved = Replica(index=0, node="n1", cluster="c1", gpus=[1], deployed_at=now - 120,
                    command_id="d1", why="n1: 1 free GPU; passed over n2 (cordoned)",
                    moves=1)  # fmt: skip
    pending = Replica(index=1, why="no node fits: 0 of 2 nodes have a free GPU")
    left = Leftover(node="n2", cluster="c1", index=0, since=now - 120, stop_by=now + 300,
                    reason="moved off a cordoned node")  # fmt: skip
    deploy = Deploy(name="chat", engine="process", model="llama", placed=True)
    placed = PlacedWorkload(name="chat", deploy=deploy, gpus=1, replicas=[moved, pending],
                            leftovers=[left], created_at=now - 600)  # fmt: skip
    await put_fact(fleet, BUCKET_WORKLOADS, "chat", placed)
    page = await browser.new_page(viewport={"width": 1400, "height": 1000})
    await page.goto(url + "/ui/workloads")
    first = "#workloads tr[data-key='chat|0']"
    await page.wait_for_selector(f"{first}:has-text('ready')", timeout=HANG)
    cells = await texts(page, f"{first} td")
    assert cells[:3] == ["0", "n1", "1"]
    assert cells[3].startswith("ready") and "node says" in cells[3]
    assert cells[4] == "127.0.0.1:8001"
    assert cells[6].startswith("1, on this node since")
    assert cells[7] == "n1: 1 free GPU; passed over n2 (cordoned)"
    second = await texts(page, "#workloads tr[data-key='chat|1'] td")
    assert second[1] == "-" and second[3].startswith("pending: no node fits")
    assert second[7] == "no node fits: 0 of 2 nodes have a free GPU"
    copies = await page.inner_text("#workloads section.workload ul")
    assert "old copy on n2" in copies and "moved off a cordoned node" in copies
    assert "process llama; 1 GPU(s) a replica" in await page.inner_text("#workloads p")
    await page.wait_for_selector("#live.on", timeout=HANG)
    restarted = WorkloadSummary(name="chat", engine="process", state="ready", since=now,
                                port=8001, gpus=[1], placed=True, restarts=2)  # fmt: skip
    await beat(fleet, "n1", seq=2, stale_after=60.0, workloads=[restarted])
    await page.wait_for_selector(f"{first}:has-text('2 restarts')", timeout=HANG)


async def test_the_policy_page_shows_the_breaker_holds_and_would_be_actions(
    fleet: Fleet, browser: Any
) -> None:
    """A tripped breaker says how to reset it and what it would do; a hold that needs a
    person says so; the nodes remediated are counted; a dry run's would-be action and the
    policy's decisions are listed, the newest first; a hold released shows without a
    reload."""
    url, _ = await start_dashboard(fleet)
    now = time.time()
    hold = Hold(reason_class="gpu", reason="XID 79 on GPU 0", action="cordon",
                command_id="c1", since=now - 300, needs_attention=True,
                hooks_done=["drain-jobs"], hook_error="reboot hook exited 1")  # fmt: skip
    record = PolicyRecord(cluster="c1", holds={"n1": hold}, history={"n1": [now - 300]},
                          tripped_at=now - 60, would=["cordon n3: XID 79"], limit=2,
                          updated_by="aggregator-a")  # fmt: skip
    await put_fact(fleet, BUCKET_POLICY, "c1", record)
    await alert(fleet, "remediation", "n4", "info", "dry run, would: cordon n4 for xid", 1)
    await alert(fleet, "breaker_tripped", "_cluster", "critical", "3 nodes in 10 min", 2)
    page = await browser.new_page(viewport={"width": 1400, "height": 1000})
    await page.goto(url + "/ui/policy")
    await page.wait_for_selector("#policy ul.feed li:has-text('breaker_tripped')", timeout=HANG)
    assert "n4: cordon n4 for xid" in await page.inner_text("#policy")
    cluster = "#policy section[data-key='c1']"
    said = await page.inner_text(f"{cluster} > p")
    assert "tripped" in said and "fleetctl policy reset --cluster c1" in said
    assert "holds 1 of at most 2" in said
    assert "cordon n3: XID 79" in await page.inner_text(cluster)
    row = await texts(page, f"{cluster} tr[data-key='n1'] td")
    assert row[0] == "n1" and row[1] == "cordon" and row[3] == "gpu"
    assert row[4] == "needs a person (fleetctl policy clear)"
    assert row[5] == "XID 79 on GPU 0"
    assert row[6] == "done: drain-jobs; failed: reboot hook exited 1"
    assert "n1: 1 time, last" in await page.inner_text(cluster)
    decisions = await texts(page, "#policy ul.feed li")
    assert "breaker_tripped" in decisions[0] and "remediation" in decisions[1]
    await page.wait_for_selector("#live.on", timeout=HANG)
    await put_fact(fleet, BUCKET_POLICY, "c1", PolicyRecord(cluster="c1", limit=2))
    await page.wait_for_selector(f"{cluster} .badge.ok:text-is('closed')", timeout=HANG)
    assert await page.locator(f"{cluster} tr[data-key='n1']").count() == 0


async def test_the_maintenance_page_lists_windows_in_force_scheduled_and_ended(
    fleet: Fleet, browser: Any
) -> None:
    """Each window under its heading: in force (with the nodes it covers now), scheduled,
    ended; one scheduled after the page opened appears without a reload."""
    url, _ = await start_dashboard(fleet)
    await beat(fleet, "n1", stale_after=60.0)
    await wait_record(fleet.bus, fleet.prefix, "n1", lambda r: r.state == "active", 30)
    now = time.time()
    windows = {
        "now": MaintenanceWindow(id="now", since=now - 60, until=now + 3600, by=OPERATOR,
                                 nodes=["n1"], reason="firmware"),
        "later": MaintenanceWindow(id="later", since=now + 7200, until=now + 9000, by=OPERATOR,
                                   selector={"rack": "r2"}, cluster="c1"),
        "ended": MaintenanceWindow(id="ended", since=now - 9000, until=now - 7200, by=OPERATOR,
                                   nodes=["n9"]),
    }  # fmt: skip
    for key, window in windows.items():
        await put_fact(fleet, BUCKET_MAINTENANCE, key, window)
    page = await browser.new_page(viewport={"width": 1400, "height": 1000})
    await page.goto(url + "/ui/maintenance")
    await page.wait_for_selector("#maintenance tr[data-key='ended']", timeout=HANG)
    headings = await texts(page, "#maintenance h3")
    assert headings == ["In force", "Scheduled", "Ended (the last 20)"]
    under = (
        "[...document.querySelectorAll('#maintenance tr[data-key]')].map(r => "
        "r.closest('table').previousElementSibling.textContent + ':' + r.dataset.key)"
    )
    assert await page.evaluate(under) == [
        "In force:now",
        "Scheduled:later",
        "Ended (the last 20):ended",
    ]
    active = await texts(page, "#maintenance tr[data-key='now'] td")
    assert active[1] == "n1" and active[4].startswith("1 nodes now, ends in")
    assert active[5] == "firmware"
    later = await texts(page, "#maintenance tr[data-key='later'] td")
    assert later[1] == "rack=r2 in c1" and later[4].startswith("starts in")
    await page.wait_for_selector("#live.on", timeout=HANG)
    soon = MaintenanceWindow(id="soon", since=now + 600, until=now + 1200, by=OPERATOR,
                             nodes=["n2"], reason="cabling")  # fmt: skip
    await put_fact(fleet, BUCKET_MAINTENANCE, "soon", soon)
    await page.wait_for_selector("#maintenance tr[data-key='soon']", timeout=HANG)
    assert await page.evaluate(under) == [
        "In force:now",
        "Scheduled:soon",
        "Scheduled:later",
        "Ended (the last 20):ended",
    ]


async def test_the_node_page_says_labels_host_versions_maintenance_and_policy(
    fleet: Fleet, browser: Any
) -> None:
    """A node's page: the window covering it and the policy's hold as the fleet's facts,
    its host, driver and CUDA versions and labels as its claims, labelled so."""
    url, _ = await start_dashboard(fleet)
    now = time.time()
    host = HostFacts(uptime_s=7200.0, memory_used_pct=40.0, cpu_model="EPYC 9654",
                     gpu_driver_version="550.54.15", cuda_driver_version="12.4")  # fmt: skip
    await beat(fleet, "n1", stale_after=60.0, sample=sample(gpu(0, 50.0), host=host),
               labels={"rack": "r1", "zone": "a"})  # fmt: skip
    window = MaintenanceWindow(id="w7", since=now - 60, until=now + 3600, by=OPERATOR,
                               nodes=["n1"], reason="swap PSU")  # fmt: skip
    await put_fact(fleet, BUCKET_MAINTENANCE, "w7", window)
    hold = Hold(reason_class="engine", reason="vllm down", action="cordon", command_id="c2",
                since=now)  # fmt: skip
    await put_fact(fleet, BUCKET_POLICY, "c1", PolicyRecord(cluster="c1", holds={"n1": hold}))
    await wait_record(fleet.bus, fleet.prefix, "n1", lambda r: r.labels.get("rack") == "r1", 30)
    page = await browser.new_page(viewport={"width": 1400, "height": 1000})
    await page.goto(url + "/ui/nodes/n1")
    facts = "#detail table.facts"
    await page.wait_for_selector(f"{facts} td:has-text('window w7')", timeout=HANG)
    await page.wait_for_selector(f"{facts} td:has-text('cordon since')", timeout=HANG)
    maintenance = await page.inner_text(f"{facts} tr:has(th:text-is('Maintenance')) td")
    assert "window w7" in maintenance and "swap PSU" in maintenance
    policy = await page.inner_text(f"{facts} tr:has(th:text-is('Remediation policy')) td")
    assert "for engine: vllm down" in policy and "held" in policy
    assert "(node says)" in await page.inner_text("#detail h3:has-text('Host and versions')")
    rows = await page.eval_on_selector_all(
        "#detail h3:has-text('Host and versions') + table tr",
        "all => Object.fromEntries(all.map(r => [r.cells[0].innerText, r.cells[1].innerText]))",
    )
    assert rows["GPU driver"] == "550.54.15" and rows["CUDA (driver)"] == "12.4"
    assert rows["CPU"] == "EPYC 9654" and rows["Agent"] == "test"
    assert await texts(page, "#detail ul.labels li") == ["rack=r1", "zone=a"]


async def test_the_fleet_charts_count_nodes_by_state(fleet: Fleet, browser: Any) -> None:
    """The overview's nodes-by-state chart: its points count the fleet's active and stale
    nodes, its axes are labelled, and hovering reads a point out."""
    url, _ = await start_dashboard(fleet, dashboard_history_interval=1.0)
    await beat(fleet, "n1", stale_after=60.0)
    await beat(fleet, "n2", stale_after=60.0)
    await beat(fleet, "q1", stale_after=2.0)
    await wait_record(fleet.bus, fleet.prefix, "q1", lambda r: r.state == "stale", 30)
    page = await browser.new_page(viewport={"width": 1400, "height": 1000})
    await page.goto(url + "/")
    chart = "figure[data-chart='states']"
    newest = (
        f'(name) => {{ const values = document.querySelector("{chart} g.series[data-name=\'" '
        "+ name + \"']\").dataset.values.split(','); return values[values.length - 1]; }"
    )
    await page.wait_for_function(
        f"({newest})('active') === '2' && ({newest})('stale or offline') === '1'", timeout=HANG
    )
    assert "every node of the fleet" in await page.inner_text(f"{chart} figcaption")
    times = await page.eval_on_selector_all(
        f"{chart} text.axis-x", "all => all.map(e => e.textContent)"
    )
    assert "UTC" in times
    assert await page.locator(f"{chart} text.axis-y").count() >= 2
    assert await texts(page, f"{chart} ul.legend li") == [
        "active", "degraded", "unhealthy", "cordoned or draining", "stale or offline",
    ]  # fmt: skip
    # The plot's right end, now: an hour is 270 pixels, so the newest point is read out.
    await page.hover(f"{chart} svg", position={"x": 328, "y": 40})
    await page.wait_for_function(
        f"/UTC: .*active 2, .*stale or offline 1/.test("
        f'document.querySelector("{chart} output").textContent)',
        timeout=HANG,
    )
